//! # oncely
//!
//! Effectively exactly-once consumption for RabbitMQ and RocketMQ consumers whose handlers
//! move money or stock.
//!
//! Brokers deliver at least once: producer retries, lost acks, consumer crashes and
//! rebalances all bring a message back. oncely wraps the handler in a stack of
//! [tower](https://docs.rs/tower) layers, each catching duplicates at a different cost and
//! durability, and answers every delivery with one [`Outcome`] that the adapter maps to the
//! broker:
//!
//! ```text
//! delivery ─▶ Route (business key) ─▶ flag ─▶ lock ─▶ state guard ─▶ record ─▶ handler
//!                  │                                                              │
//!                  └──────────────────────── Outcome ◀────────────────────────────┘
//! ```
//!
//! | outcome | broker action |
//! |---|---|
//! | [`Outcome::Processed`] | ack |
//! | [`Outcome::Duplicate`] | ack |
//! | [`Outcome::Stale`] | ack |
//! | [`Outcome::RetryLater`] | retry later, never ack |
//! | [`Outcome::DeadLetter`] | dead-letter with the reason |
//!
//! The tiers, composable in any subset per route, in the order of the picture above (the
//! README explains why); behind the transactional record only services that write nothing
//! outside its transaction may stand ([`record::TransactionSafe`]), so a flag or state
//! guard there does not compile:
//! - [`state_guard`]: applies an entity's events only along declared transitions.
//! - [`flag`]: a fast expiring "in flight / done" marker per key.
//! - [`lock`]: mutual exclusion per entity, with a watchdog and a fencing token.
//! - [`record`]: the durable consumption record, the final word on "was this processed".
//! - `prefilter` (feature `prefilter`): a local Bloom filter or bitmap of settled keys that
//!   lets a certainly new key skip the flag's claim.
//!
//! Every tier counts, per route, what reached it, what it caught and what it passed on
//! ([`telemetry`]).
//!
//! Each tier's docs say what it guarantees alone and what it relies on from the tiers
//! behind it. Backends, each behind a cargo feature (`full` turns all on):
//! - `memory` (default): in-memory stores for every tier, for tests and the quickstart.
//! - `redis`: [`flag::RedisFlagStore`] and [`lock::RedisLockStore`] on Redis 7.0 or later.
//! - `postgres`: the record tier on PostgreSQL in transactional mode
//!   ([`record::PgTransactionalLayer`]) or three-step mode ([`record::PgRecordStore`], with
//!   claim coalescing and a [`record::Reconciler`]), the state guard's
//!   [`state_guard::PgStateStore`], and [`postgres`] helpers for idempotent state changes.
//! - `prefilter`: the pre-filter tier's Bloom filter (`fastbloom`) and roaring bitmap.
//!
//! ```
//! use std::time::Duration;
//! use oncely::{handler_fn, Broker, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, Route, Source, Tier};
//! use oncely::flag::{FlagLayer, MemoryFlagStore};
//! use oncely::record::{MemoryRecordStore, RecordLayer};
//! use tower::ServiceBuilder;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let stack = ServiceBuilder::new()
//!     .layer(FlagLayer::new(MemoryFlagStore::new(), Duration::from_secs(600)))
//!     .layer(RecordLayer::new(MemoryRecordStore::new()))
//!     .service(handler_fn(|envelope: Envelope| async move {
//!         println!("deduct stock for {}", envelope.key());
//!         Ok::<(), HandlerError>(())
//!     }));
//! let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
//!
//! let delivery = || Delivery::new(Source::new(Broker::InProcess, "orders"), r#"{"orderId":"o-1"}"#);
//! assert_eq!(route.handle(delivery()).await, Outcome::Processed);
//! assert_eq!(route.handle(delivery()).await, Outcome::Duplicate { tier: Tier::Flag });
//! # }
//! ```

pub mod dead_letter;
pub mod deliveries;
mod envelope;
mod error;
pub mod flag;
mod handler;
mod key;
pub mod lock;
#[cfg(feature = "memory")]
mod memory;
mod outcome;
mod policy;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "prefilter")]
pub mod prefilter;
pub mod record;
#[cfg(feature = "redis")]
mod redis_backend;
mod route;
mod service;
pub mod state_guard;
pub mod telemetry;
mod token;

pub use dead_letter::{DeadLetter, DeadLetterReason};
pub use envelope::{
    Broker, BusinessKey, Delivery, Envelope, Extensions, Fingerprint, Headers, Position, Source,
};
pub use error::{BoxError, Error};
pub use handler::{HandlerError, HandlerFn, handler_fn};
pub use key::{DEFAULT_MAX_KEY_LEN, KeyExtractor, KeyField};
pub use outcome::{BrokerAction, Outcome, RetryLater, RetryReason, Tier};
pub use policy::FailurePolicy;
#[cfg(feature = "redis")]
pub use redis_backend::{DEFAULT_REDIS_PREFIX, RedisConnection};
pub use route::{DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BODY_LEN, Route};
pub use service::BoxFuture;
pub use token::Token;
