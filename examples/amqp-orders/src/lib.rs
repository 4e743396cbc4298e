//! Run with: the `consumer` and `publisher` binaries of this crate; see `examples/README.md`.
//!
//! What the two binaries share: connection settings, the queue, and the database schema.

/// The work queue of the example.
pub const QUEUE: &str = "amqp-orders";
/// The PostgreSQL schema (the MySQL/MariaDB database, with `RECORD_STORE=mysql`) holding the
/// example's record table and business tables.
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

/// The TLS settings of `ONCELY_CA_CERT`, `ONCELY_TLS_CERT` and `ONCELY_TLS_KEY`, for the
/// URLs that ask for TLS (`amqps://`, `rediss://`, `sslmode=require`, `ssl-mode=…`).
pub fn tls() -> oncely::tls::TlsSettings {
    oncely::tls::TlsSettings::from_env().unwrap_or_else(|error| panic!("TLS settings: {error}"))
}

/// A connection to RabbitMQ at [`amqp_addr`]; over TLS for `amqps://`, with [`tls`].
pub async fn amqp() -> Result<oncely_amqp::lapin::Connection, oncely_amqp::lapin::Error> {
    let tls = oncely_amqp::tls::config(&tls()).unwrap_or_else(|error| panic!("TLS settings: {error}"));
    let runtime = oncely_amqp::lapin::runtime::default_runtime()?;
    oncely_amqp::lapin::Connection::connect_with_config(&amqp_addr(), Default::default(), tls, runtime).await
}

/// The body of order `n`: one unit of its SKU.
pub fn order_body(n: usize) -> Vec<u8> {
    format!(
        r#"{{"orderId":"order_{n}","sku":"sku_{}","quantity":1}}"#,
        n % SKUS
    )
    .into_bytes()
}
