//! Which services may run inside the transactional record's open transaction.

use std::fmt;
use std::task::{Context, Poll};

use tower_service::Service;

/// A service that may run inside the transactional record's open transaction: it remembers
/// nothing outside that transaction before it commits.
///
/// A flag, a state guard, a three-step record or a second transactional record *inside* the
/// transactional record would write "done" (or the new state) on its own connection or
/// server before the record's `COMMIT`; if that commit then fails, the delivery's retry is
/// answered as a duplicate (or stale) and the effect is lost. A lock inside it would be
/// released before the `COMMIT`, so the entity's next holder could read what was there
/// before it, and its fencing token would not reach the record's claim. So
/// `PgTransactionalLayer` (feature `postgres`) only wraps services that
/// implement this trait, and such an order does not compile.
///
/// Implemented for the handlers ([`HandlerFn`](crate::HandlerFn),
/// [`TypedHandler`](crate::handler::TypedHandler)), the pre-filter tier and
/// tower's `Timeout`. Wrap any other
/// service you have checked (a `tower::service_fn`, a boxed service) in
/// [`AssertTransactionSafe`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` may not run inside the transactional record's transaction",
    label = "the transactional record wraps this service",
    note = "a flag or state guard inside the transactional record marks done before COMMIT, so a failed commit would lose the message, and a lock there is released before COMMIT: put them in front of PgTransactionalLayer",
    note = "for a service of your own that writes nothing outside the transaction, wrap it in `oncely::record::AssertTransactionSafe`"
)]
pub trait TransactionSafe {}

impl<F> TransactionSafe for crate::HandlerFn<F> {}
impl<F, Context, Args> TransactionSafe for crate::handler::TypedHandler<F, Context, Args> {}
#[cfg(feature = "prefilter")]
// Every tier is a `TierService`; only the pre-filter's (which writes nothing) is safe. A
// blanket impl over all decisions would let the flag, lock, state guard and records in.
impl<S: TransactionSafe, F> TransactionSafe
    for crate::tier::TierService<S, crate::prefilter::PreFilterLayer<F>>
{
}
impl<S: TransactionSafe> TransactionSafe for tower::timeout::Timeout<S> {}
impl<S> TransactionSafe for AssertTransactionSafe<S> {}

/// Declares `S` safe to run inside the transactional record's transaction: you checked that
/// it writes nothing outside it before the commit (see [`TransactionSafe`]). Passes every
/// call through unchanged.
#[derive(Clone)]
pub struct AssertTransactionSafe<S>(pub S);

impl<S> fmt::Debug for AssertTransactionSafe<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AssertTransactionSafe")
    }
}

impl<S: Service<R>, R> Service<R> for AssertTransactionSafe<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.0.call(request)
    }
}
