//! PostgreSQL for the tests: pools on `DATABASE_URL`, and a schema of each test's own.

use deadpool_postgres::tokio_postgres::{Config, NoTls};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use oncely::postgres::Table;
use oncely::record::PgTransaction;
use oncely::{BusinessKey, Envelope, HandlerError};

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

fn pool_on(url: &str, size: usize) -> Pool {
    let config: Config = url.parse().expect("a valid DATABASE_URL");
    let manager = Manager::from_config(
        config,
        NoTls,
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
        // Drop cannot await: a thread with its own runtime drops the schema, and joining it
        // keeps the next test from seeing a half-dropped schema.
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let client = pool(1).get().await.map_err(std::io::Error::other)?;
                client
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                    .await
                    .map_err(std::io::Error::other)
            })
        })
        .join();
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
pub async fn stock_move(tx: PgTransaction, order: BusinessKey) -> Result<(), HandlerError> {
    tx.execute(
        "INSERT INTO stock_moves (order_id) VALUES ($1)",
        &[&order.as_str()],
    )
    .await?;
    Ok(())
}
