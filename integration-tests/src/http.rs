//! HTTP for the tests and the bench: a shop's order endpoint on axum behind oncely-http's
//! layer (the Redis flag in front of the transactional record), served on loopback, and what
//! it wrote.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::header::{CONTENT_TYPE, LOCATION};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use deadpool_postgres::Pool;
use oncely::FingerprintPolicy;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely_http::{ClientScope, IdempotencyLayer, PgResponses, PgTokens, TokenField, TokenIssuer};
use tokio::task::JoinHandle;
use tower::ServiceBuilder;

use crate::postgres::{ScratchSchema, schema_pool};

/// The header the shop's clients name their tenant in.
pub const TENANT: &str = "x-tenant";

/// Faults the order handler injects into its next runs, each after writing its effect, so a
/// test sees whether that write was rolled back.
#[derive(Debug, Default)]
pub struct Faults {
    /// Runs that panic.
    pub panics: AtomicU32,
    /// Counts runs down; the run that takes it from 1 to 0 panics: a failure in the middle
    /// of a batch, after others ran in it.
    pub panic_at_run: AtomicU32,
    /// Runs whose statement sleeps past the layer's timeout (`pg_sleep`), holding their
    /// transaction's rollback behind it unless the layer cancels it.
    pub stalls: AtomicU32,
    /// Runs that take a while ([`SLOW_RUN`]) but finish.
    pub slow: AtomicU32,
    /// Runs that answer 503.
    pub unavailable: AtomicU32,
    /// Runs that answer 429.
    pub throttled: AtomicU32,
    /// Runs that ignore a failed statement (which aborts their transaction) and answer 201.
    pub swallowed: AtomicU32,
    /// Runs that answer 201 with a body that never ends.
    pub endless_bodies: AtomicU32,
    /// How long each run takes, in milliseconds, inside its transaction (0: no time).
    pub pace_ms: AtomicU32,
    /// The body of every run, in the order they ran: runs rolled back included.
    pub runs: std::sync::Mutex<Vec<String>>,
    /// Runs that cut a statement of theirs off after 50 ms (a timeout inside the handler),
    /// ignore it and answer 201. On MySQL the statement may still run: the run must fail.
    pub cut_off: AtomicU32,
}

/// How long a cut-off statement sleeps on the server (it is cut off after 50 ms).
pub const CUT_OFF_SLEEP: Duration = Duration::from_millis(500);

/// How long a slow run takes.
pub const SLOW_RUN: Duration = Duration::from_millis(700);

impl Faults {
    /// True, once per count left in `fault`.
    pub(crate) fn take(fault: &AtomicU32) -> bool {
        fault
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
            .is_ok()
    }

    /// Notes a run of the request whose body is `body`.
    pub(crate) fn ran(&self, body: &str) {
        self.runs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(body.to_owned());
    }

    /// How many times the request whose body is `body` ran.
    pub fn runs_of(&self, body: &str) -> usize {
        let runs = self.runs.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        runs.iter().filter(|run| *run == body).count()
    }

    /// True for the run that takes `countdown` from 1 to 0.
    fn reached(countdown: &AtomicU32) -> bool {
        countdown.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1)) == Ok(1)
    }
}

/// The shop: its schema (the record, stored responses, tokens and `effects`), a pool on it,
/// and the faults its handler injects.
pub struct Shop {
    /// The scratch schema, dropped with the shop.
    pub schema: ScratchSchema,
    /// A pool searching the schema first.
    pub pool: Pool,
    /// The handler's faults.
    pub faults: Arc<Faults>,
    /// The Redis flag's key prefix, the shop's own.
    pub prefix: String,
}

/// How long the handler may run before the layer cuts it off.
pub const HANDLER_TIMEOUT: Duration = Duration::from_millis(1500);

/// How long the shop's stored responses are answered again: 72 h, as the payment-callback
/// example keeps them.
pub const RESPONSE_EXPIRY: Duration = Duration::from_secs(72 * 3600);

/// The largest request body the shop accepts.
pub const MAX_BODY: usize = 64 * 1024;

impl Shop {
    /// A shop in a schema of its own, with its tables migrated.
    pub async fn new(pool_size: usize) -> Self {
        let schema = ScratchSchema::new(&crate::postgres::pool(2)).await;
        let pool = schema_pool(schema.name(), pool_size);
        schema
            .execute(
                "CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, path TEXT NOT NULL, body TEXT NOT NULL)",
            )
            .await;
        let shop = Shop {
            schema,
            pool,
            faults: Arc::default(),
            prefix: oncely::testing::unique("oncely-http-test"),
        };
        shop.responses().migrate().await.expect("migrate the responses");
        shop.tokens().migrate().await.expect("migrate the tokens");
        shop
    }

    /// The stored responses beside the record table.
    pub fn responses(&self) -> PgResponses {
        PgResponses::new(self.pool.clone(), &self.schema.records()).expect("a responses table name")
    }

    /// The one-time tokens.
    pub fn tokens(&self) -> PgTokens {
        PgTokens::new(self.pool.clone(), self.schema.table("form_tokens"))
    }

    /// The shop's app with its record on `pool` (this shop's, or one that fails) and its flag
    /// on the Redis at `redis_url`: `POST /orders` and `POST /refunds` under an
    /// `Idempotency-Key` scoped by tenant, `POST /forms/orders` under one-time tokens issued
    /// by `POST /tokens`.
    pub async fn app(&self, pool: Pool, redis_url: &str) -> Router {
        self.app_with_timeout(pool, redis_url, HANDLER_TIMEOUT).await
    }

    /// [`app`](Self::app) with the handler cut off after `timeout`.
    pub async fn app_with_timeout(&self, pool: Pool, redis_url: &str, timeout: Duration) -> Router {
        let redis = crate::redis_connection(redis_url).await;
        let flag = FlagLayer::new(
            RedisFlagStore::new(redis).with_prefix(self.prefix.clone()),
            Duration::from_secs(3600),
        );
        let tiers = ServiceBuilder::new()
            .layer(flag)
            .layer(PgTransactionalLayer::new(pool.clone(), self.schema.records()));
        let responses = PgResponses::new(pool.clone(), &self.schema.records()).expect("a table name");
        let keyed = IdempotencyLayer::new(tiers.clone(), responses.clone(), ClientScope::header(TENANT))
            .with_max_body_len(MAX_BODY)
            .with_timeout(timeout)
            .with_expiry(RESPONSE_EXPIRY)
            .with_stored_headers([CONTENT_TYPE, LOCATION]);
        let tokens = PgTokens::new(pool, self.schema.table("form_tokens"));
        let once = IdempotencyLayer::new(tiers, responses, ClientScope::header(TENANT))
            .with_one_time_tokens(tokens.clone(), TokenField::Form("_token".to_owned()))
            .with_fingerprint(FingerprintPolicy::off());
        let issuer = TokenIssuer::new(tokens, Duration::from_secs(600), ClientScope::header(TENANT));
        let keyed_routes = Router::new()
            .route("/orders", post(create_order))
            .route("/refunds", post(create_order))
            .layer(keyed);
        let token_routes = Router::new()
            .route("/forms/orders", post(create_order))
            .layer(once);
        keyed_routes
            .merge(token_routes)
            .route_service("/tokens", issuer)
            .with_state(self.faults.clone())
    }

    /// `POST /orders` behind the layer with the transactional record alone, one
    /// transaction per request, or `batched`: what the bench measures.
    pub fn record_only_app(&self, batched: bool) -> Router {
        let record = PgTransactionalLayer::new(self.pool.clone(), self.schema.records());
        let responses = self.responses();
        let clients = ClientScope::header(TENANT);
        let orders = Router::new().route("/orders", post(create_order));
        let orders = if batched {
            orders.layer(
                IdempotencyLayer::new(record.batched(), responses, clients).with_expiry(RESPONSE_EXPIRY),
            )
        } else {
            orders.layer(IdempotencyLayer::new(record, responses, clients).with_expiry(RESPONSE_EXPIRY))
        };
        orders.with_state(self.faults.clone())
    }

    /// `POST /orders` behind the transactional record alone, one transaction per request,
    /// cut off after [`HANDLER_TIMEOUT`], on a pool whose sessions wait at most a second for
    /// a row lock (`lock_timeout`): a copy of a key in flight gives up waiting for it.
    pub fn impatient_app(&self) -> Router {
        let url = crate::postgres::database_url();
        let separator = if url.contains('?') { '&' } else { '?' };
        let schema = self.schema.name();
        let options = format!("options=-csearch_path%3D{schema}%20-clock_timeout%3D1000");
        let pool = crate::postgres::pool_on(&format!("{url}{separator}{options}"), 8);
        let record = PgTransactionalLayer::new(pool.clone(), self.schema.records());
        let responses = PgResponses::new(pool, &self.schema.records()).expect("a table name");
        let layer = IdempotencyLayer::new(record, responses, ClientScope::header(TENANT))
            .with_timeout(HANDLER_TIMEOUT);
        Router::new()
            .route("/orders", post(create_order))
            .layer(layer)
            .with_state(self.faults.clone())
    }

    /// The same order endpoint without the layer, writing its row on `pool` on its own
    /// (autocommit): what the layer is measured against.
    pub fn plain_app(&self) -> Router {
        Router::new()
            .route("/orders", post(create_order_without_layer))
            .with_state(self.pool.clone())
    }

    /// Ends the sessions left idle inside a transaction that holds a lock on one of the
    /// shop's tables — transactions nobody is going to end — and answers how many there
    /// were. Ended so that a test that finds one fails instead of hanging in its clean-up,
    /// whose `DROP SCHEMA` would wait for their locks. Asked on a connection of its own, so
    /// the shop's pool is left as it is.
    pub async fn end_idle_transactions(&self) -> usize {
        let client = crate::postgres::pool(1).get().await.expect("a connection");
        let sessions = "SELECT DISTINCT a.pid FROM pg_stat_activity a \
             JOIN pg_locks l ON l.pid = a.pid JOIN pg_class c ON c.oid = l.relation \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND a.state LIKE 'idle in transaction%'";
        let rows = client.query(sessions, &[&self.schema.name()]).await;
        let pids: Vec<i32> = rows
            .expect("pg_stat_activity")
            .iter()
            .map(|row| row.get(0))
            .collect();
        for pid in &pids {
            let ended = client.execute("SELECT pg_terminate_backend($1)", &[pid]).await;
            ended.expect("pg_terminate_backend");
        }
        pids.len()
    }

    /// Every row of every table of the shop's schema, as text.
    pub async fn dump(&self) -> String {
        let client = crate::postgres::pool(1).get().await.expect("a connection");
        let tables = client
            .query(
                "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
                &[&self.schema.name()],
            )
            .await
            .expect("the shop's tables");
        let mut dump = String::new();
        for table in tables {
            let table: String = table.get(0);
            let rows = format!("SELECT t::text FROM \"{}\".\"{table}\" t", self.schema.name());
            for row in client.query(&rows, &[]).await.expect("a table's rows") {
                dump.push_str(&row.get::<_, String>(0));
                dump.push('\n');
            }
        }
        dump
    }

    /// The number of effects written.
    pub async fn effects(&self) -> i64 {
        self.schema.count("SELECT count(*) FROM effects").await
    }
}

/// Both order handlers' effect: one row, the statement prepared once per connection.
const INSERT_EFFECT: &str = "INSERT INTO effects (path, body) VALUES ($1, $2)";

/// The order handler: writes one `effects` row in the record's transaction, then maybe a
/// fault, then answers [`created`].
async fn create_order(
    State(faults): State<Arc<Faults>>,
    Extension(tx): Extension<PgTransaction>,
    uri: axum::http::Uri,
    body: Bytes,
) -> Response {
    let text = String::from_utf8_lossy(&body);
    faults.ran(&text);
    let written = async {
        let insert = tx.prepare_cached(INSERT_EFFECT).await?;
        tx.execute(&insert, &[&uri.path(), &text.as_ref()]).await
    };
    if let Err(error) = written.await {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    if Faults::take(&faults.swallowed) {
        let _ = tx.execute("SELECT 1 / 0", &[]).await;
    }
    if Faults::take(&faults.stalls) {
        let stall = (HANDLER_TIMEOUT * 4).as_secs_f64();
        let _ = tx.execute("SELECT pg_sleep($1)", &[&stall]).await;
    }
    if Faults::take(&faults.cut_off) {
        let seconds = CUT_OFF_SLEEP.as_secs_f64();
        let sleep = async { tx.execute("SELECT pg_sleep($1)", &[&seconds]).await };
        let _ = tokio::time::timeout(Duration::from_millis(50), sleep).await;
    }
    drop(tx);
    after_the_effect(&faults, &uri).await
}

/// What every order handler does once its effect is written, on any store: maybe a fault,
/// then [`created`].
pub(crate) async fn after_the_effect(faults: &Faults, uri: &axum::http::Uri) -> Response {
    let pace = faults.pace_ms.load(Ordering::SeqCst);
    if pace > 0 {
        tokio::time::sleep(Duration::from_millis(u64::from(pace))).await;
    }
    if Faults::take(&faults.panics) || Faults::reached(&faults.panic_at_run) {
        panic!("the handler's injected panic");
    }
    if Faults::take(&faults.slow) {
        tokio::time::sleep(SLOW_RUN).await;
    }
    if Faults::take(&faults.unavailable) {
        return (StatusCode::SERVICE_UNAVAILABLE, "the warehouse is down").into_response();
    }
    if Faults::take(&faults.throttled) {
        return (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response();
    }
    if Faults::take(&faults.endless_bodies) {
        let endless = futures_lite::stream::pending::<Result<Bytes, std::io::Error>>();
        return (StatusCode::CREATED, axum::body::Body::from_stream(endless)).into_response();
    }
    created(uri)
}

/// The order handler without the layer: the same row, written on its own.
async fn create_order_without_layer(State(pool): State<Pool>, uri: axum::http::Uri, body: Bytes) -> Response {
    let text = String::from_utf8_lossy(&body);
    let written = async {
        let client = pool.get().await.map_err(|error| error.to_string())?;
        let insert = client
            .prepare_cached(INSERT_EFFECT)
            .await
            .map_err(|error| error.to_string())?;
        client
            .execute(&insert, &[&uri.path(), &text.as_ref()])
            .await
            .map_err(|error| error.to_string())
    };
    match written.await {
        Ok(_) => created(&uri),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error).into_response(),
    }
}

/// The order endpoint's answer: 201 with a fresh receipt id (so a replay, which answers the
/// first receipt, is told from a second run).
fn created(uri: &axum::http::Uri) -> Response {
    let receipt = oncely::Token::random().to_string();
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, "application/json".parse().expect("a header value"));
    headers.insert(
        LOCATION,
        format!("/orders/{receipt}").parse().expect("a header value"),
    );
    headers.insert("x-request-only", "first".parse().expect("a header value"));
    let answer = serde_json::json!({ "receipt": receipt, "path": uri.path() });
    (StatusCode::CREATED, headers, answer.to_string()).into_response()
}

/// A server on a free loopback port, stopped when dropped.
pub struct TestServer {
    /// Where it listens.
    pub address: SocketAddr,
    task: JoinHandle<()>,
}

impl TestServer {
    /// Serves `app` on `127.0.0.1` at a free port.
    pub async fn start(app: Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let address = listener.local_addr().expect("the bound address");
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("the server runs");
        });
        TestServer { address, task }
    }

    /// `http://127.0.0.1:PORT` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client that reuses connections, as a payment provider's or an app's would.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client")
}

/// A request's answer, read whole.
#[derive(Debug)]
pub struct Answer {
    /// The status.
    pub status: u16,
    /// The headers.
    pub headers: reqwest::header::HeaderMap,
    /// The body, as text.
    pub body: String,
}

impl Answer {
    /// True when the answer is a stored response answered again.
    pub fn is_replay(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|value| value == "true")
    }

    /// The body's `field`, as JSON.
    pub fn json(&self, field: &str) -> serde_json::Value {
        let document: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        document[field].clone()
    }
}

/// Sends `request` and reads its answer.
pub async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.text().await.expect("a body");
    Answer {
        status,
        headers,
        body,
    }
}

/// An order's body.
pub const ORDER: &str = r#"{"sku":"tea","quantity":2}"#;

/// Another payload than [`ORDER`].
pub const OTHER_ORDER: &str = r#"{"sku":"tea","quantity":3}"#;

/// `POST path` as `tenant` with `key` (when given) and `body`.
pub fn post_as(
    server: &TestServer,
    path: &str,
    tenant: &str,
    key: Option<&str>,
    body: &'static str,
) -> reqwest::RequestBuilder {
    let request = client()
        .post(server.url(path))
        .header(TENANT, tenant)
        .header("content-type", "application/json")
        .body(body);
    match key {
        Some(key) => request.header("idempotency-key", key),
        None => request,
    }
}

/// The answers to 64 concurrent copies of one order under `key`.
pub async fn sixty_four_copies(server: &TestServer, key: &str) -> Vec<Answer> {
    let copies: Vec<_> = (0..64)
        .map(|_| tokio::spawn(send(post_as(server, "/orders", "acme", Some(key), ORDER))))
        .collect();
    let mut answers = Vec::new();
    for copy in copies {
        answers.push(copy.await.expect("the request task"));
    }
    answers
}

/// The variant of the problem `answer` is (`KeyInFlight`, …); panics if it is none.
pub fn problem_type(answer: &Answer) -> String {
    assert_eq!(
        answer.headers["content-type"], "application/problem+json",
        "not a problem: {answer:?}"
    );
    let kind = answer.json("type");
    let kind = kind.as_str().unwrap_or_default();
    kind.rsplit_once("#variant.")
        .map(|(_, name)| name.to_owned())
        .unwrap_or_default()
}

/// A form submit to `POST /forms/orders` as `tenant` with the one-time `token`.
pub fn submit(server: &TestServer, tenant: &str, token: &str) -> reqwest::RequestBuilder {
    client()
        .post(server.url("/forms/orders"))
        .header(TENANT, tenant)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("sku=tea&quantity=2&_token={token}"))
}

/// A fresh one-time token for `tenant`.
pub async fn fetch_token(server: &TestServer, tenant: &str) -> String {
    let issued = send(client().post(server.url("/tokens")).header(TENANT, tenant)).await;
    assert_eq!(issued.status, 201, "{issued:?}");
    assert_eq!(issued.headers["cache-control"], "no-store");
    issued.json("token").as_str().expect("a token").to_owned()
}

/// A request written on a connection of its own, by hand: a client whose hanging up the
/// server sees at once (the connection closes when this is dropped), which an HTTP client
/// library's timeout does not promise.
pub struct RawRequest(tokio::net::TcpStream);

impl RawRequest {
    /// `POST /orders` to `server` as `tenant`, with `key` and `body`, sent in full.
    pub async fn post(server: &TestServer, tenant: &str, key: &str, body: &str) -> Self {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(server.address)
            .await
            .expect("a connection");
        let request = format!(
            "POST /orders HTTP/1.1\r\nhost: {}\r\n{TENANT}: {tenant}\r\nidempotency-key: {key}\r\n\
             content-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            server.address,
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .expect("the request sent");
        RawRequest(stream)
    }

    /// The answer's status, and whether it is a stored response answered again.
    pub async fn answer(mut self) -> (u16, bool) {
        use tokio::io::AsyncReadExt;
        let mut answer = Vec::new();
        self.0.read_to_end(&mut answer).await.expect("an answer");
        let answer = String::from_utf8_lossy(&answer).to_lowercase();
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|status| status.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
        (status, answer.contains("idempotent-replayed: true"))
    }
}
