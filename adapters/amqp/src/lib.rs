//! RabbitMQ adapter for [oncely], on [lapin].
//!
//! A RabbitMQ consumer today is a `basic_consume` loop that acks by hand. With this crate
//! you keep your connection and queue, put your handler at the bottom of a route's stack,
//! and hand both to a [`Runner`]:
//!
//! ```no_run
//! # async fn run(route: oncely::Route<oncely::HandlerFn<fn(oncely::Envelope) -> std::future::Ready<Result<(), oncely::HandlerError>>>>) -> Result<(), oncely_amqp::Error> {
//! use oncely_amqp::{Runner, Topology};
//! use tokio_util::sync::CancellationToken;
//!
//! let connection = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
//! let channel = connection.create_channel().await?;
//! let topology = Topology::new("orders");
//! topology.declare(&channel).await?;
//! let report = Runner::new(route, topology).run(&channel, &CancellationToken::new()).await?;
//! println!("{report}");
//! # Ok(()) }
//! ```
//!
//! The adapter is thin: it converts deliveries ([`to_delivery`]) and maps each
//! [`oncely::Outcome`] to the broker — ack, a delayed retry through a TTL queue, or the
//! dead-letter queue with the metadata of [`oncely::dead_letter`] as headers (reason code,
//! detail, attempts, route, source queue, message id — the schema both adapters share,
//! tabled in the README's "Dead letters" section), plus the AMQP-only
//! [`ORIGINAL_EXCHANGE_HEADER`] and [`ORIGINAL_ROUTING_KEY_HEADER`]. The [`Producer`]
//! publishes with confirms and retries under the same message id.

mod acks;
mod convert;
mod error;
mod producer;
mod runner;
#[cfg(feature = "tls")]
pub mod tls;
mod topology;

pub use convert::{ATTEMPT_HEADER, SEAL_HEADER, headers_of, to_delivery};
pub use error::Error;
pub use producer::{DEFAULT_KEY_HEADER, Producer};
pub use runner::{
    DEFAULT_CONCURRENCY, DEFAULT_MAX_CONNECT_FAILURES, DEFAULT_MAX_DELIVERIES, DEFAULT_PREFETCH,
    ORIGINAL_EXCHANGE_HEADER, ORIGINAL_ROUTING_KEY_HEADER, RETURNS_HEADER, Runner, SETTLE_RETRY_DELAY,
    SuspectGate, is_broker_death,
};
pub use topology::{DEAD_LETTER_DELIVERY_LIMIT, SafetyNetPolicy, Topology};

pub use lapin;
pub use oncely;
