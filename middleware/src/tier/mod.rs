//! What every tier shares: the [`TierDecision`] a tier implements, and the one
//! [`TierService`] that runs any decision around the tiers behind it.
//!
//! A tier is its store plus its decision. The decision says what happens *before* the tiers
//! behind run ([`TierDecision::enter`]: go on with a ticket, or stop with an outcome) and
//! *after* they answered ([`TierDecision::exit`]: settle the ticket by their outcome).
//! [`TierService`] does the rest, the same way for every tier:
//! - readiness: `poll_ready` readies the tiers behind, and the readied service goes with
//!   the call;
//! - the failure policy: a store error in `enter` fails open (the tiers behind decide) or
//!   closed ([`RetryReason::StoreUnavailable`](crate::RetryReason::StoreUnavailable)), as
//!   [`TierDecision::failure_policy`] says; an error `exit` returns is that retry;
//! - an error or a non-oncely failure from the tiers behind becomes an outcome
//!   ([`RetryReason::HandlerFailed`](crate::RetryReason::HandlerFailed)) before `exit` sees it;
//! - metrics (cargo feature `metrics`, on by default): see [`crate::telemetry`].
//!
//! A tier of your own is a type implementing [`TierDecision`] and a `tower_layer::Layer`
//! whose service is `TierService::new(inner, decision)`.
//!
//! [`TierService`] runs anything implementing [`TierRun`]: every [`TierDecision`], and the
//! batched transactional record (`record::BatchedService`), whose deliveries join a shared
//! transaction instead of running `enter` and `exit` one by one — through the same
//! readiness, boxing and metrics as every other tier.

mod decision;
mod service;

use std::fmt;

pub use decision::{Enter, FailurePolicy, TierDecision};
pub(crate) use decision::{in_flight, payload_mismatch};
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub(crate) use service::decide;
pub use service::{BoxFuture, TierRun, TierService};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use service::{behind, store_unavailable};

/// A tier of the stack, named in outcomes, errors, metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tier {
    /// The state-machine guard ([`crate::state_guard`]).
    StateGuard,
    /// The local pre-filter of settled keys (`crate::prefilter`, feature `prefilter`).
    PreFilter,
    /// The fast per-key flag ([`crate::flag`]).
    Flag,
    /// The per-entity lease lock ([`crate::lock`]).
    Lock,
    /// The flag and the lock run as one tier on one Redis (`crate::flag_lock`, feature
    /// `redis`).
    FlagLock,
    /// The durable consumption record ([`crate::record`]).
    Record,
    /// The user's handler.
    Handler,
    /// A tier of the user's own ([`TierDecision`]), by its snake-case name.
    Custom(&'static str),
}

impl Tier {
    /// The tier's name in snake case, as used in logs, metrics and dead-letter metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::StateGuard => "state_guard",
            Tier::PreFilter => "prefilter",
            Tier::Flag => "flag",
            Tier::Lock => "lock",
            Tier::FlagLock => "flag_lock",
            Tier::Record => "record",
            Tier::Handler => "handler",
            Tier::Custom(name) => name,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
