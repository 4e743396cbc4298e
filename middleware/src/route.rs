//! A route: one kind of message, its key and its stack.

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;

use tower_service::Service;
use tracing::Instrument;

use crate::envelope::{Delivery, Envelope};
use crate::error::BoxError;
use crate::key::KeyExtractor;
use crate::outcome::{DeadLetterReason, Outcome, RetryReason};

/// How many attempts a route allows unless configured otherwise; RocketMQ's default
/// `maxReconsumeTimes` is 16 as well.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 16;

/// One kind of message (e.g. "deduct stock"), the extractor of its business key and the
/// stack of tiers that handles it. Adapters call [`Route::handle`] per delivery and map the
/// [`Outcome`] to the broker.
///
/// `Route` is the only place a delivery becomes an [`Envelope`], so every adapter gets the
/// same key rules, the same dead letters for bad keys and the same retry limit.
pub struct Route<S> {
    name: Arc<str>,
    key: KeyExtractor,
    max_attempts: u32,
    stack: S,
}

impl<S: Clone> Clone for Route<S> {
    fn clone(&self) -> Self {
        Route {
            name: self.name.clone(),
            key: self.key.clone(),
            max_attempts: self.max_attempts,
            stack: self.stack.clone(),
        }
    }
}

impl<S> fmt::Debug for Route<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("name", &self.name)
            .field("key", &self.key)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

impl<S> Route<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    /// A route named `name` (used in logs) that reads keys with `key` and handles envelopes
    /// with `stack`.
    pub fn new(name: impl Into<Arc<str>>, key: KeyExtractor, stack: S) -> Self {
        Route {
            name: name.into(),
            key,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            stack,
        }
    }

    /// Sets how many attempts a delivery gets (default [`DEFAULT_MAX_ATTEMPTS`]). A delivery
    /// whose attempt number has reached it and that would be retried again because something
    /// *failed* (the handler, a store, a lost lease) is dead-lettered with
    /// [`DeadLetterReason::AttemptsExhausted`] instead. Waiting for another delivery of the
    /// same key or entity (in flight elsewhere, lock busy) is not a failure and never
    /// exhausts attempts: the other holder's lease bounds that wait. Values below 1 are read
    /// as 1.
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// The route's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs one delivery through the stack and answers with its outcome.
    ///
    /// Never fails: a bad key is a [`DeadLetter`](Outcome::DeadLetter), an error from the
    /// stack (a service other than oncely's tiers, such as a timeout) is a
    /// [`RetryLater`](Outcome::RetryLater).
    pub async fn handle(&self, delivery: Delivery) -> Outcome {
        let attempt = delivery.attempt();
        let span = tracing::debug_span!(
            "oncely",
            route = %self.name,
            key = tracing::field::Empty,
            attempt,
            outcome = tracing::field::Empty
        );
        let outcome = async {
            let key = match self.key.extract(&delivery) {
                Ok(key) => key,
                Err(error) => return Outcome::dead_letter(DeadLetterReason::InvalidKey, error.to_string()),
            };
            tracing::Span::current().record("key", key.as_str());
            let failed = |error: S::Error| {
                let error: BoxError = error.into();
                Outcome::retry_later(RetryReason::HandlerFailed, error.to_string(), None)
            };
            let mut stack = self.stack.clone();
            if let Err(error) = poll_fn(|cx| stack.poll_ready(cx)).await {
                return failed(error);
            }
            let mut envelope = Envelope::new(key, delivery);
            envelope
                .extensions_mut()
                .insert(crate::telemetry::RouteName(self.name.clone()));
            stack.call(envelope).await.unwrap_or_else(failed)
        }
        .instrument(span.clone())
        .await;
        let outcome = match outcome {
            Outcome::RetryLater(retry) if attempt >= self.max_attempts && !is_waiting(retry.reason) => {
                Outcome::dead_letter(
                    DeadLetterReason::AttemptsExhausted,
                    format!("gave up after {attempt} attempts; last: {retry}"),
                )
            }
            outcome => outcome,
        };
        span.record("outcome", tracing::field::display(&outcome));
        span.in_scope(|| tracing::debug!(?outcome, "settled"));
        crate::telemetry::count_outcome(&self.name, &outcome);
        outcome
    }
}

/// True for retries that wait for another delivery rather than recover from a failure.
fn is_waiting(reason: RetryReason) -> bool {
    matches!(reason, RetryReason::InFlight(_) | RetryReason::LockBusy)
}
