//! The consumer's record and tables on PostgreSQL (`DATABASE_URL`), in the schema
//! `amqp_orders`.

use amqp_orders::{SCHEMA, SKUS, setting, tls};
use deadpool_postgres::Pool;
use oncely::postgres::{Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{BusinessKey, HandlerError, Json};

use tower::ServiceBuilder;

use crate::{Order, OrdersFlag};

/// A pool on `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`; TLS with
/// `sslmode=require`) whose connections search the example's schema first.
fn pool() -> Pool {
    let url = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let separator = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{separator}options=-csearch_path%3D{SCHEMA}");
    let tls = tls();
    let config = oncely::tls::postgres::config(&url, &tls).expect("a valid DATABASE_URL");
    let manager = oncely::tls::postgres::manager(config, &tls, Default::default()).expect("the TLS settings");
    Pool::builder(manager).max_size(16).build().expect("a pool")
}

/// Deducts the order's stock and writes its stock move, in the record's transaction.
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
        return Err(order.not_enough_stock(quantity));
    }
    tx.execute(
        "INSERT INTO stock_moves (order_id, sku, quantity) VALUES ($1, $2, $3)",
        &[&order_id.as_str(), &order.sku, &quantity],
    )
    .await?;
    Ok(())
}

/// Creates the schema's tables if needed, consumes through `flag` and the record until
/// stopped, and answers the stock moves written and the distinct orders among them.
pub(crate) async fn consume(flag: OrdersFlag, drain: bool) -> Result<(i64, i64), Box<dyn std::error::Error>> {
    let pool = pool();
    let records = Table::new(SCHEMA, "consumption_record")?;
    migrate(&pool, &records).await?;
    pool.get()
        .await?
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, quantity INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS stock_moves (order_id TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL);
             INSERT INTO stock SELECT 'sku_' || n, 1000000 FROM generate_series(0, {}) n ON CONFLICT DO NOTHING;",
            SKUS - 1
        ))
        .await?;
    let stack = ServiceBuilder::new()
        .layer(flag)
        .service(PgTransactionalLayer::new(pool.clone(), records).handler(deduct_stock));
    crate::run(stack, drain).await?;
    let row = (pool.get().await?)
        .query_one("SELECT count(*), count(DISTINCT order_id) FROM stock_moves", &[])
        .await?;
    Ok((row.get(0), row.get(1)))
}
