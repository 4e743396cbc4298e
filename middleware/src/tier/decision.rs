use std::future::Future;
use std::time::Duration;

use super::Tier;
use crate::dead_letter::DeadLetterReason;
use crate::envelope::{BusinessKey, Envelope};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::outcome::{Outcome, RetryReason};

/// What a tier does when its store is unreachable or answers with an error.
///
/// Whatever the policy, a store failure never acks a delivery by itself: failing open hands
/// the decision to the tiers behind, failing closed asks the broker to retry later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Skip this tier for the delivery and let the tiers behind it decide. Sound only when a
    /// durable tier (the record) stands behind it; the flag's default.
    FailOpen,
    /// Answer [`RetryLater`](crate::Outcome::RetryLater): the delivery waits until the store is
    /// back. The default of every other tier.
    FailClosed,
}

/// What a tier decided before the tiers behind it run.
#[derive(Debug)]
pub enum Enter<T> {
    /// Run the tiers behind, then settle this ticket by their outcome in
    /// [`TierDecision::exit`].
    Proceed(T),
    /// Answer this outcome; the tiers behind do not run and `exit` is not called.
    Stop(Outcome),
}

/// What one tier decides, before and after the tiers behind it; [`TierService`](super::TierService)
/// runs it. See the [module docs](super).
///
/// A ticket that is dropped without `exit` — the stack's future was dropped by a timeout
/// in front or a shutdown, or a tier behind panicked — must leave nothing that blocks the
/// key for longer than its lease: its `Drop` is the only cleanup that runs then.
pub trait TierDecision: Send + Sync + 'static {
    /// What `enter` hands to `exit` for one envelope: a claim's token, a lock's lease, an
    /// open transaction.
    type Ticket: Send + 'static;

    /// The tier, for outcomes, metrics and logs.
    const TIER: Tier;

    /// What a store error in [`enter`](TierDecision::enter) does. Fail closed unless the
    /// tier says otherwise.
    fn failure_policy(&self) -> FailurePolicy {
        FailurePolicy::FailClosed
    }

    /// Decides whether the tiers behind run for `envelope`, and may hand them values in its
    /// [extensions](Envelope::extensions_mut). A store error is handled by the failure policy.
    fn enter(
        &self,
        envelope: &mut Envelope,
    ) -> impl Future<Output = Result<Enter<Self::Ticket>, StoreError>> + Send;

    /// Runs beside the tiers behind, in the task running the delivery (its own, or its
    /// batch's), while they run for `ticket`, and is dropped when they answer, before
    /// [`exit`](TierDecision::exit): what keeps the ticket's hold alive, such as the lock's
    /// watchdog renewing its lease. Polled before the tiers behind at each turn; ending early
    /// only stops it, the tiers behind run on. Nothing by default.
    fn keep_alive(&self, ticket: &Self::Ticket) -> impl Future<Output = ()> + Send {
        let _ = ticket;
        std::future::pending()
    }

    /// Settles `ticket` by the tiers' `outcome` and answers the tier's outcome (usually
    /// `outcome` itself). A store error becomes a retry
    /// ([`StoreUnavailable`](crate::RetryReason::StoreUnavailable)) — whatever the tiers
    /// behind did. Behind a durable tier (a three-step record) that retry makes the record
    /// run the handler again, so a tier whose settling is only an optimisation (the flag,
    /// the record's own settle) logs its store error and answers `outcome` instead.
    fn exit(
        &self,
        ticket: Self::Ticket,
        outcome: Outcome,
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send;
}

/// The answer when another delivery of `key` holds `tier`'s claim.
pub(crate) fn in_flight(tier: Tier, key: &BusinessKey, delay: Duration) -> Outcome {
    Outcome::retry_later(
        RetryReason::InFlight(tier),
        format!("key {key} is being processed by another delivery (its {tier} claim)"),
        Some(delay),
    )
}

/// The answer when `key` was remembered with the payload `recorded` and this delivery
/// carries `this`.
pub(crate) fn payload_mismatch(key: &BusinessKey, recorded: Fingerprint, this: Fingerprint) -> Outcome {
    Outcome::dead_letter(
        DeadLetterReason::PayloadMismatch,
        format!("key {key} was processed with payload {recorded}, this one is {this}"),
    )
}
