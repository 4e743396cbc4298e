//! A route: one kind of message, its key and its stack.

use std::any::Any;
use std::fmt;
use std::future::poll_fn;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use tower_service::Service;
use tracing::Instrument;

use crate::dead_letter::DeadLetterReason;
use crate::deliveries::{DeliveryCounter, DeliveryLimit};
use crate::envelope::{Delivery, Envelope};
use crate::error::{BoxError, InputError};
use crate::fingerprint::FingerprintPolicy;
use crate::key::KeyExtractor;
use crate::outcome::{Outcome, RetryReason};

/// How many attempts a route allows unless configured otherwise; RocketMQ's default
/// `maxReconsumeTimes` is 16 as well.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 16;

/// The largest body a route accepts unless configured otherwise: 4 MiB, RocketMQ's own
/// default maximum message size.
pub const DEFAULT_MAX_BODY_LEN: usize = 4 * 1024 * 1024;

/// One kind of message (e.g. "deduct stock"), the extractor of its business key and the
/// stack of tiers that handles it. Adapters call [`Route::handle`] per delivery and map the
/// [`Outcome`] to the broker.
///
/// `Route` is the only place a delivery becomes an [`Envelope`], so every adapter gets the
/// same key rules, the same dead letters for bad keys and the same retry limit.
pub struct Route<S> {
    name: Arc<str>,
    key: KeyExtractor,
    fingerprint: FingerprintPolicy,
    max_attempts: u32,
    /// `None`: the route's maximum attempts.
    max_panic_attempts: Option<u32>,
    max_body_len: usize,
    delivery_limit: Option<DeliveryLimit>,
    stack: S,
}

impl<S: Clone> Clone for Route<S> {
    fn clone(&self) -> Self {
        Route {
            name: self.name.clone(),
            key: self.key.clone(),
            fingerprint: self.fingerprint.clone(),
            max_attempts: self.max_attempts,
            max_panic_attempts: self.max_panic_attempts,
            max_body_len: self.max_body_len,
            delivery_limit: self.delivery_limit.clone(),
            stack: self.stack.clone(),
        }
    }
}

impl<S> fmt::Debug for Route<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("name", &self.name)
            .field("key", &self.key)
            .field("fingerprint", &self.fingerprint)
            .field("max_attempts", &self.max_attempts)
            .field("max_panic_attempts", &self.max_panic_attempts)
            .field("max_body_len", &self.max_body_len)
            .field("delivery_limit", &self.delivery_limit)
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
            fingerprint: FingerprintPolicy::whole_body(),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            max_panic_attempts: None,
            max_body_len: DEFAULT_MAX_BODY_LEN,
            delivery_limit: None,
            stack,
        }
    }

    /// Counts each key's unsettled deliveries in `counter`; keys that come back unsettled
    /// run alone in the process, and one that crashed `max` times that way — a message that
    /// kills its consumer process — is dead-lettered with
    /// [`DeadLetterReason::DeliveryLimit`] at its next delivery, after `max + 1` starts in
    /// all (its first, perhaps among others, is not counted against it; see
    /// [`crate::deliveries`]). Values below 1 are read as 1. For brokers that do not count
    /// redeliveries themselves (RocketMQ); the AMQP runner uses RabbitMQ's own count.
    pub fn with_delivery_limit(mut self, counter: impl DeliveryCounter, max: u32) -> Self {
        self.delivery_limit = Some(DeliveryLimit::new(counter, max));
        self
    }

    setters! {
        /// Sets what of each delivery is fingerprinted to tell a duplicate from a key reused
        /// with another payload (default [`FingerprintPolicy::whole_body()`]); see
        /// [`FingerprintPolicy`].
        with_fingerprint(fingerprint: FingerprintPolicy);

        /// Sets the largest body, in bytes, the route accepts (default
        /// [`DEFAULT_MAX_BODY_LEN`]). A larger one is dead-lettered as
        /// [`DeadLetterReason::Oversize`] before its key is read or its body parsed.
        with_max_body_len(max_body_len: usize);
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

    /// Dead-letters a delivery whose stack panicked once its attempt number reaches
    /// `max_panic_attempts` (at most the route's maximum attempts, which is the default).
    /// A panic is a bug, not a transient failure: a message that panics every time would
    /// otherwise walk the whole retry ladder (on the AMQP runner's default ladder, 16
    /// attempts take about 25 minutes) before anyone hears of it. With 1, a panicking
    /// delivery is dead-lettered at once, as [`DeadLetterReason::AttemptsExhausted`] with
    /// the panic's message in the detail. Values below 1 are read as 1.
    pub fn with_max_panic_attempts(mut self, max_panic_attempts: u32) -> Self {
        self.max_panic_attempts = Some(max_panic_attempts.max(1));
        self
    }

    /// The route's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs one delivery through the stack and answers with its outcome.
    ///
    /// Never fails and never panics: an oversize body or a bad key is a
    /// [`DeadLetter`](Outcome::DeadLetter); an error from the stack (a service other than
    /// oncely's tiers, such as a timeout) is a [`RetryLater`](Outcome::RetryLater) with
    /// [`RetryReason::HandlerFailed`], and a panic anywhere in the stack one with
    /// [`RetryReason::HandlerPanicked`]. The panicking stack's future is dropped, which
    /// rolls back the transactional record's open transaction with its connection. At the
    /// route's maximum attempts (for a panic, its
    /// [panic limit](Self::with_max_panic_attempts)) a retry that is not a wait becomes
    /// [`DeadLetterReason::AttemptsExhausted`].
    pub async fn handle(&self, delivery: Delivery) -> Outcome {
        let attempt = delivery.attempt();
        let span = tracing::debug_span!(
            "oncely",
            route = %self.name,
            key = tracing::field::Empty,
            attempt,
            outcome = tracing::field::Empty
        );
        let message_id = delivery.message_id().map(str::to_owned);
        let outcome = self.run(delivery).instrument(span.clone()).await;
        let outcome = match outcome {
            Outcome::RetryLater(retry)
                if self
                    .attempt_limit(retry.reason)
                    .is_some_and(|limit| attempt >= limit) =>
            {
                Outcome::dead_letter(
                    DeadLetterReason::AttemptsExhausted,
                    format!("gave up after {attempt} attempts; last: {retry}"),
                )
            }
            outcome => outcome,
        };
        span.record("outcome", tracing::field::display(&outcome));
        span.in_scope(|| tracing::debug!(?outcome, "settled"));
        if let Outcome::DeadLetter(dead) = &outcome {
            // At warn whatever the span's level: a dead letter needs someone to look at it.
            tracing::warn!(
                route = %self.name,
                attempt,
                message_id,
                reason = dead.reason.code(),
                detail = %dead.detail,
                "dead-lettered"
            );
        }
        crate::telemetry::count_outcome(&self.name, &outcome);
        outcome
    }

    /// The attempt at which a retry for `reason` becomes a dead letter instead; `None` for
    /// a wait, which never does.
    fn attempt_limit(&self, reason: RetryReason) -> Option<u32> {
        match reason {
            reason if reason.is_wait() => None,
            RetryReason::HandlerPanicked => Some(
                self.max_panic_attempts
                    .map_or(self.max_attempts, |panics| panics.min(self.max_attempts)),
            ),
            _ => Some(self.max_attempts),
        }
    }

    /// The delivery's outcome from the stack, before the attempt limit applies.
    async fn run(&self, delivery: Delivery) -> Outcome {
        let body_len = delivery.body().len();
        if body_len > self.max_body_len {
            let error = InputError::BodyTooLarge {
                len: body_len,
                max: self.max_body_len,
            };
            return Outcome::dead_letter(DeadLetterReason::Oversize, error.to_string());
        }
        let key = match self.key.extract(&delivery) {
            Ok(key) => key,
            Err(error) => return Outcome::dead_letter(DeadLetterReason::InvalidKey, error.to_string()),
        };
        tracing::Span::current().record("key", key.as_str());
        let fingerprint = match self.fingerprint.fingerprint(&delivery) {
            Ok(fingerprint) => fingerprint,
            Err(error) => {
                return Outcome::dead_letter(DeadLetterReason::InvalidKey, format!("fingerprint: {error}"));
            }
        };
        let envelope = Envelope::routed(self.name.clone(), key, fingerprint, delivery);
        match &self.delivery_limit {
            None => self.call_stack(envelope).await,
            Some(limit) => {
                let counted = envelope.key().clone();
                limit
                    .run(&counted, async || self.call_stack(envelope).await)
                    .await
            }
        }
    }

    /// The stack's answer for `envelope`, with its errors and panics turned into outcomes.
    async fn call_stack(&self, envelope: Envelope) -> Outcome {
        let failed = |error: S::Error| {
            let error: BoxError = error.into();
            Outcome::retry_later(RetryReason::HandlerFailed, error.to_string(), None)
        };
        let mut stack = self.stack.clone();
        // A panic unwinds out of the stack's future, dropping it: every tier's guards run
        // (the record's connection is discarded, the lock's watchdog stops and the lock
        // expires with its lease), and the
        // delivery is answered like any other failure instead of taking down the consumer
        // task with its unacked message.
        let answer = AssertUnwindSafe(async move {
            poll_fn(|cx| stack.poll_ready(cx)).await?;
            stack.call(envelope).await
        })
        .catch_unwind()
        .await;
        match answer {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(error)) => failed(error),
            Err(panic) => panicked(panic.as_ref()),
        }
    }
}

/// The answer to a stack (or a batch's handler) that panicked with `panic`: a retry, logged.
pub(crate) fn panicked(panic: &(dyn Any + Send)) -> Outcome {
    let message = panic_message(panic);
    tracing::error!(
        panic = message,
        "the stack panicked; the delivery will be retried, or dead-lettered at the route's limit"
    );
    Outcome::retry_later(RetryReason::HandlerPanicked, format!("panicked: {message}"), None)
}

/// The text a panic was raised with, when it has one.
fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}
