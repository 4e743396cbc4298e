//! The lock tier: mutual exclusion per entity, with a lease, a watchdog and a fencing token.
//!
//! The entity is read from the envelope by its own [`KeyExtractor`](crate::KeyExtractor) —
//! typically the order or account id, distinct from the message's business key, so that two
//! *different* messages about one entity (deduct stock, then refund) do not run at once.
//!
//! | the entity's lock | outcome |
//! |---|---|
//! | free | acquired: the tiers behind run while a watchdog renews the lease |
//! | held by another | [`RetryLater`](crate::Outcome::RetryLater) (`LockBusy`), never an ack |
//! | lost while the handler ran | [`RetryLater`](crate::Outcome::RetryLater) (`LeaseLost`), whatever the handler answered |
//!
//! Each acquisition gets a fencing token, larger than every token handed out before for that
//! entity. The tiers behind and the handler read it, with a cancellation signal that fires if
//! the lease is lost, from the envelope's extensions as a [`LockLease`].
//!
//! # What it guarantees alone, and what it relies on
//! While the lease is renewed, no two holders run for one entity. A lease can still be lost
//! (a store restart, a network partition longer than the lease, a store that stops
//! answering until the lease could have run out): then the handler is told at once, and
//! the outcome is never an ack, so a tier in front cannot record the work as done.
//! The lock does not remember anything after release: duplicates that arrive one after the
//! other are for the flag and record tiers. Handlers writing to a store that can compare the
//! fencing token reject a stale holder's late writes even after a lost lease.
//!
//! The watchdog runs in the task that runs the delivery (its own; on RocketMQ's listener,
//! its batch's), beside the tiers behind and polled before them at each turn (a task of its
//! own would cost a spawn, a wake-up and an abort per delivery): a handler that blocks its
//! thread without awaiting — CPU-bound or blocking work belongs in
//! `tokio::task::spawn_blocking` — stalls its renewals with it, and past the lease the lock
//! is lost. If the future running a delivery is dropped, the watchdog stops with it and the
//! lock is left to expire with its lease.

mod decision;
mod layer;
mod lease;
mod store;

#[cfg(feature = "memory")]
pub use crate::store::memory::lock::MemoryLockStore;
#[cfg(feature = "mysql")]
pub use crate::store::mysql::lock::MysqlLockStore;
#[cfg(feature = "postgres")]
pub use crate::store::postgres::lock::PgLockStore;
#[cfg(feature = "redis")]
pub use crate::store::redis::lock::{LockView, RedisLockStore};
pub use decision::LockTicket;
pub use layer::LockLayer;
pub use lease::LockLease;
pub use store::LockStore;
