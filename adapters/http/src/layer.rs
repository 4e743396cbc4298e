//! The layer: a request in, one of the stack's outcomes answered as HTTP.

use std::convert::Infallible;
use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName};
use http::request::Parts;
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use oncely::{
    BoxError, BoxFuture, BusinessKey, DEFAULT_MAX_BODY_LEN, DeadLetterReason, Delivery, Envelope,
    FingerprintPolicy, KeyExtractor, Outcome, RetryLater, RetryReason, Route, Source,
};
use tokio::task::AbortHandle;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

use crate::client::ClientScope;
use crate::handler::{Exchange, HttpHandler, Reply, RunSettings};
use crate::key::{DEFAULT_MAX_KEY_LEN, IDEMPOTENCY_KEY, Shown, read_key, scoped};
use crate::problem::Problem;
use crate::response::ResponseStore;
use crate::token::{TokenBook, TokenCheck, TokenField};

/// The largest stored response body unless configured otherwise: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_LEN: usize = 1024 * 1024;

/// The longest business key (the client's identity and its key) a request may make, in
/// bytes: what the record tables of both SQL stores index.
pub const MAX_SCOPED_KEY_LEN: usize = 1024;

/// How long the handler may run unless configured otherwise: 30 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stored response is kept unless configured otherwise: 24 hours, Stripe's
/// window.
pub const DEFAULT_EXPIRY: Duration = Duration::from_secs(24 * 3600);

/// Where a request's key comes from.
#[derive(Clone)]
enum KeySource {
    /// The `Idempotency-Key` header (or another), required or not.
    Header {
        name: HeaderName,
        required: bool,
        max_len: usize,
    },
    /// A field of the JSON body, such as a payment provider's transaction id.
    Body(KeyExtractor),
    /// A one-time token, checked in its book.
    Token {
        book: Arc<dyn TokenBook>,
        field: TokenField,
    },
}

/// What a request's key source found.
enum KeyFound {
    /// Run the request under this key.
    Run(String),
    /// The route's key is optional and the request has none: run it as it is.
    None,
    /// An expired token: run through the tiers, so that a submit in flight or done is
    /// answered as such, but refused where it would run.
    Expired(String),
}

/// Settings shared by the layer and every service it makes.
#[derive(Clone)]
struct Config {
    name: Arc<str>,
    key: KeySource,
    client: ClientScope,
    fingerprint: FingerprintPolicy,
    max_body_len: usize,
    settings: RunSettings,
}

/// Makes an HTTP endpoint idempotent with the same tiers as oncely's consumers, following
/// draft-ietf-httpapi-idempotency-key-header-07.
///
/// Per request: the `Idempotency-Key` header is read ([`Problem::KeyMissing`],
/// [`Problem::KeyMalformed`]) and scoped by the client ([`ClientScope`]),
/// the body read up to its limit ([`Problem::BodyTooLarge`]), and the request runs as one
/// delivery through `tiers` — e.g. the Redis flag in front of the transactional record —
/// with the user's service at the bottom ([`HttpHandler`]), on a task of its own. The
/// fingerprint covers the method, the path with its query and the body (or the fields
/// [`with_fingerprint`](Self::with_fingerprint) names). `GET`, `HEAD`, `OPTIONS` and `TRACE`
/// pass through without a key. Then, by the stack's outcome:
///
/// | outcome | answer |
/// |---|---|
/// | processed | the handler's response, stored (status, `Content-Type`, `Content-Encoding`, the [stored headers](Self::with_stored_headers), body) |
/// | duplicate | the stored response again, with `Idempotent-Replayed: true`; [`Problem::ResponseGone`] once it expired |
/// | the key in flight elsewhere | 409 [`Problem::KeyInFlight`] with `Retry-After` |
/// | another payload under the key | 422 [`Problem::KeyReused`] |
/// | a store that must decide is down | 503 [`Problem::StoreUnavailable`] with `Retry-After`; the retry's answer says whether it ran |
/// | the handler answered 5xx, 408, 425 or 429 | its response, not stored; nothing committed |
/// | the handler failed, panicked or [timed out](Self::with_timeout) | 500 [`Problem::HandlerFailed`]; nothing committed |
///
/// "Nothing committed" holds for what the handler writes in the record's transaction: with
/// [`PgResponses`](crate::PgResponses) behind `oncely::record::PgTransactionalLayer`, the
/// handler finds that transaction in its request's extensions (axum:
/// `Extension<PgTransaction>`), and the business write, the stored response and the record
/// commit together or not at all. Any other answer is the key's result: it is stored and
/// committed with whatever the handler wrote. A write the handler makes elsewhere is its
/// own to make idempotent.
///
/// The tiers must settle a key only when the stack answers processed, as oncely's do: a key
/// in flight is one whose handler has not answered yet.
///
/// Layers whose tiers share a record table (and a flag prefix) share one key space per
/// client: the same key sent to two endpoints is one key, answered 422 on the second unless
/// the fingerprint is off. Give endpoints that may see the same keys tables of their own.
///
/// With the flag in front, copies of a key in flight are answered 409 at once. Without it,
/// or while Redis is down (the flag fails open), they wait in the record for the first
/// one's transaction, each holding a pooled connection meanwhile: size the pool for the
/// copies a client may send at once, or keep the flag.
#[derive(Clone)]
pub struct IdempotencyLayer<T, R> {
    tiers: T,
    responses: R,
    config: Config,
}

impl<T, R> fmt::Debug for IdempotencyLayer<T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("name", &self.config.name)
            .finish_non_exhaustive()
    }
}

impl<T, R: ResponseStore> IdempotencyLayer<T, R> {
    /// Requests through `tiers` (a `tower::Layer` over [`HttpHandler`], such as a
    /// `ServiceBuilder` of oncely's tier layers), their responses kept in `responses`, their
    /// keys scoped by `clients`.
    ///
    /// Defaults: the `Idempotency-Key` header, required on every method but `GET`, `HEAD`,
    /// `OPTIONS` and `TRACE` (which pass through), at most [`DEFAULT_MAX_KEY_LEN`] bytes; the
    /// fingerprint over method, path with query, and whole body; bodies up to
    /// [`oncely::DEFAULT_MAX_BODY_LEN`]; stored responses up to
    /// [`DEFAULT_MAX_RESPONSE_LEN`], kept [`DEFAULT_EXPIRY`]; the handler cut off after
    /// [`DEFAULT_TIMEOUT`]; the route named `http` in metrics and logs.
    pub fn new(tiers: T, responses: R, clients: ClientScope) -> Self {
        IdempotencyLayer {
            tiers,
            responses,
            config: Config {
                name: Arc::from("http"),
                key: KeySource::Header {
                    name: IDEMPOTENCY_KEY,
                    required: true,
                    max_len: DEFAULT_MAX_KEY_LEN,
                },
                client: clients,
                fingerprint: FingerprintPolicy::whole_body(),
                max_body_len: DEFAULT_MAX_BODY_LEN,
                settings: RunSettings {
                    max_response_len: DEFAULT_MAX_RESPONSE_LEN,
                    stored_headers: Arc::from([CONTENT_TYPE]),
                    expiry: DEFAULT_EXPIRY,
                    timeout: Some(DEFAULT_TIMEOUT),
                    misconfigured: Arc::default(),
                },
            },
        }
    }

    /// Names the route in metrics and logs (default `http`).
    pub fn with_name(mut self, name: &str) -> Self {
        self.config.name = Arc::from(name);
        self
    }

    /// Lets requests without a key through, run on the handler as they are, without the
    /// tiers and without asking who sent them: for an endpoint whose clients may opt in. The
    /// body is still read whole first, up to [`with_max_body_len`](Self::with_max_body_len).
    /// A handler that takes the record's transaction then finds none.
    pub fn optional(mut self) -> Self {
        if let KeySource::Header { required, .. } = &mut self.config.key {
            *required = false;
        }
        self
    }

    /// Reads the key from `header` instead of `Idempotency-Key`, such as a payment
    /// provider's notification id header, with the same rules.
    pub fn with_key_header(mut self, header: HeaderName) -> Self {
        if let KeySource::Header { name, .. } = &mut self.config.key {
            *name = header;
        }
        self
    }

    /// Reads the key from the JSON body at `pointer` (RFC 6901, e.g. `/transaction_id`)
    /// instead of a header: for callers that cannot send a header, such as a payment
    /// provider whose notifications carry their transaction id. A body that is not JSON, or
    /// lacks the field, is refused ([`Problem::KeyMalformed`]); keys over
    /// [`DEFAULT_MAX_KEY_LEN`] bytes too.
    pub fn with_key_from_body(mut self, pointer: &str) -> Self {
        let keys = KeyExtractor::json_pointer(pointer).with_max_len(DEFAULT_MAX_KEY_LEN);
        self.config.key = KeySource::Body(keys);
        self
    }

    /// Sets the longest key accepted, in bytes (default [`DEFAULT_MAX_KEY_LEN`]).
    pub fn with_max_key_len(mut self, max: usize) -> Self {
        if let KeySource::Header { max_len, .. } = &mut self.config.key {
            *max_len = max;
        }
        self
    }

    /// Takes one-time tokens from `book` instead of an `Idempotency-Key`: each submit
    /// carries a token in `field`, issued to its client by a
    /// [`TokenIssuer`](crate::TokenIssuer), and runs once. A concurrent second submit is
    /// answered [`Problem::KeyInFlight`] (with the flag in front; behind the transactional
    /// record alone it waits for the first and gets its response), a later one the first's
    /// response; a token that is missing, unknown, another client's or expired is refused
    /// ([`Problem::TokenMissing`], [`Problem::TokenUnknown`], [`Problem::TokenExpired`]).
    pub fn with_one_time_tokens(mut self, book: impl TokenBook, field: TokenField) -> Self {
        self.config.key = KeySource::Token {
            book: Arc::new(book),
            field,
        };
        self
    }

    /// Fingerprints what `policy` selects of the body, besides method and path (default:
    /// the whole body): a client that resends an order with a new timestamp field is still
    /// the same request under `FingerprintPolicy::fields(["/orderId", "/amount"])`.
    pub fn with_fingerprint(mut self, policy: FingerprintPolicy) -> Self {
        self.config.fingerprint = policy;
        self
    }

    /// Sets the largest request body, in bytes (default [`oncely::DEFAULT_MAX_BODY_LEN`]);
    /// a larger one is refused with [`Problem::BodyTooLarge`] as soon as it is read past it.
    pub fn with_max_body_len(mut self, max: usize) -> Self {
        self.config.max_body_len = max;
        self
    }

    /// Sets the largest stored response body, in bytes (default
    /// [`DEFAULT_MAX_RESPONSE_LEN`]). A handler that answers more is answered
    /// [`Problem::ResponseTooLarge`] and its work rolled back: a response that cannot be
    /// stored could not be given to the retry.
    pub fn with_max_response_len(mut self, max: usize) -> Self {
        self.config.settings.max_response_len = max;
        self
    }

    /// Sets the response headers stored and answered again (default `Content-Type`), e.g.
    /// `Location`. Others (cookies, dates, tracing) are answered to the first request only.
    pub fn with_stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.settings.stored_headers = headers.into_iter().collect();
        self
    }

    /// Sets how long a stored response is answered again (default [`DEFAULT_EXPIRY`]). Once
    /// it expired, a retry is answered [`Problem::ResponseGone`] (the operation is not run
    /// again) until the key's record is purged (`PgResponses::purge_expired`), after
    /// which the key is new. Keep it longer than your clients retry, and the Redis flag's
    /// retry window no longer than it.
    pub fn with_expiry(mut self, expiry: Duration) -> Self {
        self.config.settings.expiry = expiry;
        self
    }

    /// Cuts the handler off after `limit` (default [`DEFAULT_TIMEOUT`]), counted from its
    /// call to the last byte of the response body it answers (a body that never ends is cut
    /// off like a call that never returns): its future and its body are
    /// dropped, its running statement cancelled (PostgreSQL), its transaction rolled back,
    /// the client answered [`Problem::HandlerFailed`] and the key released, so a retry runs
    /// it again. This is the way to bound a handler: a `tower` timeout in front of the
    /// layer only stops waiting, since a started run goes on to its end on its own task.
    pub fn with_timeout(mut self, limit: Duration) -> Self {
        self.config.settings.timeout = Some(limit);
        self
    }
}

impl<S, T, R> Layer<S> for IdempotencyLayer<T, R>
where
    S: Clone,
    T: Layer<HttpHandler<S, R>>,
    T::Service: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    <T::Service as Service<Envelope>>::Error: Into<BoxError>,
    <T::Service as Service<Envelope>>::Future: Send,
    R: ResponseStore,
{
    type Service = Idempotency<S, T::Service, R>;

    fn layer(&self, inner: S) -> Self::Service {
        let settings = Arc::new(self.config.settings.clone());
        let handler = HttpHandler::new(inner.clone(), self.responses.clone(), settings);
        // Keys are the client's scope and the client's key, checked against the limit when
        // the request is read; the route's own check is the backstop.
        let keys = KeyExtractor::message_id().with_max_len(MAX_SCOPED_KEY_LEN);
        let route = Route::new(self.config.name.clone(), keys, self.tiers.layer(handler))
            .with_fingerprint(self.config.fingerprint.clone())
            .with_max_body_len(self.config.max_body_len);
        Idempotency {
            inner,
            route,
            responses: self.responses.clone(),
            config: Arc::new(self.config.clone()),
        }
    }
}

/// The service [`IdempotencyLayer`] makes around the user's service `S`, with its tiers `St`.
pub struct Idempotency<S, St, R> {
    inner: S,
    route: Route<St>,
    responses: R,
    config: Arc<Config>,
}

impl<S: Clone, St: Clone, R: Clone> Clone for Idempotency<S, St, R> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            route: self.route.clone(),
            responses: self.responses.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S, St, R> fmt::Debug for Idempotency<S, St, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("route", &self.config.name)
            .finish_non_exhaustive()
    }
}

/// The body the layer answers with: the user's own (a request without a key, let through)
/// or a buffered one (the handler's read response, a stored one, a problem).
pub type IdempotentBody<B> = Either<B, Full<Bytes>>;

impl<S, St, R, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St, R>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    St: Service<Envelope, Response = Outcome, Error: Into<BoxError>, Future: Send>
        + Clone
        + Send
        + Sync
        + 'static,
    R: ResponseStore,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<IdempotentBody<ResBody>>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The route readies its stack per request, on its own clone.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            Ok(match this.answer(request).await {
                Ok(response) => response,
                Err(problem) => problem.to_response().map(Either::Right),
            })
        })
    }
}

impl<S, St, R, ResBody> Idempotency<S, St, R>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError> + Send,
    S::Future: Send,
    St: Service<Envelope, Response = Outcome, Error: Into<BoxError>, Future: Send>
        + Clone
        + Send
        + Sync
        + 'static,
    R: ResponseStore,
{
    /// The response to `request`: the handler's, a stored one, or the problem that stopped it.
    async fn answer<B>(self, request: Request<B>) -> Result<Response<IdempotentBody<ResBody>>, Problem>
    where
        B: Body + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let body = read_body(body, self.config.max_body_len).await?;
        if is_safe(&parts.method) {
            return self
                .let_through(Request::from_parts(parts, Full::new(body)))
                .await;
        }
        let client = self.config.client.of(&parts)?;
        let (key, refusal) = match self.find_key(&parts, &body, &client).await? {
            KeyFound::Run(key) => (key, None),
            KeyFound::None => {
                return self
                    .let_through(Request::from_parts(parts, Full::new(body)))
                    .await;
            }
            KeyFound::Expired(token) => (token, Some(Problem::TokenExpired)),
        };
        let key = scoped(&client, &key);
        if key.len() > MAX_SCOPED_KEY_LEN {
            return Err(Problem::key_malformed(format!(
                "the client's identity and the key together are over {MAX_SCOPED_KEY_LEN} bytes"
            )));
        }
        let target = parts.uri.path_and_query().map_or("/", |target| target.as_str());
        let context = format!("{} {target}", parts.method);
        let exchange = Exchange::new(parts, refusal);
        let delivery = Delivery::new(Source::new(&*self.config.name), body)
            .with_message_id(key.clone())
            .with_fingerprint_context(context)
            .with_extension(exchange.clone());
        let route = self.route.clone();
        // Run on a task of its own, so that a client that hangs up (which drops this
        // future) does not cut a started run off half-way: it commits or rolls back and
        // settles its tiers as if the client had waited, and the client's retry finds it
        // done. A run whose handler has not started yet (a copy waiting for the key's
        // first request in the record) is given up with its client, freeing its connection.
        let task = tokio::spawn(async move { route.handle(delivery).await }.in_current_span());
        let _give_up = GiveUpUnstarted {
            task: task.abort_handle(),
            exchange: exchange.clone(),
        };
        let outcome = task.await.unwrap_or_else(|failed| {
            let detail = format!("the request's task failed: {failed}");
            Outcome::retry_later(RetryReason::HandlerPanicked, detail, None)
        });
        self.settle(outcome, exchange.take_reply(), &BusinessKey::new(key))
            .await
    }

    /// The request's key, as the route's key source finds it.
    async fn find_key(&self, parts: &Parts, body: &Bytes, client: &str) -> Result<KeyFound, Problem> {
        match &self.config.key {
            KeySource::Header {
                name,
                required,
                max_len,
            } => match read_key(&parts.headers, name, *max_len)? {
                Some(key) => Ok(KeyFound::Run(key)),
                None if *required => Err(Problem::KeyMissing),
                None => Ok(KeyFound::None),
            },
            KeySource::Body(keys) => {
                let delivery = Delivery::new(Source::new(&*self.config.name), body.clone());
                let key = keys
                    .extract(&delivery)
                    .map_err(|error| Problem::key_malformed(error.to_string()))?;
                Ok(KeyFound::Run(key.as_str().to_owned()))
            }
            KeySource::Token { book, field } => {
                let token = field.read(&parts.headers, body)?;
                match book.check(token.clone(), client.to_owned()).await {
                    Ok(TokenCheck::Valid) => Ok(KeyFound::Run(token)),
                    Ok(TokenCheck::Expired) => Ok(KeyFound::Expired(token)),
                    Ok(TokenCheck::Unknown) => Err(Problem::TokenUnknown),
                    Err(error) => {
                        tracing::warn!(%error, "could not check a one-time token");
                        Err(unavailable(None))
                    }
                }
            }
        }
    }

    /// Runs a request without a key on the user's service, as it is.
    async fn let_through(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<IdempotentBody<ResBody>>, Problem> {
        let mut inner = self.inner.clone();
        let answered = async {
            poll_fn(|cx| inner.poll_ready(cx)).await?;
            inner.call(request).await
        };
        match answered.await {
            Ok(response) => Ok(response.map(Either::Left)),
            Err(error) => {
                tracing::warn!(error = %error.into(), "the HTTP handler failed on a request without a key");
                Err(Problem::HandlerFailed)
            }
        }
    }

    /// The answer for the stack's `outcome`, with what the handler's run left in `reply`.
    async fn settle(
        &self,
        outcome: Outcome,
        reply: Option<Reply>,
        key: &BusinessKey,
    ) -> Result<Response<IdempotentBody<ResBody>>, Problem> {
        match (outcome, reply) {
            (Outcome::Processed, Some(Reply::Completed(response))) => Ok(response.map(Either::Right)),
            (Outcome::Processed, _) => {
                tracing::error!(key = %Shown(key.as_str()), "processed without the handler's response: a tier answered for it");
                Err(Problem::HandlerFailed)
            }
            (Outcome::Duplicate { .. }, _) => self.replay(key).await,
            (Outcome::Stale { current, target }, _) => Err(Problem::Stale { current, target }),
            (Outcome::RetryLater(_), Some(Reply::Retryable(response))) => Ok(response.map(Either::Right)),
            (Outcome::RetryLater(_), Some(Reply::Problem(problem))) => Err(problem),
            (Outcome::RetryLater(retry), _) => Err(retry_problem(key, &retry)),
            (Outcome::DeadLetter(dead), _) => Err(match dead.reason {
                DeadLetterReason::PayloadMismatch => Problem::KeyReused,
                DeadLetterReason::Oversize => Problem::BodyTooLarge {
                    max: self.config.max_body_len,
                },
                // The key itself was checked when it was read: what the route could not
                // read is what the fingerprint selects of the body.
                DeadLetterReason::InvalidKey => Problem::BodyInvalid { reason: dead.detail },
                _ => {
                    tracing::warn!(key = %Shown(key.as_str()), %dead, "the stack refused the request");
                    Problem::HandlerFailed
                }
            }),
        }
    }

    /// The key's stored response, answered again.
    async fn replay(&self, key: &BusinessKey) -> Result<Response<IdempotentBody<ResBody>>, Problem> {
        match self.responses.load(key).await {
            Ok(Some(stored)) => Ok(stored.replay().map(Either::Right)),
            Ok(None) => Err(Problem::ResponseGone),
            Err(error) => {
                tracing::warn!(key = %Shown(key.as_str()), %error, "could not read the stored response");
                Err(unavailable(None))
            }
        }
    }
}

/// The problem a retry is answered with; failures are logged, since the client is told
/// nothing of their cause.
fn retry_problem(key: &BusinessKey, retry: &RetryLater) -> Problem {
    match retry.reason {
        RetryReason::InFlight(_) | RetryReason::LockBusy => Problem::KeyInFlight {
            retry_after: retry.delay.unwrap_or(Duration::from_secs(1)),
        },
        RetryReason::HandlerFailed | RetryReason::HandlerPanicked => {
            tracing::warn!(key = %Shown(key.as_str()), %retry, "the request failed; nothing was committed");
            Problem::HandlerFailed
        }
        _ => {
            tracing::warn!(key = %Shown(key.as_str()), %retry, "a store failed; nothing was committed");
            unavailable(retry.delay)
        }
    }
}

/// Aborts a request's task when the request is dropped (its client hung up) before its
/// handler started. Once the task ended, aborting it does nothing.
struct GiveUpUnstarted {
    task: AbortHandle,
    exchange: Arc<Exchange>,
}

impl Drop for GiveUpUnstarted {
    fn drop(&mut self) {
        // Given up first, so that a run about to start finds it so and runs nothing: the
        // batched record then takes it out of its batch rather than roll the batch back.
        if self.exchange.abandon() {
            self.task.abort();
        }
    }
}

/// True for the methods draft-07 leaves alone: safe, hence idempotent without a key.
fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// 503 with `Retry-After`: `delay`, or one second.
fn unavailable(delay: Option<Duration>) -> Problem {
    Problem::StoreUnavailable {
        retry_after: delay.unwrap_or(Duration::from_secs(1)),
    }
}

/// The whole body, refused once it grows past `max`.
async fn read_body<B>(body: B, max: usize) -> Result<Bytes, Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(Problem::BodyTooLarge { max }),
        Err(error) => {
            tracing::debug!(%error, "the request body could not be read");
            Err(Problem::BodyUnreadable)
        }
    }
}
