//! Run with: `cargo run -p amqp-orders --bin consumer` (Ctrl-C to stop), or with `-- --drain`
//! to stop once the queue, its retry queues and the runner's in-flight deliveries have been
//! idle for two seconds. Either way it prints the run's report and checks the stock table.
//!
//! The stock-deduction consumer: the `amqp-orders` queue through the Redis flag and the
//! PostgreSQL record in transactional mode. The typed handler takes the order (a body that is
//! not one is dead-lettered as `bad_body`) and the record's transaction, deducts stock and
//! writes one `stock_moves` row in it; an order for more than the SKU holds is rejected
//! permanently and dead-lettered.

use std::time::Duration;

use amqp_orders::{QUEUE, SCHEMA, SKUS, amqp_addr, pool, serve_metrics, setting};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::{Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{BusinessKey, HandlerError, Json, KeyExtractor, Route};
use oncely_amqp::lapin::Connection;
use oncely_amqp::{Runner, Topology};
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;

#[derive(serde::Deserialize)]
struct Order {
    sku: String,
    quantity: i64,
}

async fn deduct_stock(
    tx: PgTransaction,
    order_id: BusinessKey,
    Json(order): Json<Order>,
) -> Result<(), HandlerError> {
    // A quantity beyond i32 is a permanent failure by its error's type.
    let quantity = i32::try_from(order.quantity)?;
    let deducted = tx
        .execute(
            "UPDATE stock SET quantity = quantity - $2 WHERE sku = $1 AND quantity >= $2",
            &[&order.sku, &quantity],
        )
        .await?;
    if deducted == 0 {
        return Err(HandlerError::permanent(format!(
            "{}: not enough stock for {quantity}",
            order.sku
        )));
    }
    tx.execute(
        "INSERT INTO stock_moves (order_id, sku, quantity) VALUES ($1, $2, $3)",
        &[&order_id.as_str(), &order.sku, &quantity],
    )
    .await?;
    Ok(())
}

async fn prepare_database(pool: &deadpool_postgres::Pool, records: &Table) -> Result<(), oncely::StoreError> {
    migrate(pool, records).await?;
    let client = pool.get().await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, quantity INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS stock_moves (order_id TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL);
             INSERT INTO stock SELECT 'sku_' || n, 1000000 FROM generate_series(0, {}) n ON CONFLICT DO NOTHING;",
            SKUS - 1
        ))
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let drain = std::env::args().any(|arg| arg == "--drain");
    let metrics = serve_metrics()?;
    println!("metrics at http://{metrics}/metrics");
    let pool = pool();
    let records = Table::new(SCHEMA, "consumption_record")?;
    prepare_database(&pool, &records).await?;
    let redis = redis::Client::open(setting("REDIS_URL", "redis://127.0.0.1:6379"))?
        .get_connection_manager()
        .await?;

    let flag = FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix("amqp-orders"),
        Duration::from_secs(600),
    )
    .with_record_behind();
    let stack = ServiceBuilder::new()
        .layer(flag)
        .service(PgTransactionalLayer::new(pool.clone(), records).handler(deduct_stock));
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    let mut runner = Runner::new(route, Topology::new(QUEUE)).with_prefetch(64);
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
    let address = amqp_addr();
    let report = runner
        .run_with_reconnect(|| Connection::connect(&address, Default::default()), &shutdown)
        .await?;
    println!("{report}");

    let client = pool.get().await?;
    let row = client
        .query_one("SELECT count(*), count(DISTINCT order_id) FROM stock_moves", &[])
        .await?;
    let (moves, orders): (i64, i64) = (row.get(0), row.get(1));
    println!("stock moves: {moves} for {orders} distinct orders");
    if moves != orders {
        eprintln!("FAIL: an order was applied more than once");
        std::process::exit(1);
    }
    Ok(())
}
