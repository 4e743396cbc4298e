//! Run with: `cargo run -p first-consumer --bin send-red-packets && cargo run -p first-consumer`
//!
//! The README's first consumer: credits each red packet of the `red-packets` queue to its
//! user's wallet once — the Redis flag in front of the PostgreSQL record, whose transaction
//! also holds the wallet update — and stops once the queue is drained, printing the report.
//! Settings: `AMQP_ADDR`, `REDIS_URL`, `DATABASE_URL` (loopback defaults).

use std::time::Duration;

use first_consumer::{CREDIT, amqp, redis, setup};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{HandlerError, Json, KeyExtractor, Route};
use oncely_amqp::{Runner, Topology};
use tower::ServiceBuilder;

#[derive(serde::Deserialize)]
struct RedPacket {
    user: String,
    cents: u32,
}

// A body that is not a RedPacket (negative cents too) is dead-lettered as `bad_body`.
async fn credit(tx: PgTransaction, Json(packet): Json<RedPacket>) -> Result<(), HandlerError> {
    tx.execute(CREDIT, &[&packet.user, &i64::from(packet.cents)])
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (pool, records) = setup().await?;
    let flag = FlagLayer::new(RedisFlagStore::new(redis().await?), Duration::from_secs(3600));
    let stack = ServiceBuilder::new()
        .layer(flag.with_record_behind())
        .service(PgTransactionalLayer::new(pool, records).handler(credit));
    let route = Route::new("credit", KeyExtractor::json_pointer("/packetId"), stack);
    let runner = Runner::new(route, Topology::new("red-packets")).with_drain(Duration::from_secs(2));
    let report = runner.run_with_reconnect(amqp, &Default::default()).await?;
    println!("{report}");
    Ok(())
}
