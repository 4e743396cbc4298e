//! The user's handler as the innermost service of a stack.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::task::{Context, Poll};
use std::time::Duration;

use tower_service::Service;

use crate::dead_letter::DeadLetterReason;
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::outcome::{Outcome, RetryReason};
use crate::tier::BoxFuture;

/// A handler's failure: transient (retry later, the default) or permanent (dead-letter).
///
/// Any `std::error::Error` converts into a transient `HandlerError` with `?`. Use
/// [`HandlerError::permanent`] for a delivery that can never succeed (e.g. an order id that
/// does not exist), so it is dead-lettered at once instead of retried until attempts run out.
pub struct HandlerError {
    source: BoxError,
    permanent: bool,
    retry_after: Option<Duration>,
}

impl HandlerError {
    /// A failure that may pass if the delivery is tried again (database busy, timeout).
    pub fn transient(source: impl Into<BoxError>) -> Self {
        HandlerError {
            source: source.into(),
            permanent: false,
            retry_after: None,
        }
    }

    /// A failure that will happen again on every retry: the delivery is dead-lettered.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        HandlerError {
            permanent: true,
            ..HandlerError::transient(source)
        }
    }

    /// Suggests how long to wait before the retry (ignored for permanent failures).
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// True for a permanent failure.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The outcome this failure gives: [`Outcome::RetryLater`] or [`Outcome::DeadLetter`].
    pub fn into_outcome(self) -> Outcome {
        if self.permanent {
            Outcome::dead_letter(DeadLetterReason::Rejected, self.source.to_string())
        } else {
            Outcome::retry_later(
                RetryReason::HandlerFailed,
                self.source.to_string(),
                self.retry_after,
            )
        }
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(source: E) -> Self {
        HandlerError::transient(source)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("source", &self.source)
            .field("permanent", &self.permanent)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.permanent { "permanent" } else { "transient" };
        write!(f, "{kind} handler failure: {}", self.source)
    }
}

/// Makes an `async fn(Envelope) -> Result<(), E>` the innermost service of a stack.
///
/// `Ok(())` gives [`Outcome::Processed`]; an error gives what [`HandlerError::into_outcome`]
/// says. The function is called once per envelope that every tier in front let through.
///
/// A handler that panics does not take the consumer down: [`Route::handle`](crate::Route::handle)
/// catches the panic, the stack's future is dropped (the transactional record's transaction
/// rolls back with its connection, a lock's watchdog stops), and the delivery is retried
/// ([`RetryReason::HandlerPanicked`]); at the route's maximum attempts it is dead-lettered as
/// `attempts_exhausted` with the panic's message. A panic that kills the process every
/// time is counted by the broker or a delivery counter and dead-lettered as
/// `delivery_limit`.
pub fn handler_fn<F>(f: F) -> HandlerFn<F> {
    HandlerFn { f }
}

/// The service made by [`handler_fn`].
#[derive(Clone)]
pub struct HandlerFn<F> {
    f: F,
}

impl<F> fmt::Debug for HandlerFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandlerFn")
    }
}

impl<F, Fut, E> Service<Envelope> for HandlerFn<F>
where
    F: FnMut(Envelope) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<HandlerError>,
{
    type Response = Outcome;
    type Error = Infallible;
    type Future = BoxFuture<Result<Outcome, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let run = (self.f)(envelope);
        Box::pin(async move {
            Ok(match run.await {
                Ok(()) => Outcome::Processed,
                Err(error) => error.into().into_outcome(),
            })
        })
    }
}
