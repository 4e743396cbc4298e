//! The README's HTTP example: an order API under an `Idempotency-Key`, scoped by API key;
//! the order row, the record and the stored response commit together.

use std::time::Duration;

use axum::http::StatusCode;
use axum::{Extension, Router, routing::post};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::{Table, deadpool_postgres::Pool};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{ConfigError, redis::aio::ConnectionManager};
use oncely_http::{ClientScope, IdempotencyLayer, PgResponses};
use tower::ServiceBuilder;

// README: begin
pub(crate) fn orders(pool: Pool, records: Table, redis: ConnectionManager) -> Result<Router, ConfigError> {
    let flag = FlagLayer::new(RedisFlagStore::new(redis), Duration::from_secs(24 * 3600));
    let record = PgTransactionalLayer::new(pool.clone(), records.clone());
    let tiers = ServiceBuilder::new().layer(flag).layer(record);
    let clients = ClientScope::header("x-api-key"); // each client its own keys
    let once = IdempotencyLayer::new(tiers, PgResponses::new(pool, &records)?, clients);
    Ok(Router::new().route("/orders", post(create_order)).layer(once))
}
async fn create_order(Extension(tx): Extension<PgTransaction>, order: String) -> (StatusCode, String) {
    let insert = "INSERT INTO payment_callback.api_orders (body) VALUES ($1) RETURNING id";
    match tx.query_one(insert, &[&order]).await {
        Ok(row) => (StatusCode::CREATED, format!("order {}\n", row.get::<_, i64>(0))),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")),
    }
}
// README: end
