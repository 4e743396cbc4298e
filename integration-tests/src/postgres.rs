//! PostgreSQL for the tests: pools on `DATABASE_URL`, and a schema of each test's own.

use deadpool_postgres::tokio_postgres::config::Host;
use deadpool_postgres::tokio_postgres::{Config, NoTls};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use oncely::postgres::Table;
use oncely::record::{BatchAnswer, CommitRows, PgTransaction, PgTransactionalLayer, TransactionSafe};
use oncely::{BoxError, BusinessKey, Envelope, HandlerError, Outcome};
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};

pub use crate::commit_thief::{CommitAnswerThief, CommitOnTheWire};

/// The PostgreSQL the tests use: `DATABASE_URL`, or `postgres://postgres@127.0.0.1:5432/test`.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A pool of up to `size` connections to `DATABASE_URL`.
pub fn pool(size: usize) -> Pool {
    pool_on(&database_url(), size)
}

/// A pool of up to `size` connections to `DATABASE_URL` that search `schema` first, so
/// handlers write their tables unqualified.
pub fn schema_pool(schema: &str, size: usize) -> Pool {
    let url = database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    pool_on(&format!("{url}{separator}options=-csearch_path%3D{schema}"), size)
}

/// A pool of up to `size` connections to `url`: over TLS, trusting the test CA, when its
/// `sslmode` asks for it (`require`, `verify-ca`, `verify-full`; a chaos run on TLS).
pub fn pool_on(url: &str, size: usize) -> Pool {
    match ["sslmode=require", "sslmode=verify"]
        .iter()
        .any(|mode| url.contains(mode))
    {
        true => {
            let settings = crate::tls::settings();
            let config = oncely::tls::postgres::config(url, &settings).expect("a valid DATABASE_URL");
            let connector = oncely::tls::postgres::connector(&settings).expect("the test certificates");
            pool_with(config, size, connector)
        }
        false => pool_with(url.parse().expect("a valid DATABASE_URL"), size, NoTls),
    }
}

/// A pool of up to `size` connections of `config`, through `tls`.
fn pool_with<T>(config: Config, size: usize, tls: T) -> Pool
where
    T: deadpool_postgres::tokio_postgres::tls::MakeTlsConnect<deadpool_postgres::tokio_postgres::Socket>
        + Clone
        + Sync
        + Send
        + 'static,
    T::Stream: Sync + Send,
    T::TlsConnect: Sync + Send,
    <T::TlsConnect as deadpool_postgres::tokio_postgres::tls::TlsConnect<
        deadpool_postgres::tokio_postgres::Socket,
    >>::Future: Send,
{
    let manager = Manager::from_config(
        config,
        tls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager).max_size(size).build().expect("a pool")
}

/// A schema of one test's own, with oncely's record table (`consumption_record`) and entity
/// state table (`entity_state`) migrated into it. Dropped with everything in it when the
/// value is dropped, even if the test panicked.
#[derive(Debug)]
pub struct ScratchSchema {
    name: String,
    pool: Pool,
}

impl ScratchSchema {
    /// Creates the schema and migrates both tables.
    pub async fn new(pool: &Pool) -> Self {
        let name = format!("t_{}", oncely::Token::random());
        let schema = ScratchSchema {
            name,
            pool: pool.clone(),
        };
        oncely::postgres::migrate(pool, &schema.records())
            .await
            .expect("migrate the record table");
        oncely::postgres::migrate_state(pool, &schema.table("entity_state"))
            .await
            .expect("migrate the state table");
        schema
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The record table.
    pub fn records(&self) -> Table {
        self.table("consumption_record")
    }

    /// A table of this schema.
    pub fn table(&self, name: &str) -> Table {
        Table::new(&self.name, name).expect("a valid table name")
    }

    /// Runs `sql` (several statements allowed) in this schema.
    pub async fn execute(&self, sql: &str) {
        let client = self.pool.get().await.expect("a connection");
        client
            .batch_execute(&format!("SET search_path TO {}; {sql}", self.name))
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    /// The number `sql` (a `SELECT count(*)` or similar) returns, in this schema.
    pub async fn count(&self, sql: &str) -> i64 {
        let client = self.pool.get().await.expect("a connection");
        client
            .batch_execute(&format!("SET search_path TO {}", self.name))
            .await
            .expect("search_path");
        client
            .query_one(sql, &[])
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
            .get(0)
    }
}

impl Drop for ScratchSchema {
    fn drop(&mut self) {
        let name = self.name.clone();
        crate::clean_up_on_own_thread(|| async move {
            let client = pool(1).get().await?;
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                .await?;
            Ok(())
        });
    }
}

/// The business effect of the tests' stock-deduction handlers: one `stock_moves` row for the
/// envelope's key, written in the transaction the record tier hands on (untyped).
pub async fn insert_stock_move(envelope: &Envelope) -> Result<(), HandlerError> {
    let tx = envelope
        .extensions()
        .get::<PgTransaction>()
        .expect("the transactional record tier in front")
        .clone();
    stock_move(tx, envelope.key().clone()).await
}

/// The same effect as a typed handler, for `PgTransactionalLayer::handler`.
/// The statement is prepared once per connection: a statement given as text costs a round
/// trip to prepare it each time, which adds up in a batch, whose handlers run one by one.
pub async fn stock_move(tx: PgTransaction, order: BusinessKey) -> Result<(), HandlerError> {
    let insert = tx
        .prepare_cached("INSERT INTO stock_moves (order_id) VALUES ($1)")
        .await?;
    tx.execute(&insert, &[&order.as_str()]).await?;
    Ok(())
}

/// The stock moves of many orders (`$1`, an array) in one statement.
const INSERT_STOCK_MOVES: &str = "INSERT INTO stock_moves (order_id) SELECT unnest($1::text[])";

/// The same effect from a per-delivery handler that leaves its row to the record's commit
/// ([`PgTransaction::defer`]): the rows of a batch's handlers are written by one `INSERT`
/// just before the batch commits, instead of a statement per handler.
pub fn defer_stock_move(envelope: &Envelope) {
    let tx = envelope
        .extensions()
        .get::<PgTransaction>()
        .expect("the transactional record tier in front");
    tx.defer(StockMovesAtCommit(vec![envelope.key().as_str().to_owned()]));
}

/// Stock moves deferred to the record's commit: the orders of every handler in the
/// transaction, written by one statement.
struct StockMovesAtCommit(Vec<String>);

impl CommitRows for StockMovesAtCommit {
    fn absorb(&mut self, more: Self) -> Option<Self> {
        self.0.extend(more.0);
        None
    }

    async fn write(
        self,
        client: &deadpool_postgres::Client,
    ) -> Result<(), deadpool_postgres::tokio_postgres::Error> {
        // Prepared once per connection, as the batch handler's: not a round trip per batch.
        let insert = client.prepare_cached(INSERT_STOCK_MOVES).await?;
        client.execute(&insert, &[&self.0]).await?;
        Ok(())
    }
}

/// The same effect as a batch handler, for `PgBatchedLayer::batch_handler`: one `INSERT`
/// for the stock moves of the whole batch.
pub async fn stock_moves(tx: PgTransaction, batch: Vec<Envelope>) -> Result<BatchAnswer, HandlerError> {
    let orders: Vec<&str> = batch.iter().map(|envelope| envelope.key().as_str()).collect();
    let insert = tx.prepare_cached(INSERT_STOCK_MOVES).await?;
    tx.execute(&insert, &[&orders]).await?;
    Ok(BatchAnswer::processed())
}

/// The test's schema with a `stock_moves` table (one row per order at most), and a pool of
/// `size` connections that search it first.
pub async fn stock_schema(size: usize) -> (ScratchSchema, Pool) {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE stock_moves (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL UNIQUE)")
        .await;
    let pool = schema_pool(schema.name(), size);
    (schema, pool)
}

/// How a test runs the transactional record: one transaction per delivery, or batched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordMode {
    /// `PgTransactionalLayer`.
    PerDelivery,
    /// `PgTransactionalLayer::batched()`, with its defaults.
    Batched,
}

/// The stack a [`RecordMode`] builds, boxed so that both modes have one type.
pub type BoxedStack = BoxCloneSyncService<Envelope, Outcome, BoxError>;

impl RecordMode {
    /// Both modes: the suites that hold for the transactional record run in each.
    pub const ALL: [RecordMode; 2] = [RecordMode::PerDelivery, RecordMode::Batched];

    /// `handler` behind the transactional record on `pool` and `table`, in this mode.
    pub fn stack<S>(self, pool: &Pool, table: Table, handler: S) -> BoxedStack
    where
        S: tower::Service<Envelope, Response = Outcome> + TransactionSafe + Clone + Send + Sync + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        let records = PgTransactionalLayer::new(pool.clone(), table);
        match self {
            RecordMode::PerDelivery => boxed(records.layer(handler)),
            RecordMode::Batched => boxed(records.batched().layer(handler)),
        }
    }
}

/// `stack` as a [`BoxedStack`].
pub fn boxed<S>(stack: S) -> BoxedStack
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(stack.map_err(Into::into))
}

impl CommitAnswerThief {
    /// Starts the proxy in front of `DATABASE_URL`'s server.
    pub async fn start() -> Self {
        let config: Config = database_url().parse().expect("a valid DATABASE_URL");
        let server = match (config.get_hosts().first(), config.get_ports().first()) {
            (Some(Host::Tcp(host)), port) => format!("{host}:{}", port.copied().unwrap_or(5432)),
            _ => panic!("the proxy needs DATABASE_URL to name a TCP host"),
        };
        // The command tag the server sends once the commit is durable.
        let commit = CommitOnTheWire {
            sent: b"COMMIT",
            answered: Some(b"COMMIT\0"),
        };
        CommitAnswerThief::relaying(server, commit).await
    }

    /// A pool of `size` connections through the proxy that search `schema` first.
    pub fn schema_pool(&self, schema: &str, size: usize) -> Pool {
        // `Config::host` adds a host to the URL's rather than replacing it: start afresh.
        let server: Config = database_url().parse().expect("a valid DATABASE_URL");
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.port())
            .options(format!("-csearch_path={schema}"));
        if let Some(user) = server.get_user() {
            config.user(user);
        }
        if let Some(password) = server.get_password() {
            config.password(password);
        }
        if let Some(database) = server.get_dbname() {
            config.dbname(database);
        }
        pool_with(config, size, NoTls)
    }
}
