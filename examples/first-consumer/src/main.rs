//! Run with: `cargo run -p first-consumer --bin send-red-packets && cargo run -p first-consumer`
//!
//! The README's first consumer: credits each red packet of the `red-packets` queue to its
//! user's wallet once — the Redis flag in front of the PostgreSQL record, whose transaction
//! also holds the wallet update — and stops once the queue is drained, printing the report.
//! Settings: `AMQP_ADDR`, `REDIS_URL`, `DATABASE_URL` (loopback defaults; `amqps://`,
//! `rediss://` and `sslmode=require` connect over TLS) and `ONCELY_CA_CERT`,
//! `ONCELY_TLS_CERT`, `ONCELY_TLS_KEY` (the CA to trust, a client certificate). Whole: paste
//! it into a new crate's `main.rs` with this crate's dependencies and it runs.

use std::time::Duration;

use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::deadpool_postgres::Pool;
use oncely::postgres::{Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::tls::TlsSettings;
use oncely::{HandlerError, Json, KeyExtractor, Route};
use oncely_amqp::lapin::{Connection, ConnectionProperties, runtime};
use oncely_amqp::{Runner, Topology};
use tower::ServiceBuilder;

#[derive(serde::Deserialize)]
struct RedPacket {
    user: String,
    cents: u32,
}

const CREDIT: &str = "INSERT INTO red_packets.wallets (user_id, cents) VALUES ($1, $2)
     ON CONFLICT (user_id) DO UPDATE SET cents = wallets.cents + EXCLUDED.cents";

// A body that is not a RedPacket (negative cents too) is dead-lettered as `bad_body`.
async fn credit(tx: PgTransaction, Json(packet): Json<RedPacket>) -> Result<(), HandlerError> {
    tx.execute(CREDIT, &[&packet.user, &i64::from(packet.cents)])
        .await?;
    Ok(())
}

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // oncely logs through `tracing`: dead letters and panics at warn and error, on stderr.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stderr)
        .init();

    // TLS where a URL asks for it, trusting ONCELY_CA_CERT (else the platform's authorities).
    let tls = TlsSettings::from_env()?;
    let url = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let config = oncely::tls::postgres::config(&url, &tls)?;
    let pool = Pool::builder(oncely::tls::postgres::manager(config, &tls, Default::default())?)
        .max_size(16)
        .build()?;
    // The record table, and the wallets the handler credits (both idempotent).
    let records = Table::new("red_packets", "consumption_record")?;
    migrate(&pool, &records).await?;
    let wallets =
        "CREATE TABLE IF NOT EXISTS red_packets.wallets (user_id TEXT PRIMARY KEY, cents BIGINT NOT NULL)";
    pool.get().await?.batch_execute(wallets).await?;

    let redis_url = setting("REDIS_URL", "redis://127.0.0.1:6379");
    let redis = oncely::tls::redis::client(redis_url, &tls)?
        .get_connection_manager()
        .await?;
    let flag = FlagLayer::new(RedisFlagStore::new(redis), Duration::from_secs(3600));
    let stack = ServiceBuilder::new()
        .layer(flag.with_record_behind())
        .service(PgTransactionalLayer::new(pool, records).handler(credit));
    let route = Route::new("credit", KeyExtractor::json_pointer("/packetId"), stack);

    // The runner declares the topology's queues when it starts (a producer that may send
    // first declares the same `Topology`), and reconnects with `amqp` when the connection drops.
    let amqp_addr = setting("AMQP_ADDR", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let amqp_tls = oncely_amqp::tls::config(&tls)?;
    let amqp = || {
        let (address, tls) = (amqp_addr.clone(), amqp_tls.clone());
        let properties = ConnectionProperties::default();
        async move {
            Connection::connect_with_config(&address, properties, tls, runtime::default_runtime()?).await
        }
    };
    let runner = Runner::new(route, Topology::new("red-packets")).with_drain(Duration::from_secs(2));
    let report = runner.run_with_reconnect(amqp, &Default::default()).await?;
    println!("{report}");
    Ok(())
}
