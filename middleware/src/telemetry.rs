//! Per-tier payoff metrics, through the [`metrics`](https://docs.rs/metrics) facade (cargo
//! feature `metrics`, on by default): plug in any recorder (the examples install a
//! Prometheus exporter); without one, recording costs next to nothing, and without the
//! feature nothing is recorded at all.
//!
//! Every tier, per route (labels `route` and `tier`), recorded once for all tiers by
//! [`TierService`](crate::tier::TierService):
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `oncely_tier_envelopes_total` | counter | envelopes that reached the tier |
//! | `oncely_tier_duplicates_total` | counter | duplicates the tier caught (`Duplicate { tier }`) |
//! | `oncely_tier_passed_total` | counter | envelopes the tier passed on to the tiers behind it |
//! | `oncely_tier_errors_total` | counter | store failures: retried (fail closed) or passed on (fail open) |
//! | `oncely_tier_seconds` | histogram | time from entering the tier to its answer, tiers behind included |
//!
//! and per route, `oncely_outcomes_total` (labels `route`, `outcome`: `processed`,
//! `duplicate`, `stale`, `retry_later`, `dead_letter`), and with a pre-filter,
//! `oncely_prefilter_verdicts_total` (labels `route`, `verdict`: `certainly_new`,
//! `maybe_seen`).
//!
//! The batched record counts its transactions: `oncely_batches_total` (label `ending`:
//! `committed`, `rolled_back`, or `empty` when every claim of a batch found its answer and no
//! handler ran) and `oncely_batch_deliveries_total`, the deliveries whose
//! effects committed batches carried (copies answered by a batch's claim without their
//! handler running are not counted). Deliveries per transaction, the payoff of batching, is
//! their quotient over the committed batches.
//!
//! Reading the payoff of a tier: `duplicates / envelopes` is its hit rate, `passed` is the
//! load it leaves to the tiers behind (for the flag: what reaches PostgreSQL), and its
//! `seconds` minus the next tier's is what it costs per envelope.

use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::tier::Tier;

#[cfg(feature = "metrics")]
#[doc(hidden)]
pub use recorded::Probe;
#[cfg(all(feature = "metrics", any(feature = "postgres", feature = "mysql")))]
pub(crate) use recorded::count_batch;
#[cfg(all(feature = "metrics", feature = "prefilter"))]
pub(crate) use recorded::count_verdict;
#[cfg(feature = "metrics")]
pub(crate) use recorded::{count_outcome, count_purged, count_retention_pass};
#[cfg(not(feature = "metrics"))]
#[doc(hidden)]
pub use silent::Probe;
#[cfg(all(not(feature = "metrics"), any(feature = "postgres", feature = "mysql")))]
pub(crate) use silent::count_batch;
#[cfg(all(not(feature = "metrics"), feature = "prefilter"))]
pub(crate) use silent::count_verdict;
#[cfg(not(feature = "metrics"))]
pub(crate) use silent::{count_outcome, count_purged, count_retention_pass};

#[cfg(feature = "metrics")]
mod recorded {
    use std::sync::Arc;
    use std::time::Instant;

    use metrics::Label;

    use super::{Envelope, Outcome, Tier};
    use crate::outcome::RetryReason;

    /// One envelope's way through one tier, as metrics.
    /// What one envelope did in one tier, recorded as it goes: public only because
    /// [`TierRun`](crate::tier::TierRun) hands it on; nothing outside oncely can use it.
    pub struct Probe {
        tier: Tier,
        labels: Vec<Label>,
        started: Instant,
    }

    impl Probe {
        /// Counts `envelope` reaching `tier` and starts its timer.
        pub(crate) fn enter(envelope: &Envelope, tier: Tier) -> Self {
            let labels = vec![
                Label::new("route", Arc::clone(envelope.route_name())),
                Label::new("tier", tier.as_str()),
            ];
            metrics::counter!("oncely_tier_envelopes_total", labels.clone()).increment(1);
            Probe {
                tier,
                labels,
                started: Instant::now(),
            }
        }

        /// The tier passed the envelope on to the tiers behind.
        pub(crate) fn passed(&self) {
            metrics::counter!("oncely_tier_passed_total", self.labels.clone()).increment(1);
        }

        /// The tier's store failed and the tier passed the envelope on (fail open); a failure
        /// that ends in `StoreUnavailable` is counted from the outcome.
        pub(crate) fn store_failed(&self) {
            metrics::counter!("oncely_tier_errors_total", self.labels.clone()).increment(1);
        }

        /// The tier answered `outcome`.
        pub(crate) fn answered(self, outcome: &Outcome) {
            metrics::histogram!("oncely_tier_seconds", self.labels.clone())
                .record(self.started.elapsed().as_secs_f64());
            if *outcome == (Outcome::Duplicate { tier: self.tier }) {
                metrics::counter!("oncely_tier_duplicates_total", self.labels).increment(1);
            } else if outcome.retry_reason() == Some(RetryReason::StoreUnavailable(self.tier)) {
                metrics::counter!("oncely_tier_errors_total", self.labels).increment(1);
            }
        }
    }

    /// The outcome's name in `oncely_outcomes_total`.
    fn outcome_label(outcome: &Outcome) -> &'static str {
        match outcome {
            Outcome::Processed => "processed",
            Outcome::Duplicate { .. } => "duplicate",
            Outcome::Stale { .. } => "stale",
            Outcome::RetryLater(_) => "retry_later",
            Outcome::DeadLetter(_) => "dead_letter",
        }
    }

    /// Counts one settled delivery of `route`.
    pub(crate) fn count_outcome(route: &Arc<str>, outcome: &Outcome) {
        metrics::counter!("oncely_outcomes_total", "route" => route.clone(), "outcome" => outcome_label(outcome))
            .increment(1);
    }

    /// Counts one retention batch of `table` that deleted `rows`.
    pub(crate) fn count_purged(table: &str, rows: u64) {
        let table = table.to_owned();
        metrics::counter!("oncely_retention_purged_rows_total", "table" => table.clone()).increment(rows);
        metrics::counter!("oncely_retention_batches_total", "table" => table).increment(1);
    }

    /// Counts one retention pass over `table` that ended as `result`.
    pub(crate) fn count_retention_pass(table: &str, result: &'static str) {
        metrics::counter!("oncely_retention_passes_total", "table" => table.to_owned(), "result" => result)
            .increment(1);
    }

    /// Counts one transaction of the batched record, ended as `ending` (`committed` with
    /// the effects of `deliveries` handlers, `rolled_back`, or `empty`: no handler to run).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn count_batch(deliveries: usize, ending: &'static str) {
        metrics::counter!("oncely_batches_total", "ending" => ending).increment(1);
        if ending == "committed" {
            metrics::counter!("oncely_batch_deliveries_total").increment(deliveries as u64);
        }
    }

    /// Counts a pre-filter's verdict for `envelope`: `certainly_new` or `maybe_seen`.
    #[cfg(feature = "prefilter")]
    pub(crate) fn count_verdict(envelope: &Envelope, verdict: &'static str) {
        metrics::counter!("oncely_prefilter_verdicts_total", "route" => Arc::clone(envelope.route_name()), "verdict" => verdict)
            .increment(1);
    }
}

#[cfg(not(feature = "metrics"))]
mod silent {
    use std::sync::Arc;

    use super::{Envelope, Outcome, Tier};

    /// Without the `metrics` feature, a probe records nothing.
    /// What one envelope did in one tier: nothing is recorded without the `metrics`
    /// feature. Public only because [`TierRun`](crate::tier::TierRun) hands it on.
    pub struct Probe;

    impl Probe {
        pub(crate) fn enter(_: &Envelope, _: Tier) -> Self {
            Probe
        }
        pub(crate) fn passed(&self) {}
        pub(crate) fn store_failed(&self) {}
        pub(crate) fn answered(self, _: &Outcome) {}
    }

    pub(crate) fn count_outcome(_: &Arc<str>, _: &Outcome) {}
    pub(crate) fn count_purged(_: &str, _: u64) {}
    pub(crate) fn count_retention_pass(_: &str, _: &'static str) {}
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn count_batch(_: usize, _: &'static str) {}

    #[cfg(feature = "prefilter")]
    pub(crate) fn count_verdict(_: &Envelope, _: &'static str) {}
}
