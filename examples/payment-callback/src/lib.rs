//! Run with: the `server` and `driver` binaries of this crate; see `examples/README.md`.
//!
//! A payment provider's notification endpoint, made exactly-once by oncely-http: each
//! notification is keyed by the provider's transaction id, runs through the Redis flag and
//! the PostgreSQL record in transactional mode, and its handler credits the order in the
//! record's transaction, guarded by the order's state (UNPAID → PAID only).

use std::time::Duration;

use axum::extract::Extension;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use oncely::FingerprintPolicy;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::deadpool_postgres::Pool;
use oncely::postgres::{StatusColumns, Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::tls::TlsSettings;
use oncely_http::{ClientScope, IdempotencyLayer, PgResponses};
use tower::ServiceBuilder;

mod orders;
pub mod orders_mariadb;

use orders::orders;

/// The schema the example keeps its tables in.
const SCHEMA: &str = "payment_callback";

/// A payment notification, as the provider posts it (WeChat Pay's fields, decrypted).
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct Notification {
    /// The provider's transaction id: the key. A provider retry carries the same one.
    pub transaction_id: String,
    /// The shop's order id.
    pub out_trade_no: String,
    /// What was paid.
    pub amount_cents: i64,
    /// `SUCCESS` for a payment.
    pub trade_state: String,
    /// When the provider sent this copy: differs between retries, so it is not fingerprinted.
    pub notified_at_ms: u64,
}

/// The order API's record table: a key space of its own, apart from the notifications'.
fn api_records() -> Result<Table, oncely::ConfigError> {
    Table::new(SCHEMA, "api_record")
}

/// `name` from the environment, or `default`.
pub fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// A pool on `DATABASE_URL` with the example's tables: the record, the orders (`UNPAID` until
/// paid), the credits (one row per credited payment: a second row for an order is a double
/// credit), the refunds due (a second payment of a paid order) and the order API's rows.
pub async fn setup() -> Result<(Pool, Table), Box<dyn std::error::Error>> {
    let url = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let tls = TlsSettings::from_env()?;
    let config = oncely::tls::postgres::config(&url, &tls)?;
    let pool = Pool::builder(oncely::tls::postgres::manager(config, &tls, Default::default())?)
        .max_size(32)
        .build()?;
    let records = Table::new(SCHEMA, "consumption_record")?;
    for table in [&records, &api_records()?] {
        migrate(&pool, table).await?;
        PgResponses::new(pool.clone(), table)?.migrate().await?;
    }
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS payment_callback.orders (
                 id TEXT PRIMARY KEY, amount_cents BIGINT NOT NULL,
                 status TEXT NOT NULL DEFAULT 'UNPAID', version BIGINT NOT NULL DEFAULT 0);
             CREATE TABLE IF NOT EXISTS payment_callback.credits (
                 order_id TEXT NOT NULL, transaction_id TEXT NOT NULL, amount_cents BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS payment_callback.refunds_due (
                 order_id TEXT NOT NULL, transaction_id TEXT NOT NULL, amount_cents BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS payment_callback.api_orders (
                 id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body TEXT NOT NULL);",
        )
        .await?;
    Ok((pool, records))
}

/// The server: `POST /notify` through the Redis flag (`REDIS_URL`) and the transactional
/// record on `pool`, keyed by the body's `transaction_id`; and the order API, `POST /orders`
/// under an `Idempotency-Key` (`orders.rs`, the README's example).
pub async fn app(pool: Pool, records: Table) -> Result<Router, Box<dyn std::error::Error>> {
    let url = setting("REDIS_URL", "redis://127.0.0.1:6379");
    let redis = (oncely::tls::redis::client(url, &TlsSettings::from_env()?)?)
        .get_connection_manager()
        .await?;
    let api = orders(pool.clone(), api_records()?, redis.clone())?;
    let flag = FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix("payment-callback"),
        Duration::from_secs(48 * 3600),
    );
    let tiers = ServiceBuilder::new()
        .layer(flag)
        .layer(PgTransactionalLayer::new(pool.clone(), records.clone()));
    // One caller, the provider: its notifications share one key scope.
    let once = IdempotencyLayer::new(tiers, PgResponses::new(pool, &records)?, ClientScope::shared())
        .with_name("payment_notify")
        .with_key_from_body("/transaction_id")
        .with_fingerprint(FingerprintPolicy::fields([
            "/out_trade_no",
            "/amount_cents",
            "/trade_state",
        ])?)
        // The provider retries for about 25 hours: answer its retries for three days.
        .with_expiry(Duration::from_secs(72 * 3600))
        .with_timeout(Duration::from_secs(5));
    Ok(Router::new()
        .route("/notify", post(notify))
        .layer(once)
        .merge(api))
}

/// What the provider reads: `SUCCESS` stops its retries; anything else, or any status but
/// 2xx, makes it retry on its schedule.
fn answer(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(serde_json::json!({ "code": code, "message": message })),
    )
        .into_response()
}

/// Credits a paid order once, in the record's transaction. The order moves UNPAID → PAID
/// only: a second payment of a paid order (another transaction id) is not credited but
/// noted as a refund due. An order not created yet (its notification outran it, or its row
/// appeared while this ran) answers 503:
/// a 5xx is not stored and commits nothing, so the provider's retry runs the handler again.
async fn notify(Extension(tx): Extension<PgTransaction>, Json(paid): Json<Notification>) -> Response {
    match credit(&tx, &paid).await {
        Ok(answered) => answered,
        Err(error) => answer(StatusCode::INTERNAL_SERVER_ERROR, "FAIL", &error.to_string()),
    }
}

async fn credit(tx: &PgTransaction, paid: &Notification) -> Result<Response, Box<dyn std::error::Error>> {
    if paid.trade_state != "SUCCESS" {
        return Ok(answer(
            StatusCode::OK,
            "SUCCESS",
            "not a payment: nothing to credit",
        ));
    }
    let orders = StatusColumns::new(Table::new(SCHEMA, "orders")?, "id", "status", "version")?;
    let row = (&paid.out_trade_no, &paid.transaction_id, &paid.amount_cents);
    if orders
        .transition(&**tx, &paid.out_trade_no, &["UNPAID"], "PAID")
        .await?
    {
        tx.execute(
            "INSERT INTO payment_callback.credits (order_id, transaction_id, amount_cents) VALUES ($1, $2, $3)",
            &[row.0, row.1, row.2],
        )
        .await?;
        return Ok(answer(StatusCode::OK, "SUCCESS", "credited"));
    }
    // Read after the update, in a snapshot of its own: an order created since the update
    // looked is still UNPAID here, and is retried rather than taken for paid.
    let status = tx
        .query_opt(
            "SELECT status FROM payment_callback.orders WHERE id = $1",
            &[row.0],
        )
        .await?;
    if status.is_none_or(|status| status.get::<_, &str>(0) == "UNPAID") {
        return Ok(answer(
            StatusCode::SERVICE_UNAVAILABLE,
            "FAIL",
            "unknown order: retry later",
        ));
    }
    tx.execute(
        "INSERT INTO payment_callback.refunds_due (order_id, transaction_id, amount_cents) VALUES ($1, $2, $3)",
        &[row.0, row.1, row.2],
    )
    .await?;
    Ok(answer(StatusCode::OK, "SUCCESS", "already paid: refund due"))
}
