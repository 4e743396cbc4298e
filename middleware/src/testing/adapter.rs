//! The adapter suite: what every broker adapter must do with the outcomes of a route's
//! stack, as cases any broker runs through an [`AdapterHarness`] (Watermill's universal
//! pub/sub tests are the model). `adapter_suite!(make)` turns them into one test per case;
//! see [`adapter_suite!`](crate::adapter_suite).
//!
//! Each case publishes a few messages to a destination of its own (the harness's queue or
//! topic), runs the adapter's consumer over them in drain mode, and checks what a user
//! relies on: how often the handler ran and with which attempt, the run's report, and the
//! dead letters with their reason and metadata ([`crate::dead_letter`]). Cases that need a
//! feature a broker lacks ([`Features`]) pass without checking it and print why.
//!
//! Of the cases that kill a consumer, the suite has the message that kills its consumer
//! every time; a consumer killed mid-batch and a shutdown mid-batch are not in it yet: each
//! adapter tests them by hand.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::dead_letter::{ATTEMPTS, MESSAGE_ID, REASON, ROUTE, SOURCE};
use crate::handler::{HandlerError, Json};
use crate::record::{MemoryRecordStore, RecordLayer};
use crate::report::RunReport;
use crate::{BoxError, BusinessKey, Delivery, Envelope, KeyExtractor, Outcome, Route, handler, handler_fn};

/// What a broker offers beyond the promises every adapter keeps: the retry case checks the
/// delay where `delayed_retry`, the crash case runs where `native_delivery_count`, and
/// `ordered` is for the ordering cases to come. Built from [`Features::none`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Features {
    /// The broker counts deliveries that come back unsettled (RabbitMQ's quorum queues).
    pub native_delivery_count: bool,
    /// Messages of one key are consumed in order (RocketMQ's orderly listener).
    pub ordered: bool,
    /// A retry waits out a delay on the broker before it comes back.
    pub delayed_retry: bool,
}

impl Features {
    /// None of the features.
    pub fn none() -> Self {
        Features::default()
    }

    /// With `native_delivery_count`.
    pub fn with_native_delivery_count(mut self) -> Self {
        self.native_delivery_count = true;
        self
    }

    /// With `ordered`.
    pub fn with_ordered(mut self) -> Self {
        self.ordered = true;
        self
    }

    /// With `delayed_retry`.
    pub fn with_delayed_retry(mut self) -> Self {
        self.delayed_retry = true;
        self
    }
}

/// How a case's handler takes its consumer down: [`crash`](Crashes::crash) tells the
/// harness, which kills the consumer (see [`AdapterHarness::drain_crashing`]).
#[derive(Clone, Debug, Default)]
pub struct Crashes(Arc<tokio::sync::Notify>);

impl Crashes {
    /// A new switch.
    pub fn new() -> Self {
        Crashes::default()
    }

    /// Has the harness kill the consumer running this handler. The handler should then not
    /// return: it dies with its consumer.
    pub fn crash(&self) {
        self.0.notify_one();
    }

    /// Waits until a handler asks for a crash.
    pub async fn asked(&self) {
        self.0.notified().await;
    }
}

/// A dead letter as read back from the broker: its metadata by name (AMQP headers, RocketMQ
/// user properties, as text) and its body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterCopy {
    /// The metadata, by name.
    pub metadata: HashMap<String, String>,
    /// The body.
    pub body: Vec<u8>,
}

/// A broker, one destination of its own, and its adapter's consumer, as the cases drive
/// them. A fresh harness per case.
pub trait AdapterHarness: Send {
    /// What the broker offers.
    fn features(&self) -> Features;

    /// Where a route of this broker reads the business key that [`publish`](Self::publish)
    /// gives a message (an AMQP header, RocketMQ's `KEYS`).
    fn key_extractor(&self) -> KeyExtractor;

    /// The name the dead-letter metadata gives the destination ([`SOURCE`]).
    fn source(&self) -> String;

    /// Publishes `body` to the destination with the business key `key` (none: the message
    /// has no key), and waits until the broker stored it.
    fn publish(&mut self, key: Option<&str>, body: &[u8]) -> impl Future<Output = ()> + Send;

    /// Runs the adapter's consumer of the destination with `route` until the run is
    /// drained — nothing in flight, nothing waiting, retries included — and returns its
    /// report.
    fn drain<S>(&mut self, route: Route<S>) -> impl Future<Output = RunReport> + Send
    where
        S: tower_service::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send;

    /// The dead letters of the destination so far.
    fn dead_letters(&mut self) -> impl Future<Output = Vec<DeadLetterCopy>> + Send;

    /// Like [`drain`](Self::drain), for a consumer that `crashes` takes down: each time a
    /// handler calls [`Crashes::crash`], the harness kills the consumer as a process that
    /// dies would be killed — every connection lost at once, nothing settled — and starts it
    /// again, with `max_deliveries` as its limit of returns. Returns the report of the run
    /// that drained. Only called for a broker with [`Features::native_delivery_count`].
    fn drain_crashing<S>(
        &mut self,
        route: Route<S>,
        crashes: Crashes,
        max_deliveries: u32,
    ) -> impl Future<Output = RunReport> + Send
    where
        S: tower_service::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send;

    /// Checks what this adapter adds to every dead letter beside the shared schema (AMQP:
    /// the original routing key); panics if it is missing. Nothing by default.
    fn check_own_metadata(&self, dead: &DeadLetterCopy) {
        let _ = dead;
    }
}

/// Runs the adapter suite against a broker: `adapter_suite!(make)` generates one
/// `#[tokio::test]` per case, in a module `adapter`, each with the harness the async
/// function `make` returns. See the [module docs](crate::testing::adapter).
#[macro_export]
macro_rules! adapter_suite {
    ($make:ident) => {
        $crate::__adapter_suite!(
            $make,
            [
                a_processed_message_is_acknowledged_once,
                a_duplicate_is_acknowledged_without_a_second_effect,
                a_retry_comes_back_with_the_next_attempt,
                exhausted_attempts_are_dead_lettered,
                a_permanent_failure_is_dead_lettered_with_its_reason,
                each_kind_of_poison_is_dead_lettered_with_its_reason,
                a_message_that_kills_its_consumer_every_time_is_dead_lettered_at_the_limit
            ]
        );
    };
}

/// Turns the adapter suite's cases into tests; see [`adapter_suite!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __adapter_suite {
    ($make:ident, [$($case:ident),* $(,)?]) => {
        mod adapter {
            $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::testing::adapter::$case(super::$make().await).await
            }
            )*
        }
    };
}

/// One handler run: its attempt, and when it started.
type Run = (u32, Instant);

/// Counts handler runs per business key, with the attempt and the time of each.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<BTreeMap<String, Vec<Run>>>>);

impl Runs {
    fn record(&self, key: &str, attempt: u32) {
        let mut runs = self.0.lock().expect("not poisoned");
        runs.entry(key.to_owned())
            .or_default()
            .push((attempt, Instant::now()));
    }

    fn attempts(&self) -> BTreeMap<String, Vec<u32>> {
        let runs = self.0.lock().expect("not poisoned");
        let attempts = |runs: &Vec<Run>| runs.iter().map(|(attempt, _)| *attempt).collect();
        runs.iter()
            .map(|(key, runs)| (key.clone(), attempts(runs)))
            .collect()
    }

    /// The time between the first two runs of `key`.
    fn between_first_two(&self, key: &str) -> Option<Duration> {
        let runs = self.0.lock().expect("not poisoned");
        match runs.get(key)?.as_slice() {
            [(_, first), (_, second), ..] => Some(second.duration_since(*first)),
            _ => None,
        }
    }
}

/// A handler that counts its runs and answers `answer(attempt)`.
fn counting<H: AdapterHarness>(
    harness: &H,
    name: &str,
    runs: &Runs,
    answer: fn(u32) -> Result<(), HandlerError>,
) -> Route<
    impl tower_service::Service<Envelope, Response = Outcome, Error = std::convert::Infallible, Future: Send>
    + Clone
    + Send
    + Sync
    + 'static,
> {
    let runs = runs.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        runs.record(envelope.key().as_str(), envelope.delivery().attempt());
        let answered = answer(envelope.delivery().attempt());
        async move { answered }
    });
    Route::new(name, harness.key_extractor(), handler)
}

fn keys(runs: &[(&str, &[u32])]) -> BTreeMap<String, Vec<u32>> {
    runs.iter()
        .map(|(key, attempts)| ((*key).to_owned(), attempts.to_vec()))
        .collect()
}

/// Processed → acknowledged once: each message runs once, nothing comes back, nothing is
/// dead-lettered.
pub async fn a_processed_message_is_acknowledged_once<H: AdapterHarness>(mut harness: H) {
    for key in ["o-1", "o-2", "o-3"] {
        harness.publish(Some(key), br#"{"amount":1}"#).await;
    }
    let runs = Runs::default();
    let report = harness
        .drain(counting(&harness, "processed", &runs, |_| Ok(())))
        .await;
    assert_eq!(
        runs.attempts(),
        keys(&[("o-1", &[1]), ("o-2", &[1]), ("o-3", &[1])])
    );
    assert_eq!(report.processed, 3, "{report}");
    assert!(report.drained, "{report}");
    assert!(harness.dead_letters().await.is_empty());
}

/// Duplicate → acknowledged, no second effect: a copy of a processed key is answered by the
/// tier that remembers it, and the handler does not run again. The same key with another
/// payload (a key reused by mistake) is dead-lettered as `payload_mismatch`.
pub async fn a_duplicate_is_acknowledged_without_a_second_effect<H: AdapterHarness>(mut harness: H) {
    harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let counted = runs.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        counted.record(envelope.key().as_str(), envelope.delivery().attempt());
        async { Ok::<(), HandlerError>(()) }
    });
    let stack = tower_layer::Layer::layer(&RecordLayer::new(MemoryRecordStore::new()), handler);
    let route = Route::new("duplicate", harness.key_extractor(), stack);
    let report = harness.drain(route.clone()).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1])]), "one effect");
    assert_eq!(report.processed, 1, "{report}");
    assert_eq!(report.duplicates.values().sum::<u64>(), 1, "{report}");
    assert!(harness.dead_letters().await.is_empty());

    harness.publish(Some("o-1"), br#"{"amount":2}"#).await;
    let report = harness.drain(route).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1])]), "still one effect");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "{report}");
    assert_dead_letter(&harness, &dead[0], "payload_mismatch", 1, "duplicate");
    assert_eq!(dead[0].body, br#"{"amount":2}"#);
}

/// The shortest wait a broker with delayed retries may call a delay.
const SHORTEST_RETRY_DELAY: Duration = Duration::from_millis(100);

/// Retry → back with attempt + 1 (after the broker's delay, where it has one
/// ([`Features::delayed_retry`]): not before 100 ms), then processed.
pub async fn a_retry_comes_back_with_the_next_attempt<H: AdapterHarness>(mut harness: H) {
    harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let fails_first = |attempt| match attempt {
        1 => Err(HandlerError::transient("downstream unavailable")),
        _ => Ok(()),
    };
    let report = harness
        .drain(counting(&harness, "retry", &runs, fails_first))
        .await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1, 2])]));
    assert_eq!(report.processed, 1, "{report}");
    assert_eq!(report.retries.get("handler_failed"), Some(&1), "{report}");
    if harness.features().delayed_retry {
        let waited = runs.between_first_two("o-1").expect("two runs");
        assert!(
            waited >= SHORTEST_RETRY_DELAY,
            "came back after {waited:?}: no delay"
        );
    }
    assert!(harness.dead_letters().await.is_empty());
}

/// Exhausted attempts → dead letter with the reason `attempts_exhausted` at the route's
/// last attempt, after a retry for each attempt before it.
pub async fn exhausted_attempts_are_dead_lettered<H: AdapterHarness>(mut harness: H) {
    harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let always_fails = |_| Err(HandlerError::transient("downstream unavailable"));
    let route = counting(&harness, "exhausted", &runs, always_fails).with_max_attempts(3);
    let report = harness.drain(route).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1, 2, 3])]));
    assert_eq!(report.retries.get("handler_failed"), Some(&2), "{report}");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "{report}");
    assert_dead_letter(&harness, &dead[0], "attempts_exhausted", 3, "exhausted");
}

/// Checks one dead letter's reason code and metadata: the shared schema (with a message id:
/// the harnesses' producers give every message one), then the adapter's own.
fn assert_dead_letter<H: AdapterHarness>(
    harness: &H,
    dead: &DeadLetterCopy,
    reason: &str,
    attempts: u32,
    route: &str,
) {
    let field = |name: &str| dead.metadata.get(name).map(String::as_str);
    assert_eq!(field(REASON), Some(reason), "{:?}", dead.metadata);
    assert_eq!(
        field(ATTEMPTS),
        Some(attempts.to_string().as_str()),
        "{:?}",
        dead.metadata
    );
    assert_eq!(field(ROUTE), Some(route), "{:?}", dead.metadata);
    assert_eq!(
        field(SOURCE),
        Some(harness.source().as_str()),
        "{:?}",
        dead.metadata
    );
    assert!(
        field(MESSAGE_ID).is_some_and(|id| !id.is_empty()),
        "{:?}",
        dead.metadata
    );
    harness.check_own_metadata(dead);
}

/// Permanent failure → dead letter with the reason `rejected`, the original body and the
/// metadata, at once (no retry).
pub async fn a_permanent_failure_is_dead_lettered_with_its_reason<H: AdapterHarness>(mut harness: H) {
    harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let rejects = |_| Err(HandlerError::permanent("unknown account"));
    let report = harness.drain(counting(&harness, "rejects", &runs, rejects)).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1])]), "not retried");
    assert_eq!(report.dead_letters.get("rejected"), Some(&1), "{report}");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_dead_letter(&harness, &dead[0], "rejected", 1, "rejects");
    assert_eq!(dead[0].body, br#"{"amount":1}"#);
}

/// Each kind of poison → a dead letter with its reason, without running the handler: no
/// business key, a key with control characters, a body over the route's limit, and bodies
/// that do not deserialise into the handler's type (not JSON, not UTF-8).
pub async fn each_kind_of_poison_is_dead_lettered_with_its_reason<H: AdapterHarness>(mut harness: H) {
    let oversize = [b'7'; 4096];
    let poison: [(Option<&str>, &[u8], &str); 5] = [
        (None, br#"{"case":"no key"}"#, "invalid_key"),
        (
            Some("o-\u{7}1"),
            br#"{"case":"control character"}"#,
            "invalid_key",
        ),
        (Some("o-big"), &oversize, "oversize"),
        (Some("o-bad"), b"not JSON", "bad_body"),
        (Some("o-bytes"), b"\xff\xfe", "bad_body"),
    ];
    for (key, body, _) in poison {
        harness.publish(key, body).await;
    }
    harness.publish(Some("o-ok"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let counted = runs.clone();
    let typed = handler(
        move |key: BusinessKey, delivery: Delivery, Json(_): Json<Value>| {
            counted.record(key.as_str(), delivery.attempt());
            async { Ok::<(), HandlerError>(()) }
        },
    );
    let route = Route::new("poison", harness.key_extractor(), typed).with_max_body_len(1024);
    let report = harness.drain(route).await;
    assert_eq!(
        runs.attempts(),
        keys(&[("o-ok", &[1])]),
        "only the good message ran"
    );
    assert_eq!(report.processed, 1, "{report}");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), poison.len(), "{report}");
    for (_, body, reason) in poison {
        let letter = dead.iter().find(|letter| letter.body == body);
        let letter = letter.unwrap_or_else(|| panic!("no dead letter for the {reason} body"));
        assert_dead_letter(&harness, letter, reason, 1, "poison");
    }
}

/// A message that kills its consumer every time → dead-lettered as `delivery_limit` once it
/// came back the limit's number of times (it may run once more among others, where its
/// crash cannot be told from theirs), and the messages caught in its crashes are processed,
/// none dead-lettered. For brokers that count returns ([`Features::native_delivery_count`]);
/// others pass without checking.
pub async fn a_message_that_kills_its_consumer_every_time_is_dead_lettered_at_the_limit<H: AdapterHarness>(
    mut harness: H,
) {
    const LIMIT: u32 = 2;
    if !harness.features().native_delivery_count {
        println!("skipped: the broker does not count deliveries that come back unsettled");
        return;
    }
    harness.publish(Some("poison"), br#"{"amount":1}"#).await;
    let oks = ["ok-1", "ok-2", "ok-3"];
    for key in oks {
        harness.publish(Some(key), br#"{"amount":1}"#).await;
    }
    let runs = Runs::default();
    let crashes = Crashes::new();
    let (counted, crash) = (runs.clone(), crashes.clone());
    // The others are slow at their first run, so that the first crash catches them running.
    let handler = handler_fn(move |envelope: Envelope| {
        counted.record(envelope.key().as_str(), envelope.delivery().attempt());
        let first = counted.attempts()[envelope.key().as_str()].len() == 1;
        let poison = envelope.key().as_str() == "poison";
        let crash = crash.clone();
        async move {
            if poison {
                crash.crash();
                std::future::pending::<()>().await;
            }
            if first {
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("crashes", harness.key_extractor(), handler);
    let report = harness.drain_crashing(route, crashes, LIMIT).await;
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "only the poison message: {report}");
    assert_dead_letter(&harness, &dead[0], "delivery_limit", 1, "crashes");
    let runs = runs.attempts();
    let poison_runs = runs.get("poison").map_or(0, Vec::len) as u32;
    assert!(
        (LIMIT..=LIMIT + 1).contains(&poison_runs),
        "the poison message ran {poison_runs} times"
    );
    let caught = oks
        .iter()
        .filter(|key| runs.get(**key).is_some_and(|r| r.len() > 1))
        .count();
    assert!(
        oks.iter().all(|key| runs.contains_key(*key)),
        "every other message was processed"
    );
    assert!(
        caught > 0,
        "some were caught in a crash (the case under test): {runs:?}"
    );
}
