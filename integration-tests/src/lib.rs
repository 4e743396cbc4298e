//! oncely's integration tests' helpers; the runs against real services are in `tests/`,
//! and the store suites every backend runs are `oncely::testing`.

pub mod amqp;
pub mod amqp_tap;
pub mod chaos_stack;
pub mod commit_thief;
pub mod dead_letter;
pub mod harness;
pub mod http;
pub mod http_mariadb;
pub mod http_stores;
pub mod logs;
pub mod mysql;
pub mod outcomes;
pub mod postgres;
pub mod recorder;
pub mod redis_server;
pub mod rocketmq;
pub mod tls;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

/// The Redis the tests use: `REDIS_URL`, or `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A reconnecting connection to `url`, with timeouts short enough that a test against a
/// stopped server fails fast instead of hanging; over TLS for `rediss://`, trusting the test
/// CA and presenting the client certificate.
pub async fn redis_connection(url: &str) -> ConnectionManager {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(200));
    let client = redis_client(url);
    ConnectionManager::new_with_config(client, config)
        .await
        .unwrap_or_else(|error| {
            panic!("Redis at {url} unreachable ({error}); run integration-tests/services.sh")
        })
}

/// A client of `url`: over TLS for `rediss://`, trusting the test CA and presenting the
/// client certificate.
pub fn redis_client(url: &str) -> redis::Client {
    match url.starts_with("rediss://") {
        true => oncely::tls::redis::client(url, &tls::settings()).expect("a valid Redis URL"),
        false => redis::Client::open(url).expect("a valid Redis URL"),
    }
}

pub use oncely::testing::unique;

/// A handler that succeeds at once and counts its runs, with the count: for a test that
/// only asks how often the stack let a delivery through.
pub fn counting_handler() -> (
    Arc<AtomicUsize>,
    impl RouteStack<std::convert::Infallible> + 'static,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = oncely::handler_fn({
        let runs = runs.clone();
        move |_: oncely::Envelope| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), oncely::HandlerError>(()) }
        }
    });
    (runs, handler)
}

/// What the tests' route functions return: a cloneable stack of envelopes to outcomes whose
/// errors are `E`. One name for the bound they would otherwise each spell out.
pub trait RouteStack<E>:
    tower::Service<oncely::Envelope, Response = oncely::Outcome, Error = E, Future: Send> + Clone + Send + Sync
{
}

impl<E, S> RouteStack<E> for S where
    S: tower::Service<oncely::Envelope, Response = oncely::Outcome, Error = E, Future: Send>
        + Clone
        + Send
        + Sync
{
}

/// Runs the future `clean_up` makes to its end on a thread of its own, with a runtime of its
/// own, and waits for it: for a `Drop` that cleans up over the network (it cannot await,
/// and may run inside a runtime, where blocking on another is refused). Joining keeps the
/// next test from seeing a half-done cleanup; a failure is ignored, as cleanup is best
/// effort.
pub fn clean_up_on_own_thread<F, Fut>(clean_up: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Box<dyn std::error::Error>>>,
{
    let _ = std::thread::spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
            let _ = runtime.block_on(clean_up());
        }
    })
    .join();
}

/// Checks a pre-filter rebuilt from a record table holding keys `1` to `25000` settled as
/// `SUCCESS` within the window, `25001` still processing, `25002` failed and `25003`
/// settled before the window: `read` and the `reported` progress count the 25,000 in pages
/// of 10,000, and the filter knows exactly those.
pub fn check_rebuilt_filter(filter: &impl oncely::prefilter::PreFilter, read: u64, reported: &[u64]) {
    use oncely::prefilter::Verdict;
    assert_eq!(read, 25_000);
    assert_eq!(reported, [10_000, 20_000, 25_000], "progress after each batch");
    let verdict = |key: &str| filter.check(&oncely::BusinessKey::new(key));
    assert_eq!(verdict("1"), Verdict::MaybeSeen);
    assert_eq!(verdict("25000"), Verdict::MaybeSeen);
    assert_eq!(
        verdict("25001"),
        Verdict::CertainlyNew,
        "still processing: not settled"
    );
    assert_eq!(verdict("25002"), Verdict::CertainlyNew, "failed: not settled");
    assert_eq!(
        verdict("25003"),
        Verdict::CertainlyNew,
        "settled before the window"
    );
}

/// Waits until `done` holds, checking every 100 ms; panics after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "not done within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Exits once the process that started this one is gone, so that the consumer processes of a
/// chaos run or a test interrupted before its cleanup do not run on forever.
pub async fn exit_when_orphaned() {
    let parent = std::os::unix::process::parent_id();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if std::os::unix::process::parent_id() != parent {
            std::process::exit(0);
        }
    }
}

/// `value` rounded, with thousands separated by commas: `54,100`.
pub fn thousands(value: f64) -> String {
    let digits = format!("{value:.0}");
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && digit.is_ascii_digit() && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(digit);
    }
    out
}
