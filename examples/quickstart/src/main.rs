//! Run with: `make demo` (or `cargo run --release -p quickstart`). No servers needed.
//!
//! The whole oncely stack on in-memory stores, fed by an in-process broker that misbehaves
//! the way real ones do: producers retry with the same message id, upstream services send
//! the same order again under a new id, copies of one order reach several consumers at
//! once, a consumer "crashes" after its handler ran but before its ack (so the broker
//! redelivers), a database hiccup fails some handler runs, shipment events arrive shuffled,
//! a few messages are poison, and midway the flag store is flushed (as a Redis `FLUSHALL`
//! or restart would), leaving the durable record tier to catch what the flag forgot.
//!
//! Two routes share eight consumer tasks:
//! - `deduct_stock`: flag → lock (per SKU) → record → handler, keyed `{orderId}:deduct_stock`.
//! - `shipment_status`: lock (per shipment) → state guard → record → handler, keyed
//!   `{shipment}:{state}`.
//!
//! At the end it prints what happened and checks the business effects: every valid order
//! deducted exactly once, every shipment's applied states strictly forward. It exits 1 if a
//! check fails.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use oncely::flag::{FlagLayer, MemoryFlagStore};
use oncely::lock::{LockLayer, MemoryLockStore};
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::state_guard::{MemoryStateStore, StateGuardLayer, StateMachine};
use oncely::{
    BoxError, BrokerAction, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, Route, Source,
    handler_fn,
};
use tokio::sync::mpsc;
use tower::{Service, ServiceBuilder};

const ORDERS: usize = 2_000;
const SKUS: usize = 200;
const SHIPMENTS: usize = 300;
const LIFECYCLE: [&str; 6] = [
    "Created",
    "Assigned",
    "Departed",
    "Arrived",
    "PickedUp",
    "Completed",
];
const CONSUMERS: usize = 8;
/// One processed delivery in this many "crashes" before its ack and is redelivered.
const CRASH_EVERY: u64 = 40;
/// One first handler run in this many fails with a transient database error.
const FAIL_EVERY: u64 = 25;
/// The in-process broker waits this long before a retry when no tier suggests a delay.
const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(5);
/// Generous, because a hot SKU can keep a message lock-busy for a while in this demo.
const MAX_ATTEMPTS: u32 = 64;

/// A small deterministic generator (SplitMix64), so every run tells the same story.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

/// Which route a message is published to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Topic {
    Orders,
    Shipments,
}

/// A message as the in-process broker holds it.
#[derive(Clone)]
struct Message {
    topic: Topic,
    id: String,
    body: Bytes,
    attempt: u32,
    redelivered: bool,
}

impl Message {
    fn new(topic: Topic, id: String, body: impl Into<Bytes>) -> Self {
        Message {
            topic,
            id,
            body: body.into(),
            attempt: 1,
            redelivered: false,
        }
    }

    fn delivery(&self) -> Delivery {
        let queue = match self.topic {
            Topic::Orders => "orders",
            Topic::Shipments => "shipments",
        };
        Delivery::new(Source::new(queue), self.body.clone())
            .with_message_id(self.id.clone())
            .with_attempt(self.attempt)
            .with_redelivered(self.redelivered)
    }

    fn redelivery(mut self) -> Self {
        self.attempt += 1;
        self.redelivered = true;
        self
    }
}

/// What the business side did: the demo's "database".
#[derive(Default)]
struct Ledger {
    deductions: HashMap<String, usize>,
    stock: HashMap<String, i64>,
    applied_states: HashMap<String, Vec<usize>>,
}

/// What the consumers saw.
#[derive(Default)]
struct Tally {
    deliveries: usize,
    redeliveries: usize,
    crashes: usize,
    outcomes: BTreeMap<String, usize>,
    dead_letters: BTreeMap<String, usize>,
}

fn label(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Processed => "processed".into(),
        Outcome::Duplicate { tier } => format!("duplicate, caught by {tier}"),
        Outcome::Stale { .. } => "stale (older state event)".into(),
        Outcome::RetryLater(retry) => match retry.reason {
            oncely::RetryReason::InFlight(tier) => format!("retry later: in flight ({tier})"),
            reason => format!("retry later: {}", reason.code()),
        },
        Outcome::DeadLetter(_) => "dead-lettered".into(),
    }
}

/// The shared broker: a queue, the count of messages not yet acked or dead-lettered, and the
/// tallies.
struct InProcessBroker {
    queue: mpsc::UnboundedSender<Message>,
    unsettled: AtomicUsize,
    tally: Mutex<Tally>,
}

impl InProcessBroker {
    fn publish(&self, message: Message) {
        self.unsettled.fetch_add(1, Ordering::SeqCst);
        self.requeue(message);
    }

    fn requeue(&self, message: Message) {
        // The receiver lives as long as the demo; a send can only fail after it ends.
        let _ = self.queue.send(message);
    }

    fn settle(&self) {
        self.unsettled.fetch_sub(1, Ordering::SeqCst);
    }
}

fn order_body(order: usize, sku: usize, quantity: usize) -> String {
    format!(r#"{{"orderId":"order_{order}","sku":"sku_{sku}","quantity":{quantity}}}"#)
}

fn sku_of(order: usize) -> usize {
    order % SKUS
}

fn quantity_of(order: usize) -> usize {
    1 + order % 3
}

/// Every order once, plus duplicates: producer retries (same id), re-sent orders (new id,
/// same business key) scattered through the stream, and bursts of copies back to back so
/// that several consumers take one order at the same moment.
fn order_traffic(rng: &mut Rng) -> Vec<Vec<Message>> {
    let mut groups = Vec::new();
    for order in 0..ORDERS {
        let body = order_body(order, sku_of(order), quantity_of(order));
        let message = |id: String| Message::new(Topic::Orders, id, body.clone());
        groups.push(vec![message(format!("m-{order}"))]);
        for copy in 0..rng.below(7) {
            let id = if copy % 2 == 0 {
                format!("m-{order}")
            } else {
                format!("m-{order}-resent-{copy}")
            };
            groups.push(vec![message(id)]);
        }
        if order % 5 == 0 {
            groups.push(
                (0..4)
                    .map(|copy| message(format!("m-{order}-burst-{copy}")))
                    .collect(),
            );
        }
    }
    groups
}

/// Every shipment's six lifecycle events, shuffled, some twice.
fn shipment_traffic(rng: &mut Rng) -> Vec<Vec<Message>> {
    let mut groups = Vec::new();
    for shipment in 0..SHIPMENTS {
        for state in LIFECYCLE {
            let body = format!(r#"{{"shipment":"ship_{shipment}","state":"{state}"}}"#);
            let copies = if rng.below(5) == 0 { 2 } else { 1 };
            for copy in 0..copies {
                let id = format!("e-{shipment}-{state}-{copy}");
                groups.push(vec![Message::new(Topic::Shipments, id, body.clone())]);
            }
        }
    }
    groups
}

/// Messages no consumer can ever process.
fn poison_traffic() -> Vec<Vec<Message>> {
    let orders = |id: &str, body: Bytes| vec![Message::new(Topic::Orders, id.into(), body)];
    let long_id = "x".repeat(300);
    vec![
        orders("p-not-json", Bytes::from_static(b"<order id=1/>")),
        orders("p-no-key", Bytes::from_static(br#"{"sku":"sku_1","quantity":1}"#)),
        orders(
            "p-empty-key",
            Bytes::from_static(br#"{"orderId":"","sku":"sku_1","quantity":1}"#),
        ),
        orders("p-not-utf8", Bytes::from_static(b"{\"orderId\":\"\xff\xfe\"}")),
        orders(
            "p-too-long",
            Bytes::from(order_body(0, 1, 1).replace("order_0", &long_id)),
        ),
        vec![Message::new(
            Topic::Shipments,
            "p-unknown-state".into(),
            Bytes::from_static(br#"{"shipment":"ship_0","state":"Teleported"}"#),
        )],
    ]
}

/// Orders whose id was reused by mistake for another payload; published after the originals
/// settled, so the originals are the ones applied.
fn reused_key_traffic() -> Vec<Vec<Message>> {
    (0..5)
        .map(|order| {
            let body = order_body(order, sku_of(order) + 1, 99);
            vec![Message::new(Topic::Orders, format!("p-reused-{order}"), body)]
        })
        .collect()
}

fn order_route(
    ledger: Arc<Mutex<Ledger>>,
    flags: MemoryFlagStore,
) -> Route<
    impl Service<Envelope, Response = Outcome, Error: Into<BoxError>, Future: Send> + Clone + Send + Sync,
> {
    let handler_runs = Arc::new(AtomicUsize::new(0));
    let handler = handler_fn(move |envelope: Envelope| {
        let ledger = ledger.clone();
        let run = handler_runs.fetch_add(1, Ordering::Relaxed) as u64;
        async move {
            tokio::time::sleep(Duration::from_micros(200)).await;
            if envelope.delivery().attempt() == 1 && run % FAIL_EVERY == 7 {
                return Err(HandlerError::transient("database busy"));
            }
            let order: serde_json::Value = serde_json::from_slice(envelope.delivery().body())?;
            let sku = order["sku"].as_str().unwrap_or_default().to_owned();
            let quantity = order["quantity"].as_i64().unwrap_or_default();
            let mut ledger = ledger.lock().expect("ledger lock");
            *ledger.stock.entry(sku).or_default() -= quantity;
            *ledger.deductions.entry(envelope.key().to_string()).or_default() += 1;
            Ok::<(), HandlerError>(())
        }
    });
    let quick = Duration::from_millis(2);
    let stack = ServiceBuilder::new()
        .layer(FlagLayer::new(flags, Duration::from_secs(600)).with_in_flight_delay(quick))
        .layer(
            LockLayer::new(MemoryLockStore::new(), KeyExtractor::json_pointer("/sku")).with_busy_delay(quick),
        )
        .layer(RecordLayer::new(MemoryRecordStore::new()).with_in_flight_delay(quick))
        .service(handler);
    let key = KeyExtractor::json_pointer("/orderId").with_namespace("deduct_stock");
    Route::new("deduct_stock", key, stack).with_max_attempts(MAX_ATTEMPTS)
}

fn shipment_route(
    ledger: Arc<Mutex<Ledger>>,
) -> Route<
    impl Service<Envelope, Response = Outcome, Error: Into<BoxError>, Future: Send> + Clone + Send + Sync,
> {
    let handler = handler_fn(move |envelope: Envelope| {
        let ledger = ledger.clone();
        async move {
            let event: serde_json::Value = serde_json::from_slice(envelope.delivery().body())?;
            let shipment = event["shipment"].as_str().unwrap_or_default().to_owned();
            let state = event["state"].as_str().unwrap_or_default();
            let position = LIFECYCLE.iter().position(|s| *s == state).unwrap_or(usize::MAX);
            let mut ledger = ledger.lock().expect("ledger lock");
            ledger.applied_states.entry(shipment).or_default().push(position);
            Ok::<(), HandlerError>(())
        }
    });
    let machine = StateMachine::forward_only(LIFECYCLE).expect("a valid lifecycle");
    let quick = Duration::from_millis(2);
    let stack = ServiceBuilder::new()
        .layer(
            LockLayer::new(MemoryLockStore::new(), KeyExtractor::json_pointer("/shipment"))
                .with_busy_delay(quick),
        )
        .layer(StateGuardLayer::new(
            MemoryStateStore::new(),
            machine,
            KeyExtractor::json_pointer("/shipment"),
            KeyExtractor::json_pointer("/state"),
        ))
        .layer(RecordLayer::new(MemoryRecordStore::new()).with_in_flight_delay(quick))
        .service(handler);
    let key = KeyExtractor::template("{/shipment}:{/state}").expect("a valid template");
    Route::new("shipment_status", key, stack).with_max_attempts(MAX_ATTEMPTS)
}

/// Consumes until the queue closes: handles each message on its route and settles it with
/// the broker as the outcome says — or "crashes" before the ack now and then.
async fn consume<A, B>(
    broker: Arc<InProcessBroker>,
    queue: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Message>>>,
    orders: Route<A>,
    shipments: Route<B>,
    seed: u64,
) where
    A: Service<Envelope, Response = Outcome, Error: Into<BoxError>, Future: Send> + Clone + Send + 'static,
    B: Service<Envelope, Response = Outcome, Error: Into<BoxError>, Future: Send> + Clone + Send + 'static,
{
    let mut rng = Rng(seed);
    loop {
        let Some(message) = queue.lock().await.recv().await else {
            return;
        };
        let outcome = match message.topic {
            Topic::Orders => orders.handle(message.delivery()).await,
            Topic::Shipments => shipments.handle(message.delivery()).await,
        };
        let crashed = outcome == Outcome::Processed && rng.next().is_multiple_of(CRASH_EVERY);
        {
            let mut tally = broker.tally.lock().expect("tally lock");
            tally.deliveries += 1;
            tally.redeliveries += usize::from(message.redelivered);
            if crashed {
                // The consumer died before its ack reached the broker: the outcome is lost and
                // the broker hands the message out again.
                tally.crashes += 1;
            } else {
                *tally.outcomes.entry(label(&outcome)).or_default() += 1;
            }
            if let Outcome::DeadLetter(dead) = &outcome {
                *tally
                    .dead_letters
                    .entry(dead.reason.code().to_owned())
                    .or_default() += 1;
            }
        }
        match (crashed, outcome.action()) {
            (true, _) => broker.requeue(message.redelivery()),
            (false, BrokerAction::Ack | BrokerAction::DeadLetter(_)) => broker.settle(),
            (false, BrokerAction::Retry { delay }) => {
                let broker = broker.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay.unwrap_or(DEFAULT_RETRY_DELAY)).await;
                    broker.requeue(message.redelivery());
                });
            }
        }
    }
}

async fn drain(broker: &InProcessBroker) {
    while broker.unsettled.load(Ordering::SeqCst) > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn publish_all(broker: &InProcessBroker, groups: Vec<Vec<Message>>) -> usize {
    let mut published = 0;
    for message in groups.into_iter().flatten() {
        broker.publish(message);
        published += 1;
    }
    published
}

#[tokio::main]
async fn main() -> ExitCode {
    let started = Instant::now();
    let mut rng = Rng(2026);
    let (sender, receiver) = mpsc::unbounded_channel();
    let broker = Arc::new(InProcessBroker {
        queue: sender,
        unsettled: AtomicUsize::new(0),
        tally: Mutex::default(),
    });
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let flags = MemoryFlagStore::new();
    let orders = order_route(ledger.clone(), flags.clone());
    let shipments = shipment_route(ledger.clone());

    let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
    let consumers: Vec<_> = (0..CONSUMERS as u64)
        .map(|seed| {
            tokio::spawn(consume(
                broker.clone(),
                receiver.clone(),
                orders.clone(),
                shipments.clone(),
                seed,
            ))
        })
        .collect();

    let mut traffic = order_traffic(&mut rng);
    traffic.extend(shipment_traffic(&mut rng));
    traffic.extend(poison_traffic());
    rng.shuffle(&mut traffic);
    let distinct_bodies = traffic
        .iter()
        .flatten()
        .map(|m| m.body.clone())
        .collect::<HashSet<_>>()
        .len();
    let mut published = publish_all(&broker, traffic);
    let flush = tokio::spawn({
        let broker = broker.clone();
        async move {
            while broker.tally.lock().expect("tally lock").deliveries < published / 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            flags.clear();
        }
    });
    drain(&broker).await;
    flush
        .await
        .expect("the flush task ends once half the traffic is delivered");
    published += publish_all(&broker, reused_key_traffic());
    drain(&broker).await;
    for consumer in consumers {
        consumer.abort();
    }

    let tally = broker.tally.lock().expect("tally lock");
    let ledger = ledger.lock().expect("ledger lock");
    report(
        published,
        published - distinct_bodies,
        &tally,
        &ledger,
        started.elapsed(),
    )
}

fn report(
    published: usize,
    duplicates: usize,
    tally: &Tally,
    ledger: &Ledger,
    elapsed: Duration,
) -> ExitCode {
    println!("oncely quickstart: in-memory stores, in-process broker, {CONSUMERS} consumers\n");
    let row = |name: &str, value: usize| println!("  {name:<44} {value:>7}");
    println!("deliveries");
    row("published", published);
    row("  of which copies of an earlier message", duplicates);
    row("delivered (with redeliveries)", tally.deliveries);
    row("redelivered (retries and crashes)", tally.redeliveries);
    row("consumer crashed after handler, before ack", tally.crashes);
    println!("  (the flag store was flushed once, halfway through)");
    println!("outcomes");
    for (name, count) in &tally.outcomes {
        row(name, *count);
    }
    println!("dead letters by reason");
    for (reason, count) in &tally.dead_letters {
        row(reason, *count);
    }

    let mut failures = Vec::new();
    let applied = ledger.deductions.len();
    let doubled = ledger.deductions.values().filter(|count| **count > 1).count();
    if applied != ORDERS {
        failures.push(format!("{applied} orders deducted, expected {ORDERS}"));
    }
    if doubled > 0 {
        failures.push(format!("{doubled} orders deducted more than once"));
    }
    let expected_stock: i64 = -(0..ORDERS).map(|order| quantity_of(order) as i64).sum::<i64>();
    let stock: i64 = ledger.stock.values().sum();
    if stock != expected_stock {
        failures.push(format!("stock moved by {stock}, expected {expected_stock}"));
    }
    let backwards = ledger
        .applied_states
        .values()
        .filter(|states| states.windows(2).any(|pair| pair[0] >= pair[1]))
        .count();
    let completed = ledger
        .applied_states
        .values()
        .filter(|states| states.last() == Some(&(LIFECYCLE.len() - 1)))
        .count();
    if backwards > 0 {
        failures.push(format!(
            "{backwards} shipments applied a state event out of order"
        ));
    }
    if completed != SHIPMENTS {
        failures.push(format!("{completed} of {SHIPMENTS} shipments reached Completed"));
    }

    println!("business effects");
    row("distinct valid orders", ORDERS);
    row("orders deducted", applied);
    row("orders deducted more than once", doubled);
    row("shipments ending in Completed", completed);
    row("shipments with a state applied out of order", backwards);
    println!("\nfinished in {:.2?}", elapsed);
    if failures.is_empty() {
        println!("PASS: every valid order deducted exactly once; every shipment moved forward only");
        ExitCode::SUCCESS
    } else {
        for failure in failures {
            println!("FAIL: {failure}");
        }
        ExitCode::FAILURE
    }
}
