//! Run with: the `credit-points` and `send-payments` binaries of this crate; see `examples/README.md`.
//!
//! What the two binaries share: connection settings, topics, the database schema, and the
//! client runtime and producer they both start.

use deadpool_postgres::Pool;
use oncely_rocketmq::OwnedClientRuntime;
use oncely_rocketmq::rocketmq_client_rust::DefaultMQProducer;

/// The topic payment-success messages arrive on.
pub const TOPIC: &str = "rocketmq_points_payments";
/// The topic dead letters go to, with the reason in their properties.
pub const DEAD_LETTER_TOPIC: &str = "rocketmq_points_dead_letters";
/// The consumer group crediting points.
pub const GROUP: &str = "rocketmq_points";
/// The PostgreSQL schema holding the example's record table and business tables.
pub const SCHEMA: &str = "rocketmq_points";

/// `name` from the environment, or `default`.
pub fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Serves the tiers' metrics for Prometheus at `http://METRICS_ADDR/metrics` (default
/// `127.0.0.1:9465`).
pub fn serve_metrics() -> Result<std::net::SocketAddr, Box<dyn std::error::Error>> {
    let address: std::net::SocketAddr = setting("METRICS_ADDR", "127.0.0.1:9465").parse()?;
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(address)
        .install()?;
    Ok(address)
}

/// `ROCKETMQ_NAMESRV`, default `127.0.0.1:9876`.
pub fn namesrv_addr() -> String {
    setting("ROCKETMQ_NAMESRV", "127.0.0.1:9876")
}

/// A pool on `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) whose
/// connections search the example's schema first.
pub fn pool() -> Pool {
    let url = setting("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let separator = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{separator}options=-csearch_path%3D{SCHEMA}");
    let tls = oncely::tls::TlsSettings::from_env().expect("the TLS settings");
    let config = oncely::tls::postgres::config(&url, &tls).expect("a valid DATABASE_URL");
    let manager = oncely::tls::postgres::manager(config, &tls, Default::default()).expect("the TLS settings");
    Pool::builder(manager).max_size(8).build().expect("a pool")
}

/// The body of the payment of order `n`: its user and amount.
pub fn payment_body(n: usize) -> Vec<u8> {
    format!(
        r#"{{"orderId":"order_{n}","userId":"user_{}","amount":{}}}"#,
        n % 50,
        10 + n % 90
    )
    .into_bytes()
}

/// Starts a client runtime and a producer in `group`.
pub async fn start_producer(
    group: &str,
) -> Result<(OwnedClientRuntime, DefaultMQProducer), oncely_rocketmq::Error> {
    let runtime = OwnedClientRuntime::new(group)?;
    let mut producer = DefaultMQProducer::builder(runtime.client_runtime())
        .producer_group(group.to_owned())
        .name_server_addr(namesrv_addr())
        .build();
    producer.start().await?;
    Ok((runtime, producer))
}
