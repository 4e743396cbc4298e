//! Run with: `cargo run -p amqp-orders --bin consumer` (Ctrl-C to stop), or with `-- --drain`
//! to stop once the queue, its retry queues and the runner's in-flight deliveries have been
//! idle for two seconds; `RECORD_STORE=mysql` keeps the record and the tables in MySQL or
//! MariaDB (`MYSQL_URL`) instead of PostgreSQL (`DATABASE_URL`). Either way it prints the
//! run's report and checks the stock table. A URL that asks for TLS (`amqps://`,
//! `rediss://`, `sslmode=require`, `ssl-mode=VERIFY_IDENTITY`) connects over it, trusting
//! the CA in `ONCELY_CA_CERT` and presenting `ONCELY_TLS_CERT`/`ONCELY_TLS_KEY`.
//!
//! The stock-deduction consumer: the `amqp-orders` queue through the Redis flag and the
//! record in transactional mode. The typed handler takes the order (a body that is not one
//! is dead-lettered as `bad_body`) and the record's transaction, deducts stock and writes
//! one `stock_moves` row in it; an order for more than the SKU holds is rejected permanently
//! and dead-lettered. The two stores differ only in their module: the handler's SQL and the
//! transaction type it takes.

mod mysql;
mod postgres;

use std::time::Duration;

use amqp_orders::{QUEUE, amqp, serve_metrics, setting, tls};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::{BoxError, Envelope, HandlerError, KeyExtractor, Outcome, Route};
use oncely_amqp::{Runner, Topology};
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;

/// An order, as the publisher sends it.
#[derive(serde::Deserialize)]
struct Order {
    sku: String,
    quantity: i64,
}

impl Order {
    /// The permanent failure of an order for more than its SKU holds.
    fn not_enough_stock(&self, quantity: i32) -> HandlerError {
        HandlerError::permanent(format!("{}: not enough stock for {quantity}", self.sku))
    }
}

/// The Redis flag in front of the record.
type OrdersFlag = FlagLayer<RedisFlagStore<ConnectionManager>>;

/// Runs the route of `stack` on the queue until Ctrl-C, or until drained with `drain`, and
/// prints the run's report.
async fn run<S>(stack: S, drain: bool) -> Result<(), oncely_amqp::Error>
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    let mut runner = Runner::new(route, Topology::new(QUEUE));
    if drain {
        runner = runner.with_drain(Duration::from_secs(2));
    }
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            let _ = tokio::signal::ctrl_c().await;
            shutdown.cancel();
        }
    });
    let report = runner.run_with_reconnect(amqp, &shutdown).await?;
    println!("{report}");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let drain = std::env::args().any(|arg| arg == "--drain");
    let metrics = serve_metrics()?;
    println!("metrics at http://{metrics}/metrics");
    let redis = oncely::tls::redis::client(setting("REDIS_URL", "redis://127.0.0.1:6379"), &tls())?
        .get_connection_manager()
        .await?;
    let store = setting("RECORD_STORE", "postgres");
    // A prefix per store: the flag answers for the record behind it, and orders done in one
    // store are not done in the other.
    let flag = FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix(format!("amqp-orders:{store}")),
        Duration::from_secs(600),
    )
    .with_record_behind();

    let (moves, orders) = match store.as_str() {
        "postgres" => postgres::consume(flag, drain).await?,
        "mysql" => mysql::consume(flag, drain).await?,
        other => return Err(format!("RECORD_STORE={other}: postgres or mysql").into()),
    };
    println!("stock moves: {moves} for {orders} distinct orders");
    if moves != orders {
        eprintln!("FAIL: an order was applied more than once");
        std::process::exit(1);
    }
    Ok(())
}
