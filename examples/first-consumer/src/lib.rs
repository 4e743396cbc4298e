//! Run with: the `first-consumer` and `send-red-packets` binaries of this crate; see
//! `examples/README.md`.
//!
//! What the README's first consumer leaves out to stay short: connections from the
//! environment and the tables.

use std::future::Future;

use oncely::postgres::deadpool_postgres::tokio_postgres::NoTls;
use oncely::postgres::deadpool_postgres::{Manager, Pool};
use oncely::postgres::{Table, migrate};
use oncely::redis::aio::ConnectionManager;
use oncely_amqp::lapin::{Connection, ConnectionProperties};

/// The work queue.
pub const QUEUE: &str = "red-packets";

/// Adds a packet's cents to its user's wallet, creating the wallet on the first one.
pub const CREDIT: &str = "INSERT INTO red_packets.wallets (user_id, cents) VALUES ($1, $2)
     ON CONFLICT (user_id) DO UPDATE SET cents = wallets.cents + EXCLUDED.cents";

/// `name` from the environment, or `default`.
pub fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// A connection to RabbitMQ at `AMQP_ADDR`, for the runner to (re)connect with.
pub fn amqp() -> impl Future<Output = Result<Connection, oncely_amqp::lapin::Error>> {
    let address = setting("AMQP_ADDR", "amqp://guest:guest@127.0.0.1:5672/%2f");
    async move { Connection::connect(&address, ConnectionProperties::default()).await }
}

/// A pool on `DATABASE_URL`.
fn postgres() -> Result<Pool, Box<dyn std::error::Error>> {
    let url = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    Ok(Pool::builder(Manager::new(url.parse()?, NoTls))
        .max_size(16)
        .build()?)
}

/// A connection manager on `REDIS_URL`.
pub async fn redis() -> Result<ConnectionManager, oncely::redis::RedisError> {
    let url = setting("REDIS_URL", "redis://127.0.0.1:6379");
    oncely::redis::Client::open(url)?.get_connection_manager().await
}

/// A pool on `DATABASE_URL`, and the record table: creates the schema `red_packets` with the
/// record table and the wallets.
pub async fn setup() -> Result<(Pool, Table), Box<dyn std::error::Error>> {
    let pool = postgres()?;
    let records = Table::new("red_packets", "consumption_record")?;
    migrate(&pool, &records).await?;
    pool.get()
        .await?
        .batch_execute("CREATE TABLE IF NOT EXISTS red_packets.wallets (user_id TEXT PRIMARY KEY, cents BIGINT NOT NULL)")
        .await?;
    Ok((pool, records))
}
