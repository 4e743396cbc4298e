//! The typed handler: an `async fn` whose arguments are taken from the envelope.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::task::{self, Poll};

use futures_util::FutureExt;
use futures_util::future::Map;
use tower_service::Service;

use super::extract::{Argument, Plain};
use super::{HandlerError, outcome_of};
use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::tier::BoxFuture;

/// An `async fn` (or closure) a typed handler runs: implemented for functions of up to six
/// arguments, each an [`Argument`] of the handler's `Context`, returning
/// `Result<(), E>` with `E: Into<HandlerError>`.
///
/// The arguments are taken from the envelope before the function is called; if one cannot
/// be (a [`Json`](crate::Json) body that does not deserialise), the function is not called
/// and the delivery gets that argument's outcome.
pub trait Handler<Context, Args>: Clone + Send + Sync + 'static {
    /// Takes the arguments from `envelope` and runs the function.
    fn call(&self, envelope: Envelope) -> BoxFuture<Outcome>;
}

macro_rules! handler_with_arguments {
    ($($argument:ident),*) => {
        impl<F, Fut, E, Context, $($argument,)*> Handler<Context, ($($argument,)*)> for F
        where
            F: Fn($($argument),*) -> Fut + Clone + Send + Sync + 'static,
            Fut: Future<Output = Result<(), E>> + Send + 'static,
            E: Into<HandlerError>,
            $($argument: Argument<Context>,)*
        {
            #[allow(non_snake_case)]
            fn call(&self, envelope: Envelope) -> BoxFuture<Outcome> {
                $(
                    let $argument = match <$argument as Argument<Context>>::take(&envelope) {
                        Ok(argument) => argument,
                        Err(outcome) => return Box::pin(std::future::ready(outcome)),
                    };
                )*
                drop(envelope);
                let run = self($($argument),*);
                Box::pin(async move { outcome_of(run.await) })
            }
        }
    };
}

handler_with_arguments!();
handler_with_arguments!(A1);
handler_with_arguments!(A1, A2);
handler_with_arguments!(A1, A2, A3);
handler_with_arguments!(A1, A2, A3, A4);
handler_with_arguments!(A1, A2, A3, A4, A5);
handler_with_arguments!(A1, A2, A3, A4, A5, A6);

/// Makes an `async fn` with typed arguments the innermost service of a stack.
///
/// Each argument is taken from the envelope ([`FromEnvelope`](crate::handler::FromEnvelope)):
/// [`Json<T>`](crate::Json) for the deserialised body, [`BusinessKey`](crate::BusinessKey),
/// [`Delivery`](crate::Delivery). A body that does not deserialise is dead-lettered as
/// `bad_body` without calling the function. `Ok(())` gives [`Outcome::Processed`]; an error
/// is classified by what it is ([`Classify`](crate::Classify)). Panics are handled as for
/// [`handler_fn`](crate::handler_fn).
///
/// A handler that writes its effect in the transactional record's transaction is built by
/// `PgTransactionalLayer::handler` instead (feature `postgres`), which can also pass it the
/// transaction; taking `PgTransaction` here does not compile:
///
/// ```compile_fail
/// use oncely::record::PgTransaction;
/// async fn credit(tx: PgTransaction) -> Result<(), oncely::HandlerError> { Ok(()) }
/// let service = oncely::handler(credit);
/// ```
pub fn handler<F, Args>(f: F) -> TypedHandler<F, Plain, Args>
where
    F: Handler<Plain, Args>,
{
    typed(f)
}

/// A typed handler in `Context`, for the transactional record to build.
pub(crate) fn typed<F, Context, Args>(f: F) -> TypedHandler<F, Context, Args>
where
    F: Handler<Context, Args>,
{
    TypedHandler {
        f,
        context: PhantomData,
    }
}

/// The service made by [`handler`] (or `PgTransactionalLayer::handler`).
pub struct TypedHandler<F, Context, Args> {
    f: F,
    context: PhantomData<fn() -> (Context, Args)>,
}

impl<F: Clone, Context, Args> Clone for TypedHandler<F, Context, Args> {
    fn clone(&self) -> Self {
        TypedHandler {
            f: self.f.clone(),
            context: PhantomData,
        }
    }
}

impl<F, Context, Args> fmt::Debug for TypedHandler<F, Context, Args> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TypedHandler")
    }
}

impl<F, Context, Args> Service<Envelope> for TypedHandler<F, Context, Args>
where
    F: Handler<Context, Args>,
{
    type Response = Outcome;
    type Error = Infallible;
    type Future = Map<BoxFuture<Outcome>, fn(Outcome) -> Result<Outcome, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut task::Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        self.f.call(envelope).map(Ok)
    }
}
