use std::time::Duration;

use tower_layer::Layer;

use crate::tier::{FailurePolicy, TierService};

/// Adds the [flag tier](crate::flag) in front of a service.
///
/// Configured in the user's terms: "retries of this route arrive within `retry_window`".
/// The done marker is kept for `retry_window + max(retry_window / 10, 1 minute)`, so a retry
/// at the very end of the window still finds it: 10 minutes → 11 minutes.
#[derive(Clone, Debug)]
pub struct FlagLayer<St> {
    pub(crate) store: St,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(super) in_flight_delay: Duration,
    pub(crate) failure_policy: FailurePolicy,
    pub(super) record_behind: bool,
}

impl<St> FlagLayer<St> {
    /// A flag tier on `store` for a route whose retries arrive within `retry_window`.
    ///
    /// Defaults: in-flight lease 30 s, retry delay for in-flight keys 1 s, fail open.
    pub fn new(store: St, retry_window: Duration) -> Self {
        FlagLayer {
            store,
            lease: Duration::from_secs(30),
            retention: retention_for(retry_window),
            in_flight_delay: Duration::from_secs(1),
            failure_policy: FailurePolicy::FailOpen,
            record_behind: false,
        }
    }

    setters! {
        /// How long an in-flight claim lives if its holder never completes or releases it (the
        /// consumer crashed). Longer than the slowest handler run, or a second delivery gets in
        /// while the first still works. Unused with a record behind, which claims nothing.
        with_lease(lease: Duration);

        /// Sets the done marker's retention directly instead of deriving it from the window.
        with_retention(retention: Duration);

        /// The delay suggested to the broker when the key is in flight elsewhere.
        with_in_flight_delay(in_flight_delay: Duration);

        /// What to do when the store fails (default [`FailurePolicy::FailOpen`]).
        with_failure_policy(failure_policy: FailurePolicy);
    }

    /// Declares that a durable record stands behind this flag, so the flag is a cache of
    /// "done" in front of it rather than the key's lock: it **claims nothing**. Each delivery
    /// reads its key's marker (one `GET` on Redis): a done marker answers duplicate (or
    /// payload mismatch), anything else lets the delivery on to the record, whose claim is
    /// the atomic one; once the tiers behind settled the key it is marked done (one write).
    /// Two round trips per delivery either way, but a read and a write cost Redis less than
    /// a claim and a compare-and-set script (`make bench`'s Redis flag table), and:
    ///
    /// - **no in-flight marker holds a key back**: after a consumer crashes, the copies the
    ///   broker delivers again go on at once. With the transactional record
    ///   (`record::PgTransactionalLayer`), which holds no lease (a dead consumer's
    ///   transaction rolls back with its connection), they are handled at once, and two live
    ///   copies of a key are serialised by the key's row: the second waits for the first's
    ///   transaction, holding a pooled connection, then answers duplicate. The three-step
    ///   record's claim and a lock have leases of their own, which such copies then wait out
    ///   instead (`InFlight(Record)`, `LockBusy`);
    /// - an envelope a pre-filter (feature `prefilter`) found certainly new skips the read:
    ///   the tiers behind run at once, and the key is marked done after (one round trip).
    ///
    /// "Done" is still remembered only after the tiers behind settled the key, so a marker
    /// never says done for an effect that was not committed. Without a record behind, do not
    /// use this: the flag is then the only key tier, and two copies of a key in flight at
    /// once would both run. With a record behind, [`with_lease`](FlagLayer::with_lease) and
    /// [`with_in_flight_delay`](FlagLayer::with_in_flight_delay) have no use, and the flag's
    /// keys (its store's prefix) must be its own: a flag without a record behind on the same
    /// keys finds no claim to stop at.
    pub fn with_record_behind(mut self) -> Self {
        self.record_behind = true;
        self
    }
}

fn retention_for(retry_window: Duration) -> Duration {
    retry_window + (retry_window / 10).max(Duration::from_secs(60))
}

impl<S, St: Clone> Layer<S> for FlagLayer<St> {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_is_the_window_plus_a_margin() {
        let minutes = |m: u64| Duration::from_secs(m * 60);
        assert_eq!(retention_for(minutes(10)), minutes(11));
        assert_eq!(retention_for(minutes(120)), minutes(132));
        assert_eq!(retention_for(Duration::from_secs(5)), Duration::from_secs(65));
    }
}
