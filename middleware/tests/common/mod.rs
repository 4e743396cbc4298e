//! Helpers shared by the tier tests: deliveries and a handler that counts its effects.
#![allow(dead_code, unreachable_pub)] // each test binary uses its own subset

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely::{Delivery, Envelope, HandlerError, Outcome, Source, handler_fn};
use tower::Service;

/// A delivery of `body` from an in-process queue.
pub fn delivery(body: impl Into<String>) -> Delivery {
    Delivery::new(Source::new("test"), body.into())
}

/// A JSON order event `{"orderId": id, "sku": sku}`.
pub fn order(id: &str, sku: &str) -> Delivery {
    delivery(format!(r#"{{"orderId":"{id}","sku":"{sku}"}}"#))
}

/// What a handler did: effects per business key, and how many ran at once at most.
#[derive(Clone, Default)]
pub struct Effects {
    per_key: Arc<Mutex<HashMap<String, usize>>>,
    running: Arc<AtomicUsize>,
    max_running: Arc<AtomicUsize>,
}

impl Effects {
    pub fn of(&self, key: &str) -> usize {
        self.per_key.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    pub fn total(&self) -> usize {
        self.per_key.lock().unwrap().values().sum()
    }

    pub fn max_concurrency(&self) -> usize {
        self.max_running.load(Ordering::SeqCst)
    }

    /// A handler that takes `work` to apply one effect for the envelope's key, and fails with
    /// a transient error for the first `failures` calls.
    pub fn handler(
        &self,
        work: Duration,
        failures: usize,
    ) -> impl Service<Envelope, Response = Outcome, Error = Infallible, Future: Send> + Clone + Send + 'static
    {
        let effects = self.clone();
        let failures_left = Arc::new(AtomicUsize::new(failures));
        handler_fn(move |envelope: Envelope| {
            let effects = effects.clone();
            let failures_left = failures_left.clone();
            async move {
                let now = effects.running.fetch_add(1, Ordering::SeqCst) + 1;
                effects.max_running.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(work).await;
                effects.running.fetch_sub(1, Ordering::SeqCst);
                let fail = failures_left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
                    .is_ok();
                if fail {
                    return Err(HandlerError::transient("database busy"));
                }
                *effects
                    .per_key
                    .lock()
                    .unwrap()
                    .entry(envelope.key().to_string())
                    .or_default() += 1;
                Ok(())
            }
        })
    }
}

/// Runs `deliveries` through `route` on concurrent tasks and returns their outcomes.
pub async fn handle_concurrently<S>(route: &oncely::Route<S>, deliveries: Vec<Delivery>) -> Vec<Outcome>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    let tasks: Vec<_> = deliveries
        .into_iter()
        .map(|delivery| {
            let route = route.clone();
            tokio::spawn(async move { route.handle(delivery).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    outcomes
}

/// How many outcomes equal `expected`.
pub fn count(outcomes: &[Outcome], expected: impl Fn(&Outcome) -> bool) -> usize {
    outcomes.iter().filter(|outcome| expected(outcome)).count()
}

/// What a tier that remembers keys must do with each fingerprint policy: `route` gives a
/// route with `policy` (each policy's keys are its own, so one store may serve all), caught as duplicates by `tier`, on whose
/// handler `effects` counts. Bodies are `{"orderId", "sku", "sentAt"}`.
pub async fn fingerprint_policies_are_applied<S>(
    route: impl Fn(oncely::FingerprintPolicy) -> oncely::Route<S>,
    effects: &Effects,
    tier: oncely::Tier,
) where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    use oncely::{DeadLetterReason, FingerprintPolicy};
    let sent = |id: &str, sku: &str, at: u32| {
        delivery(format!(r#"{{"orderId":"{id}","sku":"{sku}","sentAt":{at}}}"#))
    };
    // Per policy: a key first sent as sku A at time 1, then a copy that is the same payload
    // under the policy, then one that is not (if any).
    let cases = [
        (FingerprintPolicy::whole_body(), "o-1", ("A", 1), Some(("A", 2))),
        (
            FingerprintPolicy::fields(["/orderId", "/sku"]).unwrap(),
            "o-2",
            ("A", 2),
            Some(("B", 3)),
        ),
        (FingerprintPolicy::off(), "o-3", ("B", 2), None),
    ];
    for (policy, id, (same_sku, same_at), other) in cases {
        let route = route(policy);
        assert_eq!(route.handle(sent(id, "A", 1)).await, Outcome::Processed);
        assert_eq!(
            route.handle(sent(id, same_sku, same_at)).await,
            Outcome::Duplicate { tier },
            "{id}"
        );
        if let Some((sku, at)) = other {
            let reused = route.handle(sent(id, sku, at)).await;
            assert_eq!(
                reused.dead_letter_reason(),
                Some(DeadLetterReason::PayloadMismatch),
                "{id}"
            );
        }
        assert_eq!(effects.of(id), 1, "{id}");
    }
}

/// A stack as the tests' routes hold it.
pub trait Stack:
    Service<Envelope, Response = Outcome, Error = std::convert::Infallible, Future: Send>
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> Stack for S where
    S: Service<Envelope, Response = Outcome, Error = std::convert::Infallible, Future: Send>
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// Thirty-two concurrent copies of one order through `route`, whose handler takes a while:
/// one runs the handler, the rest wait for `tier`'s claim, and a later copy is `tier`'s
/// duplicate.
pub async fn one_of_thirty_two_concurrent_copies_runs<S: Stack>(
    route: &oncely::Route<S>,
    effects: &Effects,
    tier: oncely::Tier,
) {
    let outcomes = handle_concurrently(route, vec![order("o-1", "A"); 32]).await;
    assert_eq!(count(&outcomes, |o| *o == Outcome::Processed), 1);
    assert_eq!(
        count(&outcomes, |o| o.retry_reason()
            == Some(oncely::RetryReason::InFlight(tier))),
        31
    );
    assert_eq!(effects.of("o-1"), 1);
    assert_eq!(route.handle(order("o-1", "A")).await, Outcome::Duplicate { tier });
}
