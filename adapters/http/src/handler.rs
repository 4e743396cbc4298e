//! The bottom of the stack: the user's HTTP service, run as an oncely handler.

use std::any::Any;
use std::convert::Infallible;
use std::fmt;
use std::future::poll_fn;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::request::Parts;
use http::{HeaderName, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use oncely::record::TransactionSafe;
use oncely::{BoxError, BoxFuture, Envelope, Outcome, RetryReason, Tier};
use tower_service::Service;

use crate::key::Shown;
use crate::problem::Problem;
use crate::response::{ResponseStore, SaveFailure, StoredResponse};

/// What the layer and the bottom of its stack hand each other for one request: the request's
/// parts on the way in, the answer on the way out. The stack itself only answers an
/// [`Outcome`].
#[derive(Debug)]
pub(crate) struct Exchange {
    /// The request's head, cloned for each run: the batched record runs a request's
    /// handler again, on its own, when the batch it ran in rolled back.
    parts: Parts,
    /// Set when the request may be answered by the tiers (in flight, done) but must not
    /// run: an expired one-time token.
    refusal: Option<Problem>,
    /// Where the run is: [`WAITING`] for its turn, [`STARTED`] (from then on it goes on to
    /// its end, even if the client hangs up), or [`ABANDONED`] by a client that hung up
    /// before it started. Moved from `WAITING` once, by whichever comes first.
    state: AtomicU8,
    reply: Mutex<Option<Reply>>,
}

/// What the handler's run left for the layer to answer.
#[derive(Debug)]
pub(crate) enum Reply {
    /// The handler's response, stored; answered only if the stack then answers processed
    /// (its transaction committed).
    Completed(Response<Full<Bytes>>),
    /// The handler's own answer that the client may retry (5xx, 408, 425, 429), passed on
    /// as it is: not stored, nothing committed.
    Retryable(Response<Full<Bytes>>),
    /// The run failed in a way the client is told with this problem.
    Problem(Problem),
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The run waits for its turn (in the tiers: a batch, a row lock).
const WAITING: u8 = 0;
/// The run has started: it goes on to its end.
const STARTED: u8 = 1;
/// The client hung up before the run started: it never will.
const ABANDONED: u8 = 2;

impl Exchange {
    pub(crate) fn new(parts: Parts, refusal: Option<Problem>) -> Arc<Self> {
        Arc::new(Exchange {
            parts,
            refusal,
            state: AtomicU8::new(WAITING),
            reply: Mutex::new(None),
        })
    }

    /// Gives the run up, for a client that hung up: true if it had not started (and now
    /// never will), false if it had.
    pub(crate) fn abandon(&self) -> bool {
        let abandoned = self
            .state
            .compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire);
        abandoned.is_ok() || abandoned == Err(ABANDONED)
    }

    /// Starts the run: false if its client gave it up first.
    fn start(&self) -> bool {
        let started = self
            .state
            .compare_exchange(WAITING, STARTED, Ordering::AcqRel, Ordering::Acquire);
        started != Err(ABANDONED)
    }

    pub(crate) fn take_reply(&self) -> Option<Reply> {
        locked(&self.reply).take()
    }

    fn answer(&self, reply: Reply) {
        *locked(&self.reply) = Some(reply);
    }
}

/// How the bottom of the stack treats the handler's run; the layer's settings.
#[derive(Clone, Debug)]
pub(crate) struct RunSettings {
    pub(crate) max_response_len: usize,
    pub(crate) stored_headers: Arc<[HeaderName]>,
    pub(crate) expiry: Duration,
    pub(crate) timeout: Option<Duration>,
    /// Set once a misconfiguration was logged at error level.
    pub(crate) misconfigured: Arc<AtomicBool>,
}

/// The user's HTTP service at the bottom of an [`IdempotencyLayer`](crate::IdempotencyLayer)'s
/// tiers: the tiers' layers wrap this service.
///
/// Per request it runs the service on the request (with the record's open transaction in
/// the request's extensions, where the store lends it), catching a panic and cutting the run
/// off at the layer's timeout. Then:
/// - any other response is stored (in the record's transaction, with PostgreSQL) and
///   answers [`Outcome::Processed`], so the tiers in front commit and mark the key done;
/// - a response the client may retry (5xx, 408, 425, 429), an error, a panic, a timeout,
///   or a response larger than the stored maximum answers [`Outcome::RetryLater`], so the
///   tiers roll back and release the key: nothing was committed, and the client's retry
///   with the same key runs the handler again.
///
/// It writes nothing outside the record's transaction, so it may stand behind the
/// transactional record ([`TransactionSafe`]).
pub struct HttpHandler<S, R> {
    inner: S,
    responses: R,
    settings: Arc<RunSettings>,
}

impl<S: Clone, R: Clone> Clone for HttpHandler<S, R> {
    fn clone(&self) -> Self {
        HttpHandler {
            inner: self.inner.clone(),
            responses: self.responses.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S, R> fmt::Debug for HttpHandler<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpHandler")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<S, R> TransactionSafe for HttpHandler<S, R> {}

impl<S, R> HttpHandler<S, R> {
    pub(crate) fn new(inner: S, responses: R, settings: Arc<RunSettings>) -> Self {
        HttpHandler {
            inner,
            responses,
            settings,
        }
    }
}

impl<S, R, ResBody> Service<Envelope> for HttpHandler<S, R>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    R: ResponseStore,
{
    type Response = Outcome;
    type Error = Infallible;
    type Future = BoxFuture<Result<Outcome, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The user's service is readied in `call`, on its own clone.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.run(envelope).await) })
    }
}

impl<S, R, ResBody> HttpHandler<S, R>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    R: ResponseStore,
{
    /// Runs the user's service on the envelope's request and leaves the answer in its
    /// exchange; the outcome tells the tiers in front whether to commit.
    async fn run(self, envelope: Envelope) -> Outcome {
        let Some(exchange) = envelope.extensions().get::<Arc<Exchange>>().cloned() else {
            let detail = "no request: the HTTP handler runs only under IdempotencyLayer";
            return Outcome::retry_later(RetryReason::HandlerFailed, detail, None);
        };
        // First, before anything can wait: a client that hung up before this moment gave
        // the run up, and nothing runs (the batched record takes it out of its batch); one
        // that hangs up after it no longer stops the run.
        if !exchange.start() {
            return Outcome::retry_later(
                RetryReason::NotRun,
                "the client hung up before the handler started",
                None,
            );
        }
        // Refused where it would run (an expired token): nothing runs, and a batch it shares
        // commits without it.
        if let Some(refusal) = &exchange.refusal {
            exchange.answer(Reply::Problem(refusal.clone()));
            let detail = format!("refused before it ran: {}", refusal.detail());
            return Outcome::retry_later(RetryReason::NotRun, detail, None);
        }
        if let Err(failure) = self.responses.ready(&envelope).await {
            let failed = self.settings.save_failed(&envelope, failure);
            exchange.answer(Reply::Problem(failed.problem));
            return failed.outcome;
        }
        let mut parts = exchange.parts.clone();
        self.responses.lend(&envelope, &mut parts.extensions);
        let request = Request::from_parts(parts, Full::new(envelope.delivery().body().clone()));
        let (reply, outcome) = match self.respond(&envelope, request).await {
            Err(failed) => (Reply::Problem(failed.problem), failed.outcome),
            Ok(response) if may_retry(response.status()) => {
                let detail = format!("the handler answered {}", response.status());
                let outcome = Outcome::retry_later(RetryReason::HandlerFailed, detail, None);
                (Reply::Retryable(response), outcome)
            }
            Ok(response) => match self.store(&envelope, &response).await {
                Ok(()) => (Reply::Completed(response), Outcome::Processed),
                Err(failed) => (Reply::Problem(failed.problem), failed.outcome),
            },
        };
        exchange.answer(reply);
        outcome
    }

    /// The user's response, read whole; a failed, panicked or timed-out run, or a response
    /// over the stored maximum, as the outcome that rolls the tiers back.
    ///
    /// The timeout bounds the whole exchange — the call and the reading of the body it
    /// answers — since a body that never ends holds the record's transaction (its row lock
    /// and its pooled connection) as surely as a call that never returns.
    async fn respond(
        &self,
        envelope: &Envelope,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Full<Bytes>>, Failed> {
        let exchange = AssertUnwindSafe(self.exchange(request)).catch_unwind();
        let answered = match self.settings.timeout {
            None => exchange.await,
            Some(limit) => match tokio::time::timeout(limit, exchange).await {
                Ok(answered) => answered,
                Err(_) => {
                    // Dropping the run does not stop a statement it already sent, which
                    // would hold the transaction's rollback behind it (a lock wait, say).
                    self.responses.interrupt(envelope).await;
                    let detail = format!("the handler did not answer, body included, within {limit:?}");
                    return Err(Failed::handler_detail(detail));
                }
            },
        };
        answered.unwrap_or_else(|panic| Err(Failed::handler(panicked(panic.as_ref()))))
    }

    /// Calls the user's service on `request` and reads its response's body whole, up to the
    /// stored maximum.
    async fn exchange(&self, request: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Failed> {
        let mut inner = self.inner.clone();
        let called = async move {
            poll_fn(|cx| inner.poll_ready(cx)).await?;
            inner.call(request).await
        };
        let response = called
            .await
            .map_err(|error| Failed::handler_detail(format!("the handler failed: {}", error.into())))?;
        let (parts, body) = response.into_parts();
        let max = self.settings.max_response_len;
        match Limited::new(body, max).collect().await {
            Ok(collected) => Ok(Response::from_parts(parts, Full::new(collected.to_bytes()))),
            Err(error) if error.is::<LengthLimitError>() => Err(Failed {
                outcome: Outcome::retry_later(
                    RetryReason::HandlerFailed,
                    format!("the response is larger than the stored maximum of {max} bytes"),
                    None,
                ),
                problem: Problem::ResponseTooLarge { max },
            }),
            Err(error) => Err(Failed::handler_detail(format!(
                "the handler's response body failed: {error}"
            ))),
        }
    }

    /// Stores `response` as the key's answer.
    async fn store(&self, envelope: &Envelope, response: &Response<Full<Bytes>>) -> Result<(), Failed> {
        let body = response.body().clone().collect().await;
        let body = body
            .map(|collected| collected.to_bytes())
            .unwrap_or_else(|never| match never {});
        let stored = StoredResponse::keep(
            response.status(),
            response.headers(),
            &self.settings.stored_headers,
            body,
        );
        let saved = self.responses.save(envelope, &stored, self.settings.expiry).await;
        saved.map_err(|failure| self.settings.save_failed(envelope, failure))
    }
}

impl RunSettings {
    /// The answer when `envelope`'s response cannot be stored: nothing is committed either
    /// way. A misconfiguration is logged at error level the first time, then at debug: it
    /// is the same news on every request until the server is fixed.
    fn save_failed(&self, envelope: &Envelope, failure: SaveFailure) -> Failed {
        let key = Shown(envelope.key().as_str());
        match failure {
            SaveFailure::Misconfigured(error) => {
                if !self.misconfigured.swap(true, Ordering::Relaxed) {
                    tracing::error!(%error, "this endpoint cannot store responses: nothing runs until it is fixed");
                } else {
                    tracing::debug!(%key, %error, "refused: the endpoint is misconfigured");
                }
                Failed {
                    outcome: Outcome::retry_later(RetryReason::HandlerFailed, error.to_string(), None),
                    problem: Problem::Misconfigured,
                }
            }
            SaveFailure::HandlerAborted(_) => {
                tracing::warn!(%key, %failure, "could not store the response; rolling back");
                Failed::handler_detail(failure.to_string())
            }
            SaveFailure::Store(error) => {
                tracing::warn!(%key, %error, "could not store the response; rolling back");
                Failed {
                    outcome: Outcome::retry_later(
                        RetryReason::StoreUnavailable(Tier::Record),
                        error.to_string(),
                        None,
                    ),
                    problem: Problem::StoreUnavailable {
                        retry_after: Duration::from_secs(1),
                    },
                }
            }
        }
    }
}

/// True for a response the client may retry, which is therefore not the key's result: a
/// server error, or 408 (timeout), 425 (too early), 429 (too many requests).
fn may_retry(status: StatusCode) -> bool {
    status.is_server_error()
        || matches!(
            status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_EARLY | StatusCode::TOO_MANY_REQUESTS
        )
}

/// A run that committed nothing: the outcome the tiers settle by, the problem the client is
/// answered with.
struct Failed {
    outcome: Outcome,
    problem: Problem,
}

impl Failed {
    /// The handler failed: a retry runs it again.
    fn handler(outcome: Outcome) -> Self {
        Failed {
            outcome,
            problem: Problem::HandlerFailed,
        }
    }

    fn handler_detail(detail: String) -> Self {
        Failed::handler(Outcome::retry_later(RetryReason::HandlerFailed, detail, None))
    }
}

/// The outcome of a handler that panicked with `panic`, logged.
fn panicked(panic: &(dyn Any + Send)) -> Outcome {
    let message = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    tracing::error!(panic = message, "the HTTP handler panicked; nothing is committed");
    Outcome::retry_later(RetryReason::HandlerPanicked, format!("panicked: {message}"), None)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use oncely::{BusinessKey, Delivery, Source};

    use super::*;
    use crate::MemoryResponses;

    /// The batched record runs a request's handler again, on its own, when the batch it ran
    /// in rolled back: the second run must get the request too.
    #[tokio::test]
    async fn a_request_runs_again_after_its_batch_rolled_back() {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let service = tower::service_fn(move |_: Request<Full<Bytes>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done")))) }
        });
        let settings = RunSettings {
            max_response_len: 1024,
            stored_headers: Arc::from([]),
            expiry: Duration::from_secs(60),
            timeout: None,
            misconfigured: Arc::default(),
        };
        let mut handler = HttpHandler::new(service, MemoryResponses::new(), Arc::new(settings));
        let (parts, ()) = Request::new(()).into_parts();
        let exchange = Exchange::new(parts, None);
        let delivery = Delivery::new(Source::new("http"), "{}").with_extension(exchange.clone());
        let envelope = Envelope::new(BusinessKey::new("k"), delivery);
        for run in 1..=2 {
            let outcome = handler
                .call(envelope.clone())
                .await
                .unwrap_or_else(|never| match never {});
            assert_eq!(outcome, Outcome::Processed, "run {run}");
            assert!(
                matches!(exchange.take_reply(), Some(Reply::Completed(_))),
                "run {run}"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }
}
