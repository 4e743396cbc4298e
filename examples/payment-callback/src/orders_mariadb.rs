//! The README's HTTP example on MariaDB (or MySQL 8): the order API under an
//! `Idempotency-Key`, scoped by API key; the order row, the record and the stored response
//! commit together, in one XA transaction.

use axum::http::StatusCode;
use axum::{Extension, Router, routing::post};
use oncely::ConfigError;
use oncely::mysql::{Table, sqlx, sqlx::MySqlPool};
use oncely::record::{MysqlTransaction, MysqlTransactionalLayer};
use oncely_http::{ClientScope, IdempotencyLayer, MysqlResponses};

/// `POST /orders` under an `Idempotency-Key` scoped by the HMAC of the client's API key
/// under `secret`, with the record and the stored responses on `pool` beside `records`.
// README: begin
pub fn orders(pool: MySqlPool, records: Table, secret: &[u8]) -> Result<Router, ConfigError> {
    let record = MysqlTransactionalLayer::new(pool.clone(), records.clone());
    let responses = MysqlResponses::new(pool, &records)?; // MysqlResponses::migrate() at start
    let clients = ClientScope::header("x-api-key").with_secret(secret); // by HMAC of the API key
    let once = IdempotencyLayer::new(record, responses, clients);
    Ok(Router::new().route("/orders", post(create_order)).layer(once))
}
async fn create_order(Extension(tx): Extension<MysqlTransaction>, order: String) -> (StatusCode, String) {
    let insert = sqlx::query("INSERT INTO api_orders (body) VALUES (?)").bind(&order);
    match insert.execute(&tx).await {
        Ok(done) => (StatusCode::CREATED, format!("order {}\n", done.last_insert_id())),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{error}\n")),
    }
}
// README: end
