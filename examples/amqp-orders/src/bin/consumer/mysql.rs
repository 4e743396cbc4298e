//! The consumer's record and tables on MySQL or MariaDB (`MYSQL_URL`), in the database
//! `amqp_orders` (created if missing).

use amqp_orders::{SCHEMA, SKUS, setting, tls};
use oncely::mysql::sqlx::mysql::MySqlPoolOptions;
use oncely::mysql::sqlx::{self, MySqlPool};
use oncely::mysql::{Table, migrate};
use oncely::record::{MysqlTransaction, MysqlTransactionalLayer};
use oncely::{BusinessKey, HandlerError, Json};
use tower::ServiceBuilder;

use crate::{Order, OrdersFlag};

/// Deducts the order's stock and writes its stock move, in the record's transaction.
async fn deduct_stock(
    tx: MysqlTransaction,
    order_id: BusinessKey,
    Json(order): Json<Order>,
) -> Result<(), HandlerError> {
    // A quantity beyond i32 is a permanent failure by its error's type.
    let quantity = i32::try_from(order.quantity)?;
    // Rows matched, not changed: sqlx asks MySQL for found rows.
    let deducted = sqlx::query("UPDATE stock SET quantity = quantity - ? WHERE sku = ? AND quantity >= ?")
        .bind(quantity)
        .bind(&order.sku)
        .bind(quantity)
        .execute(&tx)
        .await?
        .rows_affected();
    if deducted == 0 {
        return Err(order.not_enough_stock(quantity));
    }
    sqlx::query("INSERT INTO stock_moves (order_id, sku, quantity) VALUES (?, ?, ?)")
        .bind(order_id.as_str())
        .bind(&order.sku)
        .bind(quantity)
        .execute(&tx)
        .await?;
    Ok(())
}

/// A pool of 16 on the example's database, created first if missing.
async fn pool() -> Result<MySqlPool, sqlx::Error> {
    let server =
        oncely::tls::mysql::options(&setting("MYSQL_URL", "mysql://root@127.0.0.1:3306/test"), &tls())?;
    let admin = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(server.clone())
        .await?;
    sqlx::raw_sql(&format!("CREATE DATABASE IF NOT EXISTS `{SCHEMA}`"))
        .execute(&admin)
        .await?;
    admin.close().await;
    MySqlPoolOptions::new()
        .max_connections(16)
        .connect_with(server.database(SCHEMA))
        .await
}

/// Creates the database's tables if needed, consumes through `flag` and the record until
/// stopped, and answers the stock moves written and the distinct orders among them.
pub(crate) async fn consume(flag: OrdersFlag, drain: bool) -> Result<(i64, i64), Box<dyn std::error::Error>> {
    let pool = pool().await?;
    let records = Table::new("consumption_record")?;
    migrate(&pool, &records).await?;
    let stock: Vec<String> = (0..SKUS).map(|n| format!("('sku_{n}', 1000000)")).collect();
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS stock (sku VARCHAR(64) PRIMARY KEY, quantity INT NOT NULL) ENGINE = InnoDB;
         CREATE TABLE IF NOT EXISTS stock_moves (
             id BIGINT AUTO_INCREMENT PRIMARY KEY, order_id VARCHAR(64) NOT NULL,
             sku VARCHAR(64) NOT NULL, quantity INT NOT NULL
         ) ENGINE = InnoDB;
         INSERT IGNORE INTO stock VALUES {};",
        stock.join(", ")
    ))
    .execute(&pool)
    .await?;
    let stack = ServiceBuilder::new()
        .layer(flag)
        .service(MysqlTransactionalLayer::new(pool.clone(), records).handler(deduct_stock));
    crate::run(stack, drain).await?;
    let counts = sqlx::query_as("SELECT count(*), count(DISTINCT order_id) FROM stock_moves")
        .fetch_one(&pool)
        .await?;
    Ok(counts)
}
