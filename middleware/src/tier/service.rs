use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_service::Service;

use super::Tier;
use super::decision::{Enter, FailurePolicy, TierDecision};
use crate::envelope::Envelope;
use crate::error::{BoxError, StoreError};
use crate::outcome::{Outcome, RetryReason};
use crate::telemetry::Probe;

/// The future type of every tier's service: one allocation per envelope, negligible next to
/// the store round trips a tier makes.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// How a [`TierService`] runs one envelope through its tier and the tiers behind.
/// Implemented for every [`TierDecision`] (its `enter`, the tiers behind, its `exit`, under
/// its failure policy) and by oncely's batched transactional record, whose deliveries take
/// their part in a shared transaction. A tier of your own implements [`TierDecision`].
pub trait TierRun: Send + Sync + 'static {
    /// The tier, for outcomes, metrics and logs.
    const TIER: Tier;

    /// Runs `envelope` through this tier in front of `inner`, the tiers behind, telling
    /// `probe` what it did.
    #[doc(hidden)]
    fn run<S>(&self, inner: S, envelope: Envelope, probe: &Probe) -> impl Future<Output = Outcome> + Send
    where
        S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>;
}

impl<D: TierDecision> TierRun for D {
    const TIER: Tier = D::TIER;

    async fn run<S>(&self, inner: S, envelope: Envelope, probe: &Probe) -> Outcome
    where
        S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        decide(self, inner, envelope, probe).await
    }
}

/// The service of every tier: runs the decision `D` around the tiers behind (`S`); see the
/// [module docs](super) for what it does the same way for every tier.
///
/// Holds the decision behind an `Arc`: a call clones a pointer, not the tier's
/// configuration. Its call never fails: failures are outcomes. Only `poll_ready` passes on
/// the error of the service behind.
pub struct TierService<S, D> {
    inner: S,
    decision: Arc<D>,
}

impl<S, D> TierService<S, D> {
    /// Runs `decision` in front of `inner`.
    pub fn new(inner: S, decision: D) -> Self {
        TierService {
            inner,
            decision: Arc::new(decision),
        }
    }
}

impl<S, D> TierService<S, D> {
    /// Runs the shared `decision` in front of `inner`, without copying its configuration.
    #[cfg(feature = "redis")]
    pub(crate) fn shared(inner: S, decision: Arc<D>) -> Self {
        TierService { inner, decision }
    }
}

impl<S: Clone, D> Clone for TierService<S, D> {
    fn clone(&self) -> Self {
        TierService {
            inner: self.inner.clone(),
            decision: self.decision.clone(),
        }
    }
}

impl<S: fmt::Debug, D: fmt::Debug> fmt::Debug for TierService<S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierService")
            .field("decision", &self.decision)
            .field("inner", &self.inner)
            .finish()
    }
}

impl<S, D> Service<Envelope> for TierService<S, D>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    D: TierRun,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let inner = take_readied(&mut self.inner);
        let decision = self.decision.clone();
        Box::pin(async move {
            let probe = Probe::enter(&envelope, D::TIER);
            let outcome = decision.run(inner, envelope, &probe).await;
            probe.answered(&outcome);
            Ok(outcome)
        })
    }
}

/// The service to call: `poll_ready` reserved capacity in `inner` (a concurrency limit, a
/// buffer slot), which a clone may not have, so the readied one goes with the call and a
/// clone takes its place, as tower recommends.
fn take_readied<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// One envelope through `decision` and the tiers behind.
pub(crate) async fn decide<S, D>(decision: &D, inner: S, mut envelope: Envelope, probe: &Probe) -> Outcome
where
    S: Service<Envelope, Response = Outcome>,
    S::Error: Into<BoxError>,
    D: TierDecision,
{
    let ticket = match decision.enter(&mut envelope).await {
        Ok(Enter::Proceed(ticket)) => ticket,
        Ok(Enter::Stop(outcome)) => return outcome,
        Err(error) => {
            return match decision.failure_policy() {
                FailurePolicy::FailOpen => {
                    tracing::warn!(tier = %D::TIER, key = %envelope.key(), %error, "store failed; passing to the tiers behind");
                    probe.store_failed();
                    probe.passed();
                    behind(inner, envelope).await
                }
                FailurePolicy::FailClosed => store_unavailable(D::TIER, &error),
            };
        }
    };
    probe.passed();
    let outcome = beside(behind(inner, envelope), decision.keep_alive(&ticket)).await;
    match decision.exit(ticket, outcome).await {
        Ok(outcome) => outcome,
        Err(error) => store_unavailable(D::TIER, &error),
    }
}

/// `behind`'s outcome, with `keep_alive` running beside it until either ends.
///
/// `keep_alive` is polled first: were the tiers behind polled first, a handler whose I/O is
/// always ready would spend the task's Tokio budget on every turn, and the watchdog's
/// timer, which draws on the same budget, would never fire.
async fn beside(behind: impl Future<Output = Outcome>, keep_alive: impl Future<Output = ()>) -> Outcome {
    let mut behind = std::pin::pin!(behind);
    tokio::select! {
        biased;
        () = keep_alive => behind.await,
        outcome = &mut behind => outcome,
    }
}

/// The outcome of the tiers behind, with their error made an outcome, as the route would.
pub(crate) async fn behind<S>(mut inner: S, envelope: Envelope) -> Outcome
where
    S: Service<Envelope, Response = Outcome>,
    S::Error: Into<BoxError>,
{
    match inner.call(envelope).await {
        Ok(outcome) => outcome,
        Err(error) => Outcome::retry_later(RetryReason::HandlerFailed, error.into().to_string(), None),
    }
}

/// The answer when `tier`'s store failed and the tier fails closed.
pub(crate) fn store_unavailable(tier: Tier, error: &StoreError) -> Outcome {
    Outcome::retry_later(
        RetryReason::StoreUnavailable(tier),
        format!("{tier} {error}"),
        None,
    )
}
