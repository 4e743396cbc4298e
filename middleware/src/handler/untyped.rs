//! The untyped handler: an `async fn(Envelope)`.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::task::{Context, Poll};

use tower_service::Service;

use super::{HandlerError, outcome_of};
use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::tier::BoxFuture;

/// Makes an `async fn(Envelope) -> Result<(), E>` the innermost service of a stack: the
/// untyped handler, which reads what it needs from the envelope itself (see
/// [`handler`](crate::handler()) for one that takes typed arguments).
///
/// `Ok(())` gives [`Outcome::Processed`]; an error gives what [`HandlerError::into_outcome`]
/// says. The function is called once per envelope that every tier in front let through.
///
/// A handler that panics does not take the consumer down: [`Route::handle`](crate::Route::handle)
/// catches the panic, the stack's future is dropped (the transactional record's transaction
/// rolls back with its connection, a lock's watchdog stops and the lock expires with its
/// lease), and the delivery is retried
/// ([`RetryReason::HandlerPanicked`](crate::RetryReason::HandlerPanicked)); at the route's
/// maximum attempts (or its [panic limit](crate::Route::with_max_panic_attempts)) it is
/// dead-lettered as `attempts_exhausted` with the panic's message. A
/// panic that kills the process every time is counted by the broker or a delivery counter
/// and dead-lettered as `delivery_limit`.
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
        Box::pin(async move { Ok(outcome_of(run.await)) })
    }
}
