//! The state-machine guard: applies an entity's events only along declared transitions.
//!
//! Each envelope names an entity (e.g. a shipment id) and the state its event moves the
//! entity to (e.g. `Departed`), both read by [`KeyExtractor`](crate::KeyExtractor)s. The
//! guard reads the entity's current state and checks the [`StateMachine`]:
//!
//! | check | outcome |
//! |---|---|
//! | transition declared | the tiers behind run; on success the new state is committed |
//! | not declared (e.g. an older event after a newer one) | [`Stale`](crate::Outcome::Stale), acked |
//! | target or stored state not in the machine | [`DeadLetter`](crate::Outcome::DeadLetter) (`unknown_state`) |
//!
//! The new state is committed only after the tiers behind answered processed or duplicate,
//! with a compare-and-set against the state that was checked. Committing after the handler
//! means a crash in between loses nothing: the redelivery passes the check again.
//!
//! # What it guarantees alone, and what it relies on
//! The guard orders events; it does not remove duplicates of an applied event by itself
//! between its check and its commit. Put a key tier ([flag](crate::flag) or
//! [record](crate::record)) *behind* it, so a redelivery after a crash or after a lost
//! commit is answered `Duplicate` and the state is committed without running the handler
//! twice. Two events of one entity checked at once can both pass; serialise an entity's
//! events with the [lock](crate::lock) in front of the guard, or with an orderly consumer.
//! If the commit still loses a race, the outcome is
//! [`RetryLater`](crate::Outcome::RetryLater) and the redelivery is checked against the
//! new state.

mod decision;
mod layer;
mod machine;
mod store;

#[cfg(feature = "memory")]
pub use crate::store::memory::state::MemoryStateStore;
#[cfg(feature = "mysql")]
pub use crate::store::mysql::state::MysqlStateStore;
#[cfg(feature = "postgres")]
pub use crate::store::postgres::state::PgStateStore;
pub use decision::StateTicket;
pub use layer::StateGuardLayer;
pub use machine::{StateMachine, StateMachineBuilder};
pub use store::StateStore;
