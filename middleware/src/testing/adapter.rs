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
//! Three cases take the consumer down while it runs ([`AdapterHarness::drain_interrupted`]):
//! a message that kills its consumer every time, a consumer killed mid-batch and a shutdown
//! mid-batch. The last two check effects through a record tier on a
//! [`MemoryRecordStore`]: the harness's consumer runs in the test's process, so a killed
//! consumer's handlers are cut off (or run on) as the harness decides, and the store's lease
//! plays the part a crashed process's rolled-back transaction plays in PostgreSQL.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::dead_letter::{ATTEMPTS, MESSAGE_ID, REASON, ROUTE, SOURCE};
use crate::deliveries::MemoryDeliveryCounter;
use crate::handler::{HandlerError, Json};
use crate::record::{MemoryRecordStore, RecordLayer};
use crate::report::RunReport;
use crate::{BoxError, BusinessKey, Delivery, Envelope, KeyExtractor, Outcome, Route, handler, handler_fn};
use tower_layer::Layer;

/// What a broker offers beyond the promises every adapter keeps: the retry case checks the
/// delay where `delayed_retry`, the case of a message that kills its consumer every time
/// counts its crashes on the broker where `native_delivery_count` (else with the route's
/// delivery limit), and `ordered` is for the ordering cases to come. Built from
/// [`Features::none`].
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

/// How a harness takes its consumer down when a handler asks
/// ([`AdapterHarness::drain_interrupted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Interruption {
    /// As a process that dies: every connection lost at once, nothing settled, the
    /// handlers still running cut off (or left to finish with nobody to settle for them).
    Crash,
    /// A graceful shutdown, as at a deploy: the consumer stops taking deliveries, lets the
    /// ones running finish within its grace and hands back the ones it holds.
    Shutdown,
}

/// The switch a case's handler pulls to take its consumer down:
/// [`interrupt`](Interrupts::interrupt) tells the harness, which crashes or shuts down the
/// consumer (see [`AdapterHarness::drain_interrupted`]) and starts another.
#[derive(Clone, Debug, Default)]
pub struct Interrupts {
    asked: Arc<tokio::sync::Notify>,
    count: Arc<AtomicU64>,
}

impl Interrupts {
    /// A new switch.
    pub fn new() -> Self {
        Interrupts::default()
    }

    /// Has the harness take down the consumer running this handler. After a crash the
    /// handler should not return: it dies with its consumer. After a shutdown it may.
    pub fn interrupt(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.asked.notify_one();
    }

    /// How many interruptions handlers asked for so far: a handler notes it when it starts,
    /// for [`died_since`](Self::died_since).
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// For a handler that started when [`count`](Self::count) was `started`, at the point
    /// where its effect would be applied: if a crash came since, never returns — the
    /// handler died with its consumer, even where the harness cannot stop it (a listener
    /// whose calls run on another runtime than the killed consumer's) — else returns at
    /// once. Only for cases whose interruptions are crashes.
    pub async fn died_since(&self, started: u64) {
        if self.count() != started {
            std::future::pending::<()>().await;
        }
    }

    /// Waits until a handler asks for an interruption.
    pub async fn asked(&self) {
        self.asked.notified().await;
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
    /// has no key), waits until the broker stored it, and returns the message id the
    /// adapter reads from it — the one its dead letter carries as [`MESSAGE_ID`].
    fn publish(&mut self, key: Option<&str>, body: &[u8]) -> impl Future<Output = String> + Send;

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

    /// Like [`drain`](Self::drain), for a consumer that `interrupts` takes down: each time a
    /// handler calls [`Interrupts::interrupt`], the harness takes the consumer down as `how`
    /// says and starts another, with `max_deliveries` as its limit of returns where the
    /// broker counts them ([`Features::native_delivery_count`]). Each consumer runs a route
    /// of its own from `route`, as each consumer process builds its own: what one leaves
    /// behind when it dies (a suspect's turn to run alone) is not the next one's. Returns the
    /// report of the consumer that drained.
    fn drain_interrupted<S>(
        &mut self,
        route: impl Fn() -> Route<S> + Send + Sync,
        interrupts: Interrupts,
        how: Interruption,
        max_deliveries: u32,
    ) -> impl Future<Output = RunReport> + Send
    where
        S: tower_service::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send;

    /// Deletes what the harness made on the broker (queues, consumers, clients), at the end
    /// of a case that passed: a failed case leaves them to look at. Nothing by default.
    fn tear_down(self) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async {}
    }

    /// Checks what this adapter adds to or keeps on every dead letter beside the shared
    /// schema — such as the business `key` the message was published with (none: it had
    /// none), or AMQP's original routing key; panics if it is missing. Nothing by default.
    fn check_own_metadata(&self, dead: &DeadLetterCopy, key: Option<&str>) {
        let _ = (dead, key);
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
                a_message_that_kills_its_consumer_every_time_is_dead_lettered_at_the_limit,
                a_consumer_killed_mid_batch_applies_every_key_once,
                a_shutdown_mid_batch_applies_every_key_once_and_blames_no_message,
                a_drain_ends_with_a_true_report
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
    /// Records a run of `key`; returns how many it has had, this one included.
    fn record(&self, key: &str, attempt: u32) -> usize {
        let mut runs = self.0.lock().expect("not poisoned");
        let runs = runs.entry(key.to_owned()).or_default();
        runs.push((attempt, Instant::now()));
        runs.len()
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

/// How long a record claim of a consumer taken down with it blocks its key: short, so the
/// cases that kill consumers wait little for it.
const CLAIM_LEASE: Duration = Duration::from_secs(2);

/// The record tier the cases put in front of their handlers when they check effects: a
/// duplicate is answered from it, and a claim held by a killed consumer's handler is taken
/// over once [`CLAIM_LEASE`] has passed.
fn record_tier() -> RecordLayer<MemoryRecordStore> {
    RecordLayer::new(MemoryRecordStore::new())
        .with_lease(CLAIM_LEASE)
        .with_in_flight_delay(Duration::from_millis(500))
}

/// Checks that each of `keys` had its effect once, and no other key had one.
fn assert_each_effect_once(effects: &Runs, keys: &[String]) {
    let effects = effects.attempts();
    let counts: BTreeMap<&str, usize> = effects
        .iter()
        .map(|(key, runs)| (key.as_str(), runs.len()))
        .collect();
    let once: BTreeMap<&str, usize> = keys.iter().map(|key| (key.as_str(), 1)).collect();
    assert_eq!(counts, once, "each key's effect once");
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
    harness.tear_down().await;
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
    let route = Route::new("duplicate", harness.key_extractor(), record_tier().layer(handler));
    let report = harness.drain(route.clone()).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1])]), "one effect");
    assert_eq!(report.processed, 1, "{report}");
    assert_eq!(report.duplicates.values().sum::<u64>(), 1, "{report}");
    assert!(harness.dead_letters().await.is_empty());

    let reused = harness.publish(Some("o-1"), br#"{"amount":2}"#).await;
    let report = harness.drain(route).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1])]), "still one effect");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "{report}");
    assert_dead_letter(
        &harness,
        &dead[0],
        "payload_mismatch",
        1,
        "duplicate",
        (Some("o-1"), &reused),
    );
    assert_eq!(dead[0].body, br#"{"amount":2}"#);
    harness.tear_down().await;
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
    harness.tear_down().await;
}

/// Exhausted attempts → dead letter with the reason `attempts_exhausted` at the route's
/// last attempt, after a retry for each attempt before it.
pub async fn exhausted_attempts_are_dead_lettered<H: AdapterHarness>(mut harness: H) {
    let id = harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let always_fails = |_| Err(HandlerError::transient("downstream unavailable"));
    let route = counting(&harness, "exhausted", &runs, always_fails).with_max_attempts(3);
    let report = harness.drain(route).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1, 2, 3])]));
    assert_eq!(report.retries.get("handler_failed"), Some(&2), "{report}");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "{report}");
    assert_dead_letter(
        &harness,
        &dead[0],
        "attempts_exhausted",
        3,
        "exhausted",
        (Some("o-1"), &id),
    );
    harness.tear_down().await;
}

/// Checks one dead letter's reason code and metadata: the shared schema, with the id of
/// the message it copies, then the adapter's own, given the message's business key.
fn assert_dead_letter<H: AdapterHarness>(
    harness: &H,
    dead: &DeadLetterCopy,
    reason: &str,
    attempts: u32,
    route: &str,
    (key, message_id): (Option<&str>, &str),
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
    assert_eq!(field(MESSAGE_ID), Some(message_id), "{:?}", dead.metadata);
    harness.check_own_metadata(dead, key);
}

/// Permanent failure → dead letter with the reason `rejected`, the original body and the
/// metadata, at once (no retry).
pub async fn a_permanent_failure_is_dead_lettered_with_its_reason<H: AdapterHarness>(mut harness: H) {
    let id = harness.publish(Some("o-1"), br#"{"amount":1}"#).await;
    let runs = Runs::default();
    let rejects = |_| Err(HandlerError::permanent("unknown account"));
    let report = harness.drain(counting(&harness, "rejects", &runs, rejects)).await;
    assert_eq!(runs.attempts(), keys(&[("o-1", &[1])]), "not retried");
    assert_eq!(report.dead_letters.get("rejected"), Some(&1), "{report}");
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_dead_letter(&harness, &dead[0], "rejected", 1, "rejects", (Some("o-1"), &id));
    assert_eq!(dead[0].body, br#"{"amount":1}"#);
    harness.tear_down().await;
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
    let mut ids = Vec::new();
    for (key, body, _) in poison {
        ids.push(harness.publish(key, body).await);
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
    for ((key, body, reason), id) in poison.into_iter().zip(&ids) {
        let letter = dead.iter().find(|letter| letter.body == body);
        let letter = letter.unwrap_or_else(|| panic!("no dead letter for the {reason} body"));
        assert_dead_letter(&harness, letter, reason, 1, "poison", (key, id));
    }
    harness.tear_down().await;
}

/// A message that kills its consumer every time → dead-lettered as `delivery_limit` once it
/// crashed the limit's number of times running alone (after a first run among others,
/// where its crash cannot be told from theirs: the limit + 1 runs in all), and the messages
/// caught in its crashes are processed, none dead-lettered — with the strictest limit, 1,
/// where one return blamed on the wrong message dead-letters it. Counted by the broker where it counts returns
/// ([`Features::native_delivery_count`]), else by the route's delivery limit
/// ([`Route::with_delivery_limit`], on a counter shared by the case's consumers as Redis
/// would be).
pub async fn a_message_that_kills_its_consumer_every_time_is_dead_lettered_at_the_limit<H: AdapterHarness>(
    mut harness: H,
) {
    const LIMIT: u32 = 1;
    let poison_id = harness.publish(Some("poison"), br#"{"amount":1}"#).await;
    let oks = ["ok-1", "ok-2", "ok-3"];
    for key in oks {
        harness.publish(Some(key), br#"{"amount":1}"#).await;
    }
    let runs = Runs::default();
    let interrupts = Interrupts::new();
    let (counted, crash) = (runs.clone(), interrupts.clone());
    // The others are slow at their first run, and the poison message's first run waits (a
    // few seconds at most) until one of them runs, so that its crash catches them running.
    let handler = handler_fn(move |envelope: Envelope| {
        let first = counted.record(envelope.key().as_str(), envelope.delivery().attempt()) == 1;
        let poison = envelope.key().as_str() == "poison";
        let (crash, started, others) = (crash.clone(), crash.count(), counted.clone());
        async move {
            if poison {
                let running = || others.attempts().keys().any(|key| key != "poison");
                for _ in 0..100 {
                    if !first || running() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                crash.interrupt();
                std::future::pending::<()>().await;
            }
            if first {
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            crash.died_since(started).await;
            Ok::<(), HandlerError>(())
        }
    });
    let (key, features, counter) = (
        harness.key_extractor(),
        harness.features(),
        MemoryDeliveryCounter::new(),
    );
    let route = move || {
        let route = Route::new("crashes", key.clone(), handler.clone());
        counting_returns(route, features, &counter, LIMIT)
    };
    let report = harness
        .drain_interrupted(route, interrupts, Interruption::Crash, LIMIT)
        .await;
    let dead = harness.dead_letters().await;
    assert_eq!(dead.len(), 1, "only the poison message: {report}");
    assert_dead_letter(
        &harness,
        &dead[0],
        "delivery_limit",
        1,
        "crashes",
        (Some("poison"), &poison_id),
    );
    let runs = runs.attempts();
    let poison_runs = runs.get("poison").map_or(0, Vec::len) as u32;
    assert_eq!(
        poison_runs,
        LIMIT + 1,
        "once among others, then alone up to the limit"
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
    harness.tear_down().await;
}

/// `route`, with a limit of `max` returns counted by the route's delivery limit
/// ([`Route::with_delivery_limit`]) on `counter` — shared by the case's consumers, as Redis
/// would be — where the broker does not count them itself.
fn counting_returns<S>(
    route: Route<S>,
    features: Features,
    counter: &MemoryDeliveryCounter,
    max: u32,
) -> Route<S>
where
    S: tower_service::Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    match features.native_delivery_count {
        true => route,
        false => route.with_delivery_limit(counter.clone(), max),
    }
}

/// Messages of the mid-batch cases: more than a consumer runs at once, so that an
/// interruption finds some running and some waiting.
fn batch(size: usize) -> Vec<String> {
    (0..size).map(|n| format!("k-{n}")).collect()
}

/// A handler for the mid-batch cases: counts runs in `runs` and, when it returns, the effect
/// in `effects`; slow at a key's first run, so that an interruption finds it running. The
/// first run to start, of whichever key, pulls `interrupts` (once) shortly after, while no
/// run has ended: the interruption then always finds messages waiting behind the running
/// ones. (A fixed key was not enough: a broker may hand it out last, after every other
/// message already ran, and the interruption then left nothing to the next consumer.) After
/// a crash, no run that started before it returns (each died with its consumer).
fn interrupting(
    runs: &Runs,
    effects: &Runs,
    interrupts: &Interrupts,
    how: Interruption,
) -> impl tower_service::Service<Envelope, Response = Outcome, Error = std::convert::Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ 'static {
    let (runs, effects, interrupts) = (runs.clone(), effects.clone(), interrupts.clone());
    let interrupter_chosen = Arc::new(AtomicBool::new(false));
    handler_fn(move |envelope: Envelope| {
        let key = envelope.key().as_str().to_owned();
        let attempt = envelope.delivery().attempt();
        let first = runs.record(&key, attempt) == 1;
        let interrupter = first && !interrupter_chosen.swap(true, Ordering::SeqCst);
        let (effects, interrupts, started) = (effects.clone(), interrupts.clone(), interrupts.count());
        async move {
            if interrupter {
                tokio::time::sleep(Duration::from_millis(300)).await;
                interrupts.interrupt();
            }
            if first {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            if how == Interruption::Crash {
                interrupts.died_since(started).await;
            }
            effects.record(&key, attempt);
            Ok::<(), HandlerError>(())
        }
    })
}

/// Consumer killed mid-batch → every key's effect once: the messages it held come back,
/// those it processed are answered as duplicates, those it was running run again once the
/// dead consumer's claims lapse, and none is dead-lettered.
pub async fn a_consumer_killed_mid_batch_applies_every_key_once<H: AdapterHarness>(mut harness: H) {
    let report = interrupted_batch(&mut harness, 20, Interruption::Crash, 5).await;
    assert!(harness.dead_letters().await.is_empty(), "{report}");
    let answered = report.processed + report.duplicates.values().sum::<u64>();
    assert!(
        answered > 1,
        "the consumer after the crash got back more than the crashing message (the case under \
         test): {report}"
    );
    assert!(report.drained, "{report}");
    harness.tear_down().await;
}

/// Publishes `size` messages and drains them through the record tier and [`interrupting`]'s
/// handler, whose first run takes the consumer down as `how` says, with
/// `max_deliveries` as the limit of returns; checks that each key had its effect once and
/// returns the report of the consumer that drained.
async fn interrupted_batch<H: AdapterHarness>(
    harness: &mut H,
    size: usize,
    how: Interruption,
    max_deliveries: u32,
) -> RunReport {
    let keys = batch(size);
    for key in &keys {
        harness.publish(Some(key), br#"{"amount":1}"#).await;
    }
    let (runs, effects, interrupts) = (Runs::default(), Runs::default(), Interrupts::new());
    let stack = record_tier().layer(interrupting(&runs, &effects, &interrupts, how));
    let (key, features, counter) = (
        harness.key_extractor(),
        harness.features(),
        MemoryDeliveryCounter::new(),
    );
    let route = move || {
        let route = Route::new("interrupted", key.clone(), stack.clone());
        counting_returns(route, features, &counter, max_deliveries)
    };
    let report = harness
        .drain_interrupted(route, interrupts, how, max_deliveries)
        .await;
    assert_each_effect_once(&effects, &keys);
    report
}

/// Shutdown mid-batch → every key's effect once, and no message blamed: the running ones
/// finish, the ones received but not started come back to the next consumer as they were,
/// none reported as `returned_unsettled` (the code an adapter gives a delivery whose
/// consumer died) — with the strictest limit of returns, 1, where a return counted as a
/// crash would dead-letter it.
pub async fn a_shutdown_mid_batch_applies_every_key_once_and_blames_no_message<H: AdapterHarness>(
    mut harness: H,
) {
    let report = interrupted_batch(&mut harness, 40, Interruption::Shutdown, 1).await;
    let dead = harness.dead_letters().await;
    assert!(dead.is_empty(), "{report}\n{dead:?}");
    assert_eq!(
        report.retries.get("returned_unsettled"),
        None,
        "none came back as if its consumer had died: {report}"
    );
    assert!(
        report.settled() > 0,
        "the shutdown left messages to the next consumer (the case under test): {report}"
    );
    assert!(report.drained, "{report}");
    harness.tear_down().await;
}

/// A drain ends with a true report: every outcome counted once under its name — processed,
/// a duplicate, a retry, a permanent failure and a poison message dead-lettered — nothing
/// unsettled or abandoned, `drained` set; and a second drain of the empty destination runs
/// nothing and reports nothing.
pub async fn a_drain_ends_with_a_true_report<H: AdapterHarness>(mut harness: H) {
    for (key, body) in [
        (Some("o-1"), &br#"{"amount":1}"#[..]),
        (Some("o-1"), br#"{"amount":1}"#),
        (Some("o-2"), br#"{"amount":2}"#),
        (Some("o-3"), br#"{"amount":3}"#),
        (None, br#"{"amount":4}"#),
    ] {
        harness.publish(key, body).await;
    }
    let runs = Runs::default();
    let counted = runs.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        let attempt = envelope.delivery().attempt();
        counted.record(envelope.key().as_str(), attempt);
        let answered = match (envelope.key().as_str(), attempt) {
            ("o-2", 1) => Err(HandlerError::transient("downstream unavailable")),
            ("o-3", _) => Err(HandlerError::permanent("unknown account")),
            _ => Ok(()),
        };
        async move { answered }
    });
    let route = Route::new("report", harness.key_extractor(), record_tier().layer(handler));
    let report = harness.drain(route.clone()).await;
    assert_eq!(
        runs.attempts(),
        keys(&[("o-1", &[1]), ("o-2", &[1, 2]), ("o-3", &[1])])
    );
    assert_eq!(report.processed, 2, "{report}");
    assert_eq!(report.duplicates.values().sum::<u64>(), 1, "{report}");
    assert_eq!(report.retries.get("handler_failed"), Some(&1), "{report}");
    let dead_letters: Vec<(&str, u64)> = report
        .dead_letters
        .iter()
        .map(|(reason, n)| (*reason, *n))
        .collect();
    assert_eq!(dead_letters, [("invalid_key", 1), ("rejected", 1)], "{report}");
    assert_eq!((report.unsettled, report.abandoned), (0, 0), "{report}");
    assert!(report.drained, "{report}");
    assert_eq!(harness.dead_letters().await.len(), 2, "{report}");

    let again = harness.drain(route).await;
    assert_eq!(
        runs.attempts().values().map(Vec::len).sum::<usize>(),
        4,
        "nothing ran again"
    );
    assert_eq!(again.settled(), 0, "{again}");
    assert!(again.drained, "{again}");
    harness.tear_down().await;
}
