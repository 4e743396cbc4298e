use std::time::Duration;

use tower_layer::Layer;

use crate::key::KeyExtractor;
use crate::tier::{FailurePolicy, TierService};

/// Adds the [lock tier](crate::lock) in front of a service.
#[derive(Clone, Debug)]
pub struct LockLayer<St> {
    pub(crate) store: St,
    pub(super) entity: KeyExtractor,
    pub(crate) lease: Duration,
    pub(super) renew_every: Duration,
    pub(super) busy_delay: Duration,
    pub(crate) failure_policy: FailurePolicy,
}

impl<St> LockLayer<St> {
    /// A lock tier on `store`, locking the entity that `entity` reads from each delivery.
    ///
    /// Defaults: lease 30 s renewed every 10 s, retry delay when busy 1 s, fail closed.
    pub fn new(store: St, entity: KeyExtractor) -> Self {
        let lease = Duration::from_secs(30);
        LockLayer {
            store,
            entity,
            lease,
            renew_every: lease / 3,
            busy_delay: Duration::from_secs(1),
            failure_policy: FailurePolicy::FailClosed,
        }
    }

    /// Sets the lease, and renewal at a third of it. A short lease frees the entity soon
    /// after a crash; the watchdog keeps it held for as long as the handler runs.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self.renew_every = lease / 3;
        self
    }

    setters! {
        /// Sets how often the watchdog renews the lease (default a third of the lease), counted
        /// from the start of the last renewal that succeeded. Renewal must succeed at least once
        /// per lease; a failed renewal is retried at this pace until the lease would run out,
        /// and then the lease counts as lost — as it does when a renewal is still unanswered
        /// then (a store gone silent). So keep it well under the lease: at or above it, every
        /// handler that outlives it loses its lease.
        with_renew_every(renew_every: Duration);

        /// The delay suggested to the broker when the entity is locked by another delivery.
        with_busy_delay(busy_delay: Duration);

        /// What to do when the store fails (default [`FailurePolicy::FailClosed`]). Failing open
        /// runs the handler without mutual exclusion.
        with_failure_policy(failure_policy: FailurePolicy);
    }
}

impl<S, St: Clone> Layer<S> for LockLayer<St> {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}
