//! The run's schema (PostgreSQL) or database (MySQL/MariaDB) and what the run reads back from
//! it: the business table against the ledger, the throughput windows, the handler faults
//! that fired. Each store answers a few plain queries; the windows and counts are worked out
//! here, once for both.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::Row;
use integration_tests::chaos_stack::{ChaosStore, HandlerFault};
use integration_tests::mysql::{ScratchDatabase, pool_on};
use integration_tests::postgres::{ScratchSchema, pool};
use oncely::mysql::sqlx::{self, MySqlPool};

/// The throughput window: longer than the pauses the faults cause by design (Redis down for
/// a second, a consumer process restarting, a claim waiting out its 3-second lease), short
/// enough that a stalled consumer shows.
pub(crate) const WINDOW: Duration = Duration::from_secs(5);

/// The business table against the publisher's ledger, per order key.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ledger {
    /// First parts written: one per effect applied.
    pub(crate) effects: i64,
    /// Keys with at least one part.
    pub(crate) applied_keys: i64,
    /// Keys with either part written more than once.
    pub(crate) doubled: i64,
    /// Keys with more of one part than of the other: an effect applied in half.
    pub(crate) partial: i64,
}

/// Effects applied per throughput window between the first handler panic and the last
/// message sent; none without a panic, or with less than a window between the two.
#[derive(Clone, Debug, Default)]
pub(crate) struct Throughput {
    pub(crate) windows: Vec<i64>,
    /// Windows left out: they overlap a RocketMQ broker restart's client lockout.
    pub(crate) locked_out: usize,
}

impl Throughput {
    /// The fewest effects applied in one window.
    pub(crate) fn lowest(&self) -> Option<i64> {
        self.windows.iter().copied().min()
    }

    /// Effects applied per window (the write times of first parts, `effects`), in whole
    /// windows counted back from `published` (when the last message was sent) to
    /// `first_panic`, every window counted, also the empty ones, except those that overlap
    /// one of `lockouts`, a broker restart's (no client can reach the broker then). While
    /// messages arrive, new keys keep arriving, so a healthy consumer applies some in every
    /// window; after the last one, only the retries of a few keys are left, some waiting out
    /// a lease, and a quiet window there is no stall.
    fn of(
        effects: &[SystemTime],
        first_panic: Option<SystemTime>,
        published: SystemTime,
        lockouts: &[(SystemTime, SystemTime)],
    ) -> Self {
        let mut throughput = Throughput::default();
        let Some(span) = first_panic.and_then(|start| published.duration_since(start).ok()) else {
            return throughput;
        };
        let whole_windows = (span.as_secs_f64() / WINDOW.as_secs_f64()) as u32;
        for back in (1..=whole_windows).rev() {
            let opens = published - WINDOW * back;
            let closes = opens + WINDOW;
            if (lockouts.iter()).any(|(from, to)| opens < *to && closes > *from) {
                throughput.locked_out += 1;
            } else {
                let applied = effects.iter().filter(|at| (opens..closes).contains(*at)).count();
                throughput.windows.push(applied as i64);
            }
        }
        throughput
    }
}

/// What the run reads back at the end.
pub(crate) struct Readings {
    pub(crate) ledger: Ledger,
    pub(crate) throughput: Throughput,
    /// The handler faults that took effect, per kind, as the consumers logged them.
    pub(crate) handler_faults: BTreeMap<HandlerFault, i64>,
    /// When the last effect was written, if any was.
    pub(crate) last_effect_at: Option<SystemTime>,
}

/// The run's schema or database with the chaos stack's tables, and a pool of the run's own
/// to it that the faults leave alone. Dropping it drops the schema or database.
pub(crate) enum Tables {
    /// A PostgreSQL schema.
    Postgres { schema: ScratchSchema, pool: Pool },
    /// A MySQL/MariaDB database, read through a pool on `MYSQL_URL`'s default database.
    Mysql(ScratchDatabase),
}

impl Tables {
    /// A fresh schema or database on `store` with the record table and the chaos stack's
    /// tables in it.
    pub(crate) async fn create(store: ChaosStore) -> Self {
        match store {
            ChaosStore::Postgres => {
                let pool = pool(2);
                let schema = ScratchSchema::new(&pool).await;
                schema.execute(store.tables()).await;
                Tables::Postgres { schema, pool }
            }
            ChaosStore::Mysql => {
                let database = ScratchDatabase::new().await;
                // One connection on the database, closed before the consumers start: the
                // faults end every session on it.
                let setup = pool_on(database.name(), 1, None).await;
                let records = oncely::mysql::Table::new("consumption_record").expect("a valid name");
                oncely::mysql::migrate(&setup, &records)
                    .await
                    .expect("migrate the record table");
                sqlx::raw_sql(store.tables())
                    .execute(&setup)
                    .await
                    .expect("create the chaos tables");
                setup.close().await;
                Tables::Mysql(database)
            }
        }
    }

    /// The schema's or database's name.
    pub(crate) fn name(&self) -> &str {
        match self {
            Tables::Postgres { schema, .. } => schema.name(),
            Tables::Mysql(database) => database.name(),
        }
    }

    /// Ends the consumers' database sessions: on PostgreSQL those whose `application_name`
    /// is `name` (`pg_terminate_backend`), on MySQL/MariaDB those using the run's database
    /// (`KILL`); false if none was open.
    pub(crate) async fn end_consumer_sessions(&self, name: &str) -> bool {
        let ended = match self {
            Tables::Postgres { pool, .. } => {
                // A fault that found nothing to act on, not a failed run, if PostgreSQL does
                // not answer.
                let terminated = async {
                    let sql = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1";
                    let row = pool.get().await.ok()?.query_one(sql, &[&name]).await.ok()?;
                    Some(row.get::<_, i64>(0))
                };
                terminated.await.unwrap_or(0)
            }
            Tables::Mysql(database) => kill_sessions_on(database).await,
        };
        ended > 0
    }

    /// The business table, per key, as the ledger counts it.
    pub(crate) async fn ledger(&self) -> Ledger {
        let numbers: Vec<i64> = match self {
            Tables::Postgres { pool, .. } => {
                let rows = self
                    .postgres(
                        pool,
                        "SELECT count(*), coalesce(sum(first), 0)::bigint,
                                count(*) FILTER (WHERE first > 1 OR second > 1),
                                count(*) FILTER (WHERE first <> second)
                         FROM (SELECT count(*) FILTER (WHERE part = 1) AS first,
                                      count(*) FILTER (WHERE part = 2) AS second
                               FROM {schema}.stock_moves GROUP BY order_id) per_key",
                        &[],
                    )
                    .await;
                (0..4).map(|column| rows[0].get(column)).collect()
            }
            Tables::Mysql(database) => {
                let sql = self.named(
                    "SELECT CAST(count(*) AS SIGNED), CAST(coalesce(sum(first), 0) AS SIGNED),
                            CAST(coalesce(sum(first > 1 OR second > 1), 0) AS SIGNED),
                            CAST(coalesce(sum(first <> second), 0) AS SIGNED)
                     FROM (SELECT sum(part = 1) AS first, sum(part = 2) AS second
                           FROM {schema}.stock_moves GROUP BY order_id) per_key",
                );
                let row: (i64, i64, i64, i64) = sqlx::query_as(&sql)
                    .fetch_one(database.admin())
                    .await
                    .unwrap_or_else(|error| panic!("{sql}: {error}"));
                vec![row.0, row.1, row.2, row.3]
            }
        };
        Ledger {
            applied_keys: numbers[0],
            effects: numbers[1],
            doubled: numbers[2],
            partial: numbers[3],
        }
    }

    /// The ledger, the throughput windows up to `published` (leaving out `lockouts`), the
    /// handler faults and the last effect's time.
    pub(crate) async fn read(
        &self,
        published: SystemTime,
        lockouts: &[(SystemTime, SystemTime)],
    ) -> Readings {
        let rows = self.timeline("stock_moves", "created_at", "part").await;
        let effects: Vec<SystemTime> = (rows.iter())
            .filter(|(_, part)| part == "1")
            .map(|(at, _)| *at)
            .collect();
        let faults = self.timeline("chaos_faults", "at", "kind").await;
        let mut handler_faults = BTreeMap::new();
        for (_, code) in &faults {
            if let Some(fault) = HandlerFault::from_code(code) {
                *handler_faults.entry(fault).or_insert(0) += 1;
            }
        }
        let first_panic = (faults.iter())
            .filter(|(_, code)| code == HandlerFault::Panic.code())
            .map(|(at, _)| *at)
            .min();
        Readings {
            ledger: self.ledger().await,
            throughput: Throughput::of(&effects, first_panic, published, lockouts),
            handler_faults,
            last_effect_at: rows.iter().map(|(at, _)| *at).max(),
        }
    }

    /// The rows of `table` as their time column `at` and the column `label` as text.
    async fn timeline(&self, table: &str, at: &str, label: &str) -> Vec<(SystemTime, String)> {
        match self {
            Tables::Postgres { pool, .. } => {
                let sql = format!("SELECT {at}, {label}::text FROM {{schema}}.{table}");
                let rows = self.postgres(pool, &sql, &[]).await;
                rows.iter().map(|row| (row.get(0), row.get(1))).collect()
            }
            Tables::Mysql(database) => {
                // Microseconds since the epoch: sqlx reads no `DATETIME` without its time
                // crates, and the session's time zone (UTC) is the one the rows were
                // written in.
                let sql = self.named(&format!(
                    "SELECT CAST(UNIX_TIMESTAMP({at}) * 1000000 AS SIGNED), CAST({label} AS CHAR)
                     FROM {{schema}}.{table}"
                ));
                let rows: Vec<(i64, String)> = sqlx::query_as(&sql)
                    .fetch_all(database.admin())
                    .await
                    .unwrap_or_else(|error| panic!("{sql}: {error}"));
                let at = |micros: i64| SystemTime::UNIX_EPOCH + Duration::from_micros(micros as u64);
                rows.into_iter()
                    .map(|(micros, label)| (at(micros), label))
                    .collect()
            }
        }
    }

    /// `sql` with `{schema}` replaced by the run's schema or database.
    fn named(&self, sql: &str) -> String {
        sql.replace("{schema}", self.name())
    }

    /// The rows `sql` returns on PostgreSQL with `params`, `{schema}` in it replaced.
    async fn postgres(
        &self,
        pool: &Pool,
        sql: &str,
        params: &[&(dyn deadpool_postgres::tokio_postgres::types::ToSql + Sync)],
    ) -> Vec<Row> {
        let sql = self.named(sql);
        let client = pool.get().await.expect("PostgreSQL");
        client
            .query(&sql, params)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }
}

/// `KILL`s every session using `database` (the run's own use `MYSQL_URL`'s default
/// database) and says how many; 0 if the server did not answer.
async fn kill_sessions_on(database: &ScratchDatabase) -> i64 {
    let admin: &MySqlPool = database.admin();
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST WHERE DB = ?")
            .bind(database.name())
            .fetch_all(admin)
            .await
            .unwrap_or_default();
    let mut killed = 0;
    for id in ids {
        // `KILL` takes no placeholder; the id is a number the server gave.
        if sqlx::raw_sql(&format!("KILL {id}")).execute(admin).await.is_ok() {
            killed += 1;
        }
    }
    killed
}
