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
//! broker message ─▶ adapter ─▶ Route ─▶ state guard ─▶ pre-filter ─▶ flag ─▶ lock ─▶ record ─▶ handler
//!  (AMQP, RocketMQ)  Delivery   key, fingerprint,                                          │
//!        ▲                      body limit, panics                                         │
//!        └── ack / retry / dead letter ◀── adapter ◀── Outcome ◀───────────────────────────┘
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
//! guard there does not compile. Each is a store plus a decision run by one
//! [`tier::TierService`]; each tier's docs say what it guarantees alone and what it relies
//! on from the tiers behind it.
//!
//! # Layout
//! - [`Route`]: one kind of message — reads its business key ([`KeyExtractor`]) and
//!   fingerprint ([`FingerprintPolicy`]), runs the stack, catches panics, limits attempts.
//! - [`Delivery`], [`Envelope`]: a message as an adapter hands it over, and as the tiers see it.
//! - [`handler`](mod@handler): the user's handler, typed ([`handler()`], [`Json`]) or untyped
//!   ([`handler_fn`]), and how its errors are classified ([`Classify`]).
//! - [`Outcome`], [`DeadLetter`], [`BrokerAction`]: the stack's answer and the broker's action.
//! - [`state_guard`]: applies an entity's events only along declared transitions.
//! - `prefilter` (feature `prefilter`): a local Bloom filter or bitmap of settled keys that
//!   lets a certainly new key skip the flag's read.
//! - [`flag`]: a fast expiring "in flight / done" marker per key.
//! - [`lock`]: mutual exclusion per entity, with a watchdog and a fencing token.
//! - [`record`]: the durable consumption record, the final word on "was this processed".
//! - [`report`]: what a run did ([`report::RunReport`]), and drain mode's wait.
//! - [`deliveries`]: counts unsettled deliveries per key, for brokers that do not.
//! - [`tier`]: what every tier shares; write your own tier here.
//! - [`telemetry`]: the metrics every tier records (feature `metrics`, default).
//! - `postgres` (feature `postgres`): the tables oncely creates and a helper for idempotent
//!   state changes.
//! - `mysql` (feature `mysql`): the same tables on MySQL and MariaDB, and the sqlx it uses.
//! - `testing` (feature `testing`): the store suites a backend of your own must pass.
//! - [`InputError`], [`ConfigError`], [`StoreError`]: errors, by who must act.
//!
//! Backends, each behind a cargo feature (`full` turns all on):
//! - `memory` (default): in-memory stores for every tier, for tests and the quickstart.
//! - `redis`: `flag::RedisFlagStore`, `lock::RedisLockStore` and
//!   `deliveries::RedisDeliveryCounter` on Redis 7.0 or later.
//! - `postgres`: the record tier on PostgreSQL in transactional mode
//!   (`record::PgTransactionalLayer`, per delivery or batched) or three-step mode
//!   (`record::PgRecordStore`, with claim coalescing), the state guard's
//!   `state_guard::PgStateStore` and the lock's `lock::PgLockStore`.
//! - `mysql`: on MySQL 8 or MariaDB (sqlx), the record tier in transactional mode
//!   (`record::MysqlTransactionalLayer`, per delivery or batched) or three-step mode
//!   (`record::MysqlRecordStore`), the state guard's `state_guard::MysqlStateStore` and the
//!   lock's `lock::MysqlLockStore`. On either SQL store, `record::Reconciler` repairs
//!   three-step records stuck in `PROCESSING`.
//! - `prefilter`: the pre-filter tier's Bloom filter (`fastbloom`) and roaring bitmap.
//!
//! and two that are not backends: `metrics` (default), the tiers' metrics through the
//! `metrics` facade ([`telemetry`]), and `testing`, the store suites.
//!
//! ```
//! use std::time::Duration;
//! use oncely::{handler_fn, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, Route, Source, Tier};
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
//! let delivery = || Delivery::new(Source::new("orders"), r#"{"orderId":"o-1"}"#);
//! assert_eq!(route.handle(delivery()).await, Outcome::Processed);
//! assert_eq!(route.handle(delivery()).await, Outcome::Duplicate { tier: Tier::Flag });
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

/// Builder methods that each set one field to their argument, named as the field is:
/// `setters! { /// docs \n with_lease(lease: Duration); }`.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($field:ident: $type:ty);)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $field: $type) -> Self {
                self.$field = $field;
                self
            }
        )*
    };
}

pub mod dead_letter;
pub mod deliveries;
mod envelope;
mod error;
mod fingerprint;
pub mod flag;
#[cfg(feature = "redis")]
pub mod flag_lock;
pub mod handler;
mod key;
pub mod lock;
#[cfg(feature = "mysql")]
pub mod mysql;
mod outcome;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "prefilter")]
pub mod prefilter;
pub mod record;
pub mod report;
mod route;
pub mod state_guard;
mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tier;
#[cfg(feature = "tls")]
pub mod tls;
mod token;

pub use dead_letter::{DeadLetter, DeadLetterReason};
pub use envelope::{BusinessKey, Delivery, Envelope, Extensions, Headers, Position, Source};
pub use error::{BoxError, ConfigError, Error, InputError, StoreError};
pub use fingerprint::{Fingerprint, FingerprintPolicy};
pub use handler::{Classify, ErrorClass, HandlerError, HandlerFn, Json, ResultExt, handler, handler_fn};
pub use key::{DEFAULT_MAX_KEY_LEN, KeyExtractor, KeyField};
pub use outcome::{BrokerAction, Outcome, RetryLater, RetryReason};
/// The `redis` crate the Redis backends are built on, for making their connections.
#[cfg(feature = "redis")]
pub use redis;
pub use route::{DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BODY_LEN, Route};
#[cfg(feature = "redis")]
pub use store::redis::{DEFAULT_REDIS_PREFIX, RedisConnection};
pub use tier::{BoxFuture, FailurePolicy, Tier};
pub use token::Token;
