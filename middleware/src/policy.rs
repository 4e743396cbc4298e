//! What a tier does when its store cannot answer.

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
    /// back. The lock's default.
    FailClosed,
}
