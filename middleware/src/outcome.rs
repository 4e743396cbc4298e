//! The answer the stack gives for every envelope, and what the broker does with it.

use std::fmt;
use std::time::Duration;

use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::tier::Tier;

/// What the stack decided for one envelope. Every envelope gets exactly one.
///
/// | outcome | broker action | why |
/// |---|---|---|
/// | [`Processed`](Outcome::Processed) | ack | the business effect was applied now |
/// | [`Duplicate`](Outcome::Duplicate) | ack | the effect was applied before; a tier remembered it |
/// | [`Stale`](Outcome::Stale) | ack | the entity already moved past this event's state |
/// | [`RetryLater`](Outcome::RetryLater) | retry later, never ack | in flight elsewhere, lock busy or a transient failure |
/// | [`DeadLetter`](Outcome::DeadLetter) | dead-letter with the reason | the delivery can never be processed |
///
/// [`Outcome::action`] gives that mapping to adapters.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Outcome {
    /// The handler ran and succeeded: the business effect was applied by this delivery.
    Processed,
    /// The business key was already processed; the named tier caught it.
    Duplicate {
        /// The tier that recognised the duplicate.
        tier: Tier,
    },
    /// The event's target state is not reachable from the entity's current state, e.g. an
    /// older event arriving after a newer one.
    Stale {
        /// The entity's state when the event was checked (`None`: the entity has no state yet).
        current: Option<String>,
        /// The state the event asked for.
        target: String,
    },
    /// Not now: the delivery must come back later. Never acked.
    RetryLater(RetryLater),
    /// The delivery can never be processed; it goes to the dead-letter destination.
    DeadLetter(DeadLetter),
}

impl Outcome {
    /// Builds a [`RetryLater`](Outcome::RetryLater) outcome.
    pub fn retry_later(reason: RetryReason, detail: impl Into<String>, delay: Option<Duration>) -> Self {
        Outcome::RetryLater(RetryLater {
            reason,
            detail: detail.into(),
            delay,
        })
    }

    /// Builds a [`DeadLetter`](Outcome::DeadLetter) outcome.
    pub fn dead_letter(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Outcome::DeadLetter(DeadLetter {
            reason,
            detail: detail.into(),
        })
    }

    /// What the broker must do with the delivery. A dead letter's reason is cloned into the
    /// action; [`into_action`](Outcome::into_action) moves it instead.
    pub fn action(&self) -> BrokerAction {
        match self {
            Outcome::Processed | Outcome::Duplicate { .. } | Outcome::Stale { .. } => BrokerAction::Ack,
            Outcome::RetryLater(retry) => BrokerAction::Retry { delay: retry.delay },
            Outcome::DeadLetter(dead) => BrokerAction::DeadLetter(dead.clone()),
        }
    }

    /// What the broker must do with the delivery, taking the outcome: as
    /// [`action`](Outcome::action), without cloning a dead letter's reason.
    pub fn into_action(self) -> BrokerAction {
        match self {
            Outcome::DeadLetter(dead) => BrokerAction::DeadLetter(dead),
            other => other.action(),
        }
    }

    /// The retry reason, when the outcome is [`RetryLater`](Outcome::RetryLater).
    pub fn retry_reason(&self) -> Option<RetryReason> {
        match self {
            Outcome::RetryLater(retry) => Some(retry.reason),
            _ => None,
        }
    }

    /// The dead-letter reason, when the outcome is [`DeadLetter`](Outcome::DeadLetter).
    pub fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        match self {
            Outcome::DeadLetter(dead) => Some(dead.reason),
            _ => None,
        }
    }

    /// True when the key is settled for good: the effect was applied now or before, or it
    /// never will be (stale). Tiers remember such keys as done.
    pub fn is_settled(&self) -> bool {
        // The outcomes `action` acks, matched here so that a dead letter's detail is not
        // cloned on every tier's check.
        matches!(
            self,
            Outcome::Processed | Outcome::Duplicate { .. } | Outcome::Stale { .. }
        )
    }
}

/// What an adapter does with a delivery, derived from its [`Outcome`]
/// ([`Outcome::action`], [`Outcome::into_action`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BrokerAction {
    /// Acknowledge: the broker forgets the message.
    Ack,
    /// Bring the message back later (a delayed retry, RocketMQ `ReconsumeLater`); never ack it.
    Retry {
        /// The delay a tier suggests; the adapter's own retry schedule applies when `None`.
        delay: Option<Duration>,
    },
    /// Move the message to the dead-letter destination with this reason, written as the
    /// metadata of [`DeadLetter::metadata`].
    DeadLetter(DeadLetter),
}

/// Why a delivery must come back later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryLater {
    /// The reason, as a code.
    pub reason: RetryReason,
    /// Human-readable detail for logs.
    pub detail: String,
    /// A suggested delay before the next attempt.
    pub delay: Option<Duration>,
}

/// The machine-readable reason of a [`RetryLater`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryReason {
    /// Another delivery of the same key holds the tier's claim right now.
    InFlight(Tier),
    /// The entity's lock is held by another consumer.
    LockBusy,
    /// The lock's lease was lost while the handler ran; its work is not recorded as done here.
    LeaseLost,
    /// The entity's state changed while the handler ran.
    Conflict(Tier),
    /// The tier's store failed and the tier fails closed.
    StoreUnavailable(Tier),
    /// The handler (or a service in the stack) returned a transient error.
    HandlerFailed,
    /// The handler (or a service in the stack) panicked. Its open transaction was rolled
    /// back with its connection; the delivery is retried and, at the route's maximum
    /// attempts, dead-lettered as `attempts_exhausted` with the panic's message.
    HandlerPanicked,
    /// The delivery was given up before its handler ran, and nothing ran: its sender went
    /// away while it waited (an HTTP client hung up), or it can no longer run (an expired
    /// one-time token). The tiers release the key as for any retry. The batched record takes
    /// such a delivery out of its batch and commits the rest — when it is answered at once,
    /// before the run awaited anything: answered later, the run may have written, and it
    /// fails its batch as any failure does. Answer it only for a run that wrote nothing
    /// (oncely-http does, before the user's service runs).
    NotRun,
}

impl RetryReason {
    /// A short snake-case code for logs and headers.
    pub fn code(self) -> &'static str {
        match self {
            RetryReason::InFlight(_) => "in_flight",
            RetryReason::LockBusy => "lock_busy",
            RetryReason::LeaseLost => "lease_lost",
            RetryReason::Conflict(_) => "conflict",
            RetryReason::StoreUnavailable(_) => "store_unavailable",
            RetryReason::HandlerFailed => "handler_failed",
            RetryReason::HandlerPanicked => "handler_panicked",
            RetryReason::NotRun => "not_run",
        }
    }

    /// True when the retry waits for another delivery of the same key or entity (in flight
    /// elsewhere, lock busy) rather than recovering from a failure. Waits never use up a
    /// delivery's attempts: the other holder's lease bounds them.
    pub fn is_wait(self) -> bool {
        match self {
            RetryReason::InFlight(_) | RetryReason::LockBusy => true,
            RetryReason::LeaseLost
            | RetryReason::Conflict(_)
            | RetryReason::StoreUnavailable(_)
            | RetryReason::HandlerFailed
            | RetryReason::HandlerPanicked
            | RetryReason::NotRun => false,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Processed => f.write_str("processed"),
            Outcome::Duplicate { tier } => write!(f, "duplicate (caught by {tier})"),
            Outcome::Stale { current, target } => {
                let current = current.as_deref().unwrap_or("no state");
                write!(f, "stale: {target} is not reachable from {current}")
            }
            Outcome::RetryLater(retry) => write!(f, "retry later: {retry}"),
            Outcome::DeadLetter(dead) => write!(f, "dead letter: {dead}"),
        }
    }
}

impl fmt::Display for RetryLater {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason.code(), self.detail)
    }
}
