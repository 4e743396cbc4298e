//! MySQL and MariaDB for the tests: the server on `MYSQL_URL`, and a database of each
//! test's own.

use oncely::mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use oncely::mysql::sqlx::{self, MySqlPool};
use oncely::mysql::{Table, migrate};
use oncely::record::{BatchAnswer, MysqlTransaction, MysqlTransactionalLayer, TransactionSafe};
use oncely::{BoxError, BusinessKey, Envelope, HandlerError, Outcome};
use tower::Layer;

use crate::commit_thief::{CommitAnswerThief, CommitOnTheWire};
use crate::postgres::{BoxedStack, RecordMode, boxed};

/// `MYSQL_URL`'s options: over TLS, trusting the test CA, when it names an `ssl-mode` (a
/// chaos run on TLS).
fn options() -> MySqlConnectOptions {
    let url = mysql_url();
    match url.contains("ssl-mode=") {
        true => oncely::tls::mysql::options(&url, &crate::tls::settings()).expect("a valid MYSQL_URL"),
        false => url.parse().expect("a valid MYSQL_URL"),
    }
}

/// The MySQL or MariaDB the tests use: `MYSQL_URL`, or `mysql://root@127.0.0.1:3306/test`.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A database no other test uses, and a pool of up to `size` connections to it. The
/// database is dropped with everything in it when the calling thread ends — the test's,
/// or its runtime's worker — even if the test panicked: the store suites' factories answer
/// a store alone, with nothing to hold a guard.
pub async fn scratch_database(size: u32) -> MySqlPool {
    thread_local! {
        static CREATED_HERE: std::cell::RefCell<Vec<DroppedDatabase>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let name = create_scratch_database().await;
    let pool = pool_on(&name, size, None).await;
    CREATED_HERE.with(|created| created.borrow_mut().push(DroppedDatabase(name)));
    pool
}

/// The prefix of every test database's name; the seconds since the epoch follow, then a
/// random token.
const SCRATCH_PREFIX: &str = "oncely_test_";

/// How old a test database must be for a later run to take it for one left behind by a
/// process that was killed, and drop it.
const LEFT_BEHIND_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// Creates a database no other test uses and answers its name. The first call of a process
/// drops the test databases that processes killed before their clean-up left behind.
async fn create_scratch_database() -> String {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let admin = admin_pool().await;
    SWEPT.get_or_init(|| sweep_left_behind(&admin)).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let name = format!("{SCRATCH_PREFIX}{now}_{}", oncely::Token::random());
    sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
        .execute(&admin)
        .await
        .expect("create the test's database");
    admin.close().await;
    name
}

/// Drops the test databases older than [`LEFT_BEHIND_AFTER`], or named before their names
/// carried their age: best effort.
async fn sweep_left_behind(admin: &MySqlPool) {
    let Ok(names) = sqlx::query_scalar::<_, String>("SHOW DATABASES LIKE 'oncely\\_test\\_%'")
        .fetch_all(admin)
        .await
    else {
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    for name in names {
        let created = name
            .strip_prefix(SCRATCH_PREFIX)
            .and_then(|rest| rest.split_once('_'))
            .and_then(|(seconds, _)| seconds.parse::<u64>().ok());
        if created.is_none_or(|created| now.saturating_sub(created) > LEFT_BEHIND_AFTER.as_secs()) {
            let _ = drop_database(admin, &name).await;
        }
    }
}

/// Drops `name`, waiting at most 5 s for a session that still holds its tables (a killed
/// one the server has not reaped): the default wait is a year.
async fn drop_database(admin: &MySqlPool, name: &str) -> Result<(), sqlx::Error> {
    let drop = format!("SET SESSION lock_wait_timeout = 5; DROP DATABASE IF EXISTS `{name}`");
    sqlx::raw_sql(&drop).execute(admin).await.map(|_| ())
}

/// A test database, dropped when this is dropped.
#[derive(Debug)]
pub struct DroppedDatabase(String);

impl DroppedDatabase {
    /// The database's name.
    pub fn name(&self) -> &str {
        &self.0
    }
}

impl Drop for DroppedDatabase {
    fn drop(&mut self) {
        let name = self.0.clone();
        crate::clean_up_on_own_thread(|| async move {
            let admin = admin_pool().await;
            drop_database(&admin, &name).await?;
            admin.close().await;
            Ok(())
        });
    }
}

/// A pool of two connections to `MYSQL_URL` itself (its own default database).
async fn admin_pool() -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(options())
        .await
        .unwrap_or_else(|error| {
            panic!("MySQL at MYSQL_URL ({error}); run integration-tests/services.sh mariadb")
        })
}

/// A database of one run's own, dropped with everything in it when the value is dropped,
/// and a pool to `MYSQL_URL`'s own default database beside it: the run names its tables
/// `NAME.table`, so that its connections are told apart from those the run watches (which
/// use the database).
#[derive(Debug)]
pub struct ScratchDatabase {
    name: String,
    admin: MySqlPool,
}

impl ScratchDatabase {
    /// Creates the database.
    pub async fn new() -> Self {
        let name = create_scratch_database().await;
        ScratchDatabase {
            name,
            admin: admin_pool().await,
        }
    }

    /// The database's name (letters, digits and `_`: it needs no quoting).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pool on `MYSQL_URL`'s default database.
    pub fn admin(&self) -> &MySqlPool {
        &self.admin
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        crate::clean_up_on_own_thread(|| async move {
            let admin = admin_pool().await;
            drop_database(&admin, &name).await?;
            admin.close().await;
            Ok(())
        });
    }
}

/// A pool of up to `size` connections to `database` on `MYSQL_URL` that connects when first
/// used, as a consumer process's pool does (it must start while the server is down).
pub fn lazy_pool_on(database: &str, size: u32) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(size)
        .connect_lazy_with(options().database(database))
}

impl RecordMode {
    /// `handler` behind the MySQL transactional record on `pool` and `table`, in this mode.
    pub fn mysql_stack<S>(self, pool: &MySqlPool, table: Table, handler: S) -> BoxedStack
    where
        S: tower::Service<Envelope, Response = Outcome> + TransactionSafe + Clone + Send + Sync + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        let records = MysqlTransactionalLayer::new(pool.clone(), table);
        match self {
            RecordMode::PerDelivery => boxed(records.layer(handler)),
            RecordMode::Batched => boxed(records.batched().layer(handler)),
        }
    }
}

/// A pool of up to `size` connections to `database` on `MYSQL_URL`, in the session time zone
/// `time_zone` (sqlx's default, UTC, if none).
pub async fn pool_on(database: &str, size: u32, time_zone: Option<&str>) -> MySqlPool {
    let options = options().database(database);
    let options = match time_zone {
        Some(zone) => options.timezone(Some(zone.to_owned())),
        None => options,
    };
    MySqlPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await
        .expect("a pool on the test's database")
}

/// A database of one test's own with oncely's record table (`consumption_record`) and a
/// business table, `stock_moves (order_id VARCHAR(64) PRIMARY KEY)`: one row per effect,
/// so a second effect of one order is a unique violation.
#[derive(Clone, Debug)]
pub struct StockDatabase {
    /// Its name.
    pub name: String,
    /// A pool on it, for the tests' own reads.
    pub pool: MySqlPool,
    /// Drops the database when the last clone goes.
    _dropped: std::sync::Arc<DroppedDatabase>,
}

impl StockDatabase {
    /// Creates the database and its two tables.
    pub async fn new() -> Self {
        let name = create_scratch_database().await;
        let pool = pool_on(&name, 4, None).await;
        migrate(&pool, &Self::records())
            .await
            .expect("migrate the record table");
        sqlx::raw_sql("CREATE TABLE stock_moves (order_id VARCHAR(64) NOT NULL PRIMARY KEY) ENGINE = InnoDB")
            .execute(&pool)
            .await
            .expect("create the business table");
        StockDatabase {
            _dropped: std::sync::Arc::new(DroppedDatabase(name.clone())),
            name,
            pool,
        }
    }

    /// The record table.
    pub fn records() -> Table {
        Table::new("consumption_record").expect("a valid name")
    }

    /// A pool of up to `size` connections to the database.
    pub async fn pool(&self, size: u32) -> MySqlPool {
        pool_on(&self.name, size, None).await
    }

    /// A pool of up to `size` connections to the database through `thief`.
    pub async fn pool_through(&self, thief: &CommitAnswerThief, size: u32) -> MySqlPool {
        // The thief reads the protocol, so in plain text: with sqlx's TLS compiled in
        // (oncely's `tls`), its default mode encrypts once the server offers TLS.
        let options = options()
            .host("127.0.0.1")
            .port(thief.port())
            .database(&self.name)
            .ssl_mode(sqlx::mysql::MySqlSslMode::Disabled);
        MySqlPoolOptions::new()
            .max_connections(size)
            .connect_with(options)
            .await
            .expect("a pool through the proxy")
    }

    /// How many stock moves `order` has.
    pub async fn moves_of(&self, order: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM stock_moves WHERE order_id = ?")
            .bind(order)
            .fetch_one(&self.pool)
            .await
            .expect("count the moves")
    }

    /// How many stock moves there are in all.
    pub async fn all_moves(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM stock_moves")
            .fetch_one(&self.pool)
            .await
            .expect("count the moves")
    }

    /// The status of `key`'s record, if it has one.
    pub async fn status_of(&self, key: &str) -> Option<String> {
        sqlx::query_scalar("SELECT status FROM consumption_record WHERE message_key = ?")
            .bind(key)
            .fetch_optional(&self.pool)
            .await
            .expect("read the record")
    }
}

/// The effect of the MySQL tests' stock-deduction handlers, for
/// `MysqlTransactionalLayer::handler`: the order's stock move, in the record's transaction.
pub async fn stock_move(tx: MysqlTransaction, order: BusinessKey) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO stock_moves (order_id) VALUES (?)")
        .bind(order.as_str())
        .execute(&tx)
        .await?;
    Ok(())
}

/// The same effect as a batch handler, for `MysqlBatchedLayer::batch_handler`: the stock
/// moves of a whole batch in one multi-row `INSERT`.
pub async fn stock_moves(tx: MysqlTransaction, batch: Vec<Envelope>) -> Result<BatchAnswer, HandlerError> {
    let mut insert = sqlx::QueryBuilder::new("INSERT INTO stock_moves (order_id) ");
    insert.push_values(&batch, |mut row, envelope| {
        row.push_bind(envelope.key().as_str().to_owned());
    });
    insert.build().execute(&tx).await?;
    Ok(BatchAnswer::processed())
}

impl CommitAnswerThief {
    /// Starts the proxy in front of `MYSQL_URL`'s server; it loses the answer to the tier's
    /// `XA COMMIT`.
    pub async fn start_mysql() -> Self {
        let options = options();
        let server = format!("{}:{}", options.get_host(), options.get_port());
        let commit = CommitOnTheWire {
            sent: b"XA COMMIT",
            answered: None,
        };
        CommitAnswerThief::relaying(server, commit).await
    }
}
