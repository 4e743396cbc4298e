//! RocketMQ adapter for [oncely], on `rocketmq-client-rust` 1.0.
//!
//! A RocketMQ consumer today registers a `MessageListenerConcurrently` (or
//! `MessageListenerOrderly`) on a `DefaultMQPushConsumer` and returns `ConsumeSuccess` or
//! `ReconsumeLater` by hand. With this crate you keep the consumer and register a wrapper
//! that runs a route's stack instead:
//!
//! ```no_run
//! # async fn run(route: oncely::Route<oncely::HandlerFn<fn(oncely::Envelope) -> std::future::Ready<Result<(), oncely::HandlerError>>>>) -> Result<(), oncely_rocketmq::Error> {
//! use oncely_rocketmq::{ConcurrentListener, DeadLetterTopic, OwnedClientRuntime};
//! use rocketmq_client_rust::{DefaultMQProducer, DefaultMQPushConsumer, MQPushConsumer};
//!
//! let runtime = OwnedClientRuntime::new("points")?;
//! let mut producer = DefaultMQProducer::builder(runtime.client_runtime())
//!     .producer_group("points-dead-letters".to_string())
//!     .name_server_addr("127.0.0.1:9876".to_string())
//!     .build();
//! producer.start().await?;
//! let dead_letters = DeadLetterTopic::new(producer, "points_dead_letters");
//!
//! let mut consumer = DefaultMQPushConsumer::builder(runtime.client_runtime())
//!     .consumer_group("points".to_string())
//!     .name_server_addr("127.0.0.1:9876".to_string())
//!     .build();
//! consumer.subscribe("payments", "*").await?;
//! consumer.register_message_listener_concurrently(ConcurrentListener::new(
//!     route,
//!     tokio::runtime::Handle::current(),
//!     dead_letters.clone(),
//! ));
//! consumer.start().await?;
//! // … and at the end, in this order, so that the runtime's shutdown does not wait:
//! consumer.shutdown().await;
//! dead_letters.shutdown().await;
//! runtime.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! The adapter is thin: it converts messages ([`to_delivery`]) and maps each
//! [`oncely::Outcome`] to a listener status — success, the broker's retry, or a copy on a
//! [`DeadLetterTopic`] with the metadata of [`oncely::dead_letter`] as user properties
//! (reason code, detail, attempts, route, source topic, message id — the schema both adapters
//! share, tabled in the README's "Dead letters" section).

mod convert;
mod dead_letter;
mod drain;
mod error;
mod listener;
mod runtime;

pub use convert::to_delivery;
pub use dead_letter::{DeadLetterTopic, kept_properties, send_stored, user_properties};
pub use drain::{GroupLag, Progress, UNKNOWN_LAG_WARN_EVERY};
pub use error::Error;
pub use listener::{ConcurrentListener, OrderlyListener};
pub use runtime::{LISTENER_CONCURRENCY, LISTENER_QUEUE_DEPTH, OwnedClientRuntime};

pub use oncely;
pub use rocketmq_client_rust;
pub use rocketmq_model;
