//! Run with: the `first-consumer` and `send-red-packets` binaries of this crate; see
//! `examples/README.md`.
//!
//! What the sender needs: the queue's name and a connection. The consumer (`main.rs`) is
//! whole on its own, as the README shows it.

use oncely_amqp::lapin::{Connection, ConnectionProperties};

/// The work queue.
pub const QUEUE: &str = "red-packets";

/// A connection to RabbitMQ at `AMQP_ADDR` (default: the loopback broker).
pub async fn amqp() -> Result<Connection, oncely_amqp::lapin::Error> {
    let address =
        std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    Connection::connect(&address, ConnectionProperties::default()).await
}
