//! Run with: `cargo run -p amqp-orders --bin consumer` (Ctrl-C to stop), or with `-- --drain`
//! to stop once the queue has stayed empty for two seconds and print a summary.
//!
//! The stock-deduction consumer: the `amqp-orders` queue through the Redis flag and the
//! PostgreSQL record in transactional mode. The handler deducts stock and writes one
//! `stock_moves` row in the record's transaction; an order for more than the SKU holds is
//! rejected permanently and dead-lettered.

use std::time::Duration;

use amqp_orders::{QUEUE, SCHEMA, SKUS, amqp_addr, pool, serve_metrics, setting};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::{Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{Envelope, HandlerError, KeyExtractor, Route, handler_fn};
use oncely_amqp::lapin::Connection;
use oncely_amqp::{Runner, Topology};
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;

async fn deduct_stock(envelope: Envelope) -> Result<(), HandlerError> {
    let order: serde_json::Value =
        serde_json::from_slice(envelope.delivery().body()).map_err(HandlerError::permanent)?;
    let (Some(sku), Some(quantity)) = (order["sku"].as_str(), order["quantity"].as_i64()) else {
        return Err(HandlerError::permanent("an order needs a sku and a quantity"));
    };
    let tx = envelope
        .extensions()
        .get::<PgTransaction>()
        .expect("the transactional record tier");
    let quantity = i32::try_from(quantity).map_err(HandlerError::permanent)?;
    let deducted = tx
        .client()
        .execute(
            "UPDATE stock SET quantity = quantity - $2 WHERE sku = $1 AND quantity >= $2",
            &[&sku, &quantity],
        )
        .await?;
    if deducted == 0 {
        return Err(HandlerError::permanent(format!(
            "{sku}: not enough stock for {quantity}"
        )));
    }
    tx.client()
        .execute(
            "INSERT INTO stock_moves (order_id, sku, quantity) VALUES ($1, $2, $3)",
            &[&envelope.key().as_str(), &sku, &quantity],
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

    let stack = ServiceBuilder::new()
        .layer(FlagLayer::new(
            RedisFlagStore::new(redis).with_prefix("amqp-orders"),
            Duration::from_secs(600),
        ))
        .layer(PgTransactionalLayer::new(pool.clone(), records))
        .service(handler_fn(deduct_stock));
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    let topology = Topology::new(QUEUE);
    let runner = Runner::new(route, topology.clone()).with_prefetch(64);

    let shutdown = CancellationToken::new();
    let watcher = tokio::spawn(stop_when(drain, topology.clone(), shutdown.clone()));
    let address = amqp_addr();
    runner
        .run_with_reconnect(|| Connection::connect(&address, Default::default()), &shutdown)
        .await?;
    watcher.abort();

    let client = pool.get().await?;
    let moves: i64 = client
        .query_one("SELECT count(*) FROM stock_moves", &[])
        .await?
        .get(0);
    let orders: i64 = client
        .query_one("SELECT count(DISTINCT order_id) FROM stock_moves", &[])
        .await?
        .get(0);
    let channel = Connection::connect(&amqp_addr(), Default::default())
        .await?
        .create_channel()
        .await?;
    let dead = channel
        .queue_declare(
            topology.dead_letter_queue().into(),
            oncely_amqp::lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await?
        .message_count();
    println!(
        "stock moves: {moves} for {orders} distinct orders; dead-lettered (in {}): {dead}",
        topology.dead_letter_queue()
    );
    if moves != orders {
        eprintln!("FAIL: an order was applied more than once");
        std::process::exit(1);
    }
    Ok(())
}

/// Cancels `shutdown` on Ctrl-C, or with `drain` once the queue has stayed empty for 2 s.
async fn stop_when(drain: bool, topology: Topology, shutdown: CancellationToken) {
    if !drain {
        let _ = tokio::signal::ctrl_c().await;
        shutdown.cancel();
        return;
    }
    let Ok(connection) = Connection::connect(&amqp_addr(), Default::default()).await else {
        return;
    };
    let Ok(channel) = connection.create_channel().await else {
        return;
    };
    let mut idle = 0;
    while idle < 4 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let passive = oncely_amqp::lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let ready = channel
            .queue_declare(topology.queue().into(), passive, Default::default())
            .await
            .map(|queue| queue.message_count())
            .unwrap_or(1);
        idle = if ready == 0 { idle + 1 } else { 0 };
    }
    shutdown.cancel();
}
