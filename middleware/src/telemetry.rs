//! Per-tier payoff metrics, through the [`metrics`] facade: plug in any recorder (the
//! examples install a Prometheus exporter); without one, recording costs next to nothing.
//!
//! Every tier, per route (labels `route` and `tier`):
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
//! `duplicate`, `stale`, `retry_later`, `dead_letter`), and with a
//! [pre-filter](crate::prefilter), `oncely_prefilter_verdicts_total` (labels `route`,
//! `verdict`).
//!
//! Reading the payoff of a tier: `duplicates / envelopes` is its hit rate, `passed` is the
//! load it leaves to the tiers behind (for the flag: what reaches PostgreSQL), and its
//! `seconds` minus the next tier's is what it costs per envelope.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use metrics::Label;
use tower_service::Service;

use crate::envelope::Envelope;
use crate::outcome::{Outcome, RetryReason, Tier};
use crate::service::{BoxFuture, take_ready};

/// The route an envelope is on, set by [`Route::handle`](crate::Route::handle) for the
/// metrics' `route` label.
#[derive(Clone, Debug)]
pub(crate) struct RouteName(pub(crate) Arc<str>);

fn route_of(envelope: &Envelope) -> Arc<str> {
    envelope
        .extensions()
        .get::<RouteName>()
        .map_or_else(|| Arc::from("unnamed"), |name| name.0.clone())
}

/// The labels of a tier's metrics; the route's name is shared, not copied, per envelope.
fn tier_labels(envelope: &Envelope, tier: Tier) -> Vec<Label> {
    vec![
        Label::new("route", route_of(envelope)),
        Label::new("tier", tier.as_str()),
    ]
}

/// Counts a store failure of `tier` that the tier passed over (fail open).
pub(crate) fn count_store_error(envelope: &Envelope, tier: Tier) {
    metrics::counter!("oncely_tier_errors_total", tier_labels(envelope, tier)).increment(1);
}

/// Counts a pre-filter's verdict (`oncely_prefilter_verdicts_total`, labels `route` and
/// `verdict`: `certainly_new` or `maybe_seen`): certainly new envelopes are the lookups the
/// tiers behind could skip.
#[cfg(feature = "prefilter")]
pub(crate) fn count_prefilter_verdict(envelope: &Envelope, verdict: crate::prefilter::Verdict) {
    let verdict = match verdict {
        crate::prefilter::Verdict::CertainlyNew => "certainly_new",
        crate::prefilter::Verdict::MaybeSeen => "maybe_seen",
    };
    metrics::counter!("oncely_prefilter_verdicts_total", "route" => route_of(envelope), "verdict" => verdict)
        .increment(1);
}

/// Counts one settled delivery of `route`.
pub(crate) fn count_outcome(route: &Arc<str>, outcome: &Outcome) {
    let outcome = match outcome {
        Outcome::Processed => "processed",
        Outcome::Duplicate { .. } => "duplicate",
        Outcome::Stale { .. } => "stale",
        Outcome::RetryLater(_) => "retry_later",
        Outcome::DeadLetter(_) => "dead_letter",
    };
    metrics::counter!("oncely_outcomes_total", "route" => route.clone(), "outcome" => outcome).increment(1);
}

/// Builds a tier's service measured: `build` gets `inner` wrapped to count what the tier
/// passes on, and what it returns is wrapped to count what reaches the tier.
pub(crate) fn measured<S, T>(tier: Tier, inner: S, build: impl FnOnce(Passed<S>) -> T) -> Measured<T> {
    Measured {
        inner: build(Passed { inner, tier }),
        tier,
    }
}

/// Wraps a tier's service: counts the envelopes reaching it, the duplicates it caught, its
/// store failures, and times it. Every tier's layer puts it around its service.
#[derive(Clone, Debug)]
pub struct Measured<S> {
    inner: S,
    tier: Tier,
}

impl<S> Service<Envelope> for Measured<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let tier = self.tier;
        let labels = tier_labels(&envelope, tier);
        let answer = take_ready(&mut self.inner).call(envelope);
        Box::pin(async move {
            metrics::counter!("oncely_tier_envelopes_total", labels.clone()).increment(1);
            let started = Instant::now();
            let answer = answer.await;
            metrics::histogram!("oncely_tier_seconds", labels.clone())
                .record(started.elapsed().as_secs_f64());
            match &answer {
                Ok(Outcome::Duplicate { tier: caught }) if *caught == tier => {
                    metrics::counter!("oncely_tier_duplicates_total", labels).increment(1);
                }
                Ok(outcome) if outcome.retry_reason() == Some(RetryReason::StoreUnavailable(tier)) => {
                    metrics::counter!("oncely_tier_errors_total", labels).increment(1);
                }
                _ => {}
            }
            answer
        })
    }
}

/// Wraps what a tier passes on to: counts the envelopes that got past the tier.
#[derive(Clone, Debug)]
pub struct Passed<S> {
    inner: S,
    tier: Tier,
}

impl<S> Service<Envelope> for Passed<S>
where
    S: Service<Envelope, Response = Outcome>,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        metrics::counter!("oncely_tier_passed_total", tier_labels(&envelope, self.tier)).increment(1);
        self.inner.call(envelope)
    }
}
