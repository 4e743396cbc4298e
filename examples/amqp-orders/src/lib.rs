//! Run with: the `consumer` and `publisher` binaries of this crate; see `examples/README.md`.
//!
//! What the two binaries share: connection settings, the queue, and the database schema.

use deadpool_postgres::tokio_postgres::{Config, NoTls};
use deadpool_postgres::{Manager, Pool};

/// The work queue of the example.
pub const QUEUE: &str = "amqp-orders";
/// The PostgreSQL schema holding the example's record table and business tables.
pub const SCHEMA: &str = "amqp_orders";
/// How many SKUs the stock table holds; order `n` deducts from SKU `n % SKUS`.
pub const SKUS: usize = 20;

/// `name` from the environment, or `default`.
pub fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Serves the tiers' metrics for Prometheus at `http://METRICS_ADDR/metrics` (default
/// `127.0.0.1:9464`).
pub fn serve_metrics() -> Result<std::net::SocketAddr, Box<dyn std::error::Error>> {
    let address: std::net::SocketAddr = setting("METRICS_ADDR", "127.0.0.1:9464").parse()?;
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(address)
        .install()?;
    Ok(address)
}

/// `AMQP_ADDR`, default `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_addr() -> String {
    setting("AMQP_ADDR", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// A pool on `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) whose
/// connections search the example's schema first.
pub fn pool() -> Pool {
    let url = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let separator = if url.contains('?') { '&' } else { '?' };
    let config: Config = format!("{url}{separator}options=-csearch_path%3D{SCHEMA}")
        .parse()
        .expect("a valid DATABASE_URL");
    Pool::builder(Manager::new(config, NoTls))
        .max_size(16)
        .build()
        .expect("a pool")
}

/// The body of order `n`: one unit of its SKU.
pub fn order_body(n: usize) -> Vec<u8> {
    format!(
        r#"{{"orderId":"order_{n}","sku":"sku_{}","quantity":1}}"#,
        n % SKUS
    )
    .into_bytes()
}
