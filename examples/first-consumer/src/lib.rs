//! Run with: the `first-consumer` and `send-red-packets` binaries of this crate; see
//! `examples/README.md`.
//!
//! What the sender needs: the queue's name and a connection. The consumer (`main.rs`) is
//! whole on its own, as the README shows it.

use oncely_amqp::lapin::{Connection, ConnectionProperties, runtime};

/// The work queue.
pub const QUEUE: &str = "red-packets";

/// A connection to RabbitMQ at `AMQP_ADDR` (default: the loopback broker); over TLS for
/// `amqps://`, with the CA and client certificate of `ONCELY_CA_CERT`, `ONCELY_TLS_CERT` and
/// `ONCELY_TLS_KEY`.
/// Panics with the reason when those settings cannot be read.
pub async fn amqp() -> Result<Connection, oncely_amqp::lapin::Error> {
    let address =
        std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let settings =
        oncely::tls::TlsSettings::from_env().unwrap_or_else(|error| panic!("TLS settings: {error}"));
    let tls = oncely_amqp::tls::config(&settings).unwrap_or_else(|error| panic!("TLS settings: {error}"));
    let properties = ConnectionProperties::default();
    Connection::connect_with_config(&address, properties, tls, runtime::default_runtime()?).await
}
