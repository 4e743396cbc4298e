//! The Redis backends against a real Redis: the store suites, the tiers' promises, the
//! joint flag and lock deciding as the two layers do, and a Redis restart in the middle of
//! a run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use integration_tests::postgres::{BoxedStack, boxed};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{counting_handler, redis_connection, redis_url, unique};
use oncely::flag::{Claim, FlagLayer, FlagState, FlagStore, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, LockLease, LockStore, LockView, RedisLockStore};
use oncely::record::{MemoryRecordStore, RecordLayer, RecordStatus, RecordStore};
use oncely::{
    BrokerAction, BusinessKey, DeadLetterReason, Delivery, Envelope, HandlerError, KeyExtractor, Outcome,
    RetryReason, Route, Tier, Token, handler_fn,
};
use redis::aio::ConnectionManager;
use tower::ServiceBuilder;

async fn flag_store() -> RedisFlagStore<ConnectionManager> {
    RedisFlagStore::new(redis_connection(&redis_url()).await).with_prefix(unique("oncely-test"))
}

async fn lock_store() -> RedisLockStore<ConnectionManager> {
    RedisLockStore::new(redis_connection(&redis_url()).await).with_prefix(unique("oncely-test"))
}

oncely::store_suite!(flag, flag_store);
oncely::store_suite!(lock, lock_store);

fn order(id: &str, sku: &str) -> Delivery {
    let body = format!(r#"{{"orderId":"{id}","sku":"{sku}"}}"#);
    Delivery::new(oncely::Source::new("orders"), body)
}

fn order_key() -> KeyExtractor {
    KeyExtractor::json_pointer("/orderId")
}

fn sku() -> KeyExtractor {
    KeyExtractor::json_pointer("/sku")
}

async fn pttl(connection: &ConnectionManager, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut connection.clone())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_claimers_over_two_connections_one_wins() {
    let prefix = unique("oncely-test");
    let stores = [
        RedisFlagStore::new(redis_connection(&redis_url()).await).with_prefix(prefix.clone()),
        RedisFlagStore::new(redis_connection(&redis_url()).await).with_prefix(prefix),
    ];
    let key = BusinessKey::new("order_1:deduct_stock");
    let claims: Vec<_> = (0..64)
        .map(|i| {
            let (store, key) = (stores[i % 2].clone(), key.clone());
            tokio::spawn(async move {
                store
                    .claim(&key, Token::random(), Duration::from_secs(30))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut won = 0;
    for claim in claims {
        won += usize::from(claim.await.unwrap() == Claim::Won);
    }
    assert_eq!(won, 1);
}

#[tokio::test]
async fn ttls_are_as_configured() {
    let (flags, locks) = (flag_store().await, lock_store().await);
    let raw = redis_connection(&redis_url()).await;
    let flag_key = flags.redis_key(&BusinessKey::new("o-1"));
    let lock_key = locks.redis_key("sku-1");
    let seen = Arc::new(Mutex::new((0, 0)));
    let handler = handler_fn({
        let (raw, flag_key, lock_key, seen) = (raw.clone(), flag_key.clone(), lock_key.clone(), seen.clone());
        move |_: Envelope| {
            let (raw, flag_key, lock_key, seen) =
                (raw.clone(), flag_key.clone(), lock_key.clone(), seen.clone());
            async move {
                *seen.lock().unwrap() = (pttl(&raw, &flag_key).await, pttl(&raw, &lock_key).await);
                Ok::<(), HandlerError>(())
            }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(FlagLayer::new(flags, Duration::from_secs(600)).with_lease(Duration::from_secs(30)))
        .layer(LockLayer::new(locks, sku()).with_lease(Duration::from_secs(3)))
        .service(handler);
    let route = Route::new("orders", order_key(), stack);
    assert_eq!(route.handle(order("o-1", "sku-1")).await, Outcome::Processed);

    let (in_flight, locked) = *seen.lock().unwrap();
    assert!(
        (29_000..=30_000).contains(&in_flight),
        "in-flight lease PTTL {in_flight}"
    );
    assert!((2_000..=3_000).contains(&locked), "lock lease PTTL {locked}");
    let done = pttl(&raw, &flag_key).await;
    assert!(
        (659_000..=660_000).contains(&done),
        "retention PTTL {done}: 10 min window + 1 min margin"
    );
    assert_eq!(pttl(&raw, &lock_key).await, -2, "the lock is released");
}

#[tokio::test]
async fn fencing_tokens_keep_growing_across_a_redis_restart_that_lost_the_counter() {
    let mut server = ScratchRedis::start();
    let locks = RedisLockStore::new(redis_connection(&server.url()).await);
    let mut before = 0;
    for _ in 0..3 {
        let token = Token::random();
        before = locks
            .acquire("sku-1", token, Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        assert!(locks.release("sku-1", token).await.unwrap());
    }
    server.restart();
    // The first command after the restart finds the old connection broken; the connection
    // manager then reconnects.
    let mut acquired = locks
        .acquire("sku-1", Token::random(), Duration::from_secs(5))
        .await;
    if acquired.is_err() {
        acquired = locks
            .acquire("sku-1", Token::random(), Duration::from_secs(5))
            .await;
    }
    let after = acquired.unwrap().expect("the lock is free on an empty Redis");
    assert!(
        after > before,
        "a token after the restart ({after}) is newer than the last one before it ({before}), so a fenced store accepts its holder"
    );
}

#[tokio::test]
async fn the_lock_outlives_its_first_lease_while_the_handler_runs() {
    for composition in [Composition::TwoLayers, Composition::Joint] {
        let (connection, prefix) = (redis_connection(&redis_url()).await, unique("oncely-watchdog"));
        let locks = RedisLockStore::new(connection.clone()).with_prefix(prefix.clone());
        let handler = handler_fn(|_: Envelope| async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok::<(), HandlerError>(())
        });
        let lock = LockLayer::new(locks.clone(), sku()).with_lease(Duration::from_millis(600));
        let stack = match composition {
            Composition::TwoLayers => boxed(ServiceBuilder::new().layer(lock).service(handler)),
            Composition::Joint | Composition::Coalesced => {
                let flags = RedisFlagStore::new(connection).with_prefix(prefix);
                let flag = FlagLayer::new(flags, Duration::from_secs(600));
                boxed(
                    ServiceBuilder::new()
                        .layer(FlagLockLayer::new(flag.with_record_behind(), lock))
                        .service(handler),
                )
            }
        };
        let route = Route::new("orders", order_key(), stack);
        let running = tokio::spawn(async move { route.handle(order("o-1", "sku-1")).await });
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let intruder = locks
            .acquire("sku-1", Token::random(), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(
            intruder, None,
            "{composition:?}: the watchdog renewed the lease past its first 600 ms"
        );
        assert_eq!(running.await.unwrap(), Outcome::Processed);
    }
}

#[tokio::test]
async fn deleting_the_lock_mid_handler_tells_the_handler_and_retries_later() {
    let locks = lock_store().await;
    let raw = redis_connection(&redis_url()).await;
    let told = Arc::new(AtomicUsize::new(0));
    let handler = handler_fn({
        let told = told.clone();
        move |envelope: Envelope| {
            let told = told.clone();
            async move {
                let lease = envelope
                    .extensions()
                    .get::<LockLease>()
                    .cloned()
                    .expect("a lease");
                tokio::select! {
                    () = lease.lost() => {
                        told.fetch_add(1, Ordering::SeqCst);
                        Err(HandlerError::transient("lease lost, stopped"))
                    }
                    () = tokio::time::sleep(Duration::from_secs(10)) => Ok(()),
                }
            }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(locks.clone(), sku()).with_lease(Duration::from_millis(900)))
        .service(handler);
    let route = Route::new("orders", order_key(), stack);
    let running = tokio::spawn(async move { route.handle(order("o-1", "sku-1")).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _: i64 = redis::cmd("DEL")
        .arg(locks.redis_key("sku-1"))
        .query_async(&mut raw.clone())
        .await
        .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome.retry_reason(), Some(RetryReason::LeaseLost));
    assert_eq!(told.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn redis_down_the_flag_fails_open_and_the_lock_fails_closed() {
    let mut server = ScratchRedis::start();
    let connection = redis_connection(&server.url()).await;
    server.kill();
    let records = MemoryRecordStore::new();
    let (effects, handler) = counting_handler();

    let flag_then_record = ServiceBuilder::new()
        .layer(FlagLayer::new(
            RedisFlagStore::new(connection.clone()),
            Duration::from_secs(600),
        ))
        .layer(RecordLayer::new(records.clone()))
        .service(handler.clone());
    let route = Route::new("orders", order_key(), flag_then_record);
    assert_eq!(route.handle(order("o-1", "sku-1")).await, Outcome::Processed);
    assert_eq!(
        route.handle(order("o-1", "sku-1")).await,
        Outcome::Duplicate { tier: Tier::Record }
    );

    let locked = ServiceBuilder::new()
        .layer(LockLayer::new(RedisLockStore::new(connection), sku()))
        .service(handler);
    let route = Route::new("orders", order_key(), locked);
    let outcome = route.handle(order("o-2", "sku-1")).await;
    assert_eq!(
        outcome.retry_reason(),
        Some(RetryReason::StoreUnavailable(Tier::Lock))
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1, "only o-1 ran, once");
}

/// 200 orders, each delivered three times, through flag → lock → record on eight consumers;
/// Redis is killed and restarted empty a third of the way through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_restart_mid_run_applies_no_effect_twice_and_acks_nothing_early() {
    const ORDERS: usize = 200;
    let mut server = ScratchRedis::start();
    let connection = redis_connection(&server.url()).await;
    let records = MemoryRecordStore::new();
    let effects: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let handler = handler_fn({
        let effects = effects.clone();
        move |envelope: Envelope| {
            let effects = effects.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                *effects
                    .lock()
                    .unwrap()
                    .entry(envelope.key().to_string())
                    .or_default() += 1;
                Ok::<(), HandlerError>(())
            }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(
            FlagLayer::new(RedisFlagStore::new(connection.clone()), Duration::from_secs(600))
                .with_in_flight_delay(Duration::from_millis(10)),
        )
        .layer(
            LockLayer::new(RedisLockStore::new(connection), sku())
                .with_lease(Duration::from_millis(900))
                .with_busy_delay(Duration::from_millis(10)),
        )
        .layer(RecordLayer::new(records.clone()).with_in_flight_delay(Duration::from_millis(10)))
        .service(handler);
    let route = Route::new("orders", order_key(), stack).with_max_attempts(10_000);

    let mut deliveries: Vec<(u64, Delivery)> = (0..ORDERS * 3)
        .map(|i| {
            let order_id = i % ORDERS;
            let position = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (
                position,
                order(&format!("o-{order_id}"), &format!("sku-{}", order_id % 20)),
            )
        })
        .collect();
    deliveries.sort_by_key(|(position, _)| *position);

    let (queue, receiver) = tokio::sync::mpsc::unbounded_channel::<Delivery>();
    let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
    for (_, delivery) in deliveries {
        queue.send(delivery).unwrap();
    }
    let settled = Arc::new(AtomicUsize::new(0));
    let acked_before_effect = Arc::new(AtomicUsize::new(0));
    let dead_letters = Arc::new(AtomicUsize::new(0));
    let caught_by_record = Arc::new(AtomicUsize::new(0));
    let consumers: Vec<_> = (0..8)
        .map(|_| {
            let (route, queue, receiver) = (route.clone(), queue.clone(), receiver.clone());
            let (effects, settled) = (effects.clone(), settled.clone());
            let (acked_before_effect, dead_letters) = (acked_before_effect.clone(), dead_letters.clone());
            let caught_by_record = caught_by_record.clone();
            tokio::spawn(async move {
                loop {
                    let Some(delivery) = receiver.lock().await.recv().await else {
                        return;
                    };
                    let outcome = route.handle(delivery.clone()).await;
                    if outcome == (Outcome::Duplicate { tier: Tier::Record }) {
                        caught_by_record.fetch_add(1, Ordering::SeqCst);
                    }
                    match outcome.action() {
                        BrokerAction::Ack => {
                            let key = order_key().extract(&delivery).unwrap().to_string();
                            if effects.lock().unwrap().get(&key).copied().unwrap_or(0) == 0 {
                                acked_before_effect.fetch_add(1, Ordering::SeqCst);
                            }
                            settled.fetch_add(1, Ordering::SeqCst);
                        }
                        BrokerAction::DeadLetter(_) => {
                            dead_letters.fetch_add(1, Ordering::SeqCst);
                            settled.fetch_add(1, Ordering::SeqCst);
                        }
                        BrokerAction::Retry { .. } => {
                            let queue = queue.clone();
                            let attempt = delivery.attempt() + 1;
                            tokio::spawn(async move {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                let _ = queue.send(delivery.with_attempt(attempt).with_redelivered(true));
                            });
                        }
                    }
                }
            })
        })
        .collect();

    while settled.load(Ordering::SeqCst) < ORDERS {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.restart();
    tokio::time::timeout(Duration::from_secs(120), async {
        while settled.load(Ordering::SeqCst) < ORDERS * 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every delivery settles after the restart");
    for consumer in consumers {
        consumer.abort();
    }

    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), ORDERS, "every order applied");
    assert!(
        effects.values().all(|count| *count == 1),
        "no order applied twice"
    );
    assert_eq!(
        acked_before_effect.load(Ordering::SeqCst),
        0,
        "no delivery acked before its effect"
    );
    assert_eq!(dead_letters.load(Ordering::SeqCst), 0);
    assert!(
        caught_by_record.load(Ordering::SeqCst) > 0,
        "the restart emptied the flag, so the record caught later copies"
    );
    for order_id in 0..ORDERS {
        let record = records
            .get(&BusinessKey::new(format!("o-{order_id}")))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(record.status, RecordStatus::Success);
    }
}

/// Two consumer "processes" (routes) share one Redis delivery counter: deliveries cut off in
/// either count toward the key's limit, as crashes of either process would — the first,
/// among others, as the mark that makes it a suspect, the next three, alone, against it.
#[tokio::test]
async fn the_redis_delivery_counter_dead_letters_a_key_that_kills_every_consumer() {
    let prefix = unique("oncely-test-deliveries");
    let connection = redis_connection(&redis_url()).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let route = |counted: Arc<AtomicUsize>| {
        let handler = handler_fn(move |_envelope: Envelope| {
            counted.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<(), HandlerError>>()
        });
        Route::new("orders", order_key(), handler).with_delivery_limit(
            oncely::deliveries::RedisDeliveryCounter::new(connection.clone()).with_prefix(prefix.as_str()),
            3,
        )
    };
    let (first, second) = (route(runs.clone()), route(runs.clone()));
    for route in [&first, &second, &first, &second] {
        let cut = tokio::time::timeout(Duration::from_millis(100), route.handle(order("poison", "A"))).await;
        assert!(cut.is_err(), "the delivery hangs until its consumer dies");
    }
    let outcome = tokio::time::timeout(Duration::from_secs(5), first.handle(order("poison", "A")))
        .await
        .expect("answered without running");
    assert_eq!(
        outcome.dead_letter_reason(),
        Some(oncely::DeadLetterReason::DeliveryLimit),
        "{outcome}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// How a differential test composes the flag and the lock.
#[derive(Clone, Copy, Debug)]
enum Composition {
    /// `FlagLayer` in front of `LockLayer`: four round trips.
    TwoLayers,
    /// `FlagLockLayer`: the same decisions in two.
    Joint,
    /// `FlagLockLayer` with coalescing: the same two, as one-delivery script calls.
    Coalesced,
}

/// One step of a differential scenario.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Deliver `{"orderId": order, "sku": sku, "do": what}` (no `sku` when it is empty);
    /// the handler succeeds (`ok`), fails (`fail`) or deletes its lock first (`lose_lock`).
    Deliver(&'static str, &'static str, &'static str),
    /// Another delivery claims the order's flag (and never settles it).
    HoldFlag(&'static str),
    /// Another delivery holds the entity's lock.
    HoldLock(&'static str),
    /// That other delivery's lock expires.
    FreeLock(&'static str),
}

/// What one delivery left: its outcome, the order's flag marker and the seconds it has
/// left (rounded up), whether the entity is locked and for how long, whether its fencing
/// counter moved, and what the handler saw (if it ran).
#[derive(Debug, PartialEq)]
struct Observed {
    outcome: Outcome,
    flag: FlagState,
    flag_ttl: Option<u64>,
    locked: bool,
    lock_ttl: Option<u64>,
    fenced: bool,
    /// The flag marker, its seconds left and the lock's, as the handler saw them.
    while_running: Option<(FlagState, Option<u64>, Option<u64>)>,
}

fn seconds_left(ttl: Option<Duration>) -> Option<u64> {
    ttl.map(|ttl| ttl.as_secs_f64().ceil() as u64)
}

/// Runs `steps` through the flag (with the record behind it when `record_behind`) and the
/// lock on `sku`, composed as `composition`, on keys of their own.
async fn observe(composition: Composition, record_behind: bool, steps: &[Step]) -> Vec<Observed> {
    let connection = redis_connection(&redis_url()).await;
    let prefix = unique("oncely-joint");
    let flags = RedisFlagStore::new(connection.clone()).with_prefix(prefix.clone());
    let locks = RedisLockStore::new(connection.clone()).with_prefix(prefix);
    let while_running = Arc::new(Mutex::new(None));
    let handler = handler_fn({
        let (flags, locks, connection) = (flags.clone(), locks.clone(), connection.clone());
        let while_running = while_running.clone();
        move |envelope: Envelope| {
            let (flags, locks, mut connection) = (flags.clone(), locks.clone(), connection.clone());
            let while_running = while_running.clone();
            async move {
                let body: serde_json::Value = serde_json::from_slice(envelope.delivery().body()).unwrap();
                let entity = body["sku"].as_str().unwrap_or_default();
                let (flag, lock) = (
                    flags.inspect(envelope.key()).await.unwrap(),
                    locks.inspect(entity).await.unwrap(),
                );
                *while_running.lock().unwrap() =
                    Some((flag.state, seconds_left(flag.ttl), seconds_left(lock.ttl)));
                match body["do"].as_str() {
                    Some("fail") => return Err(HandlerError::transient("the downstream is down")),
                    Some("lose_lock") => {
                        let lock = locks.redis_key(entity);
                        let _: i64 = redis::cmd("DEL")
                            .arg(lock)
                            .query_async(&mut connection)
                            .await
                            .unwrap();
                    }
                    _ => {}
                }
                Ok::<(), HandlerError>(())
            }
        }
    });
    // Leases and retention all different, so that a script setting one for another shows.
    let flag = FlagLayer::new(flags.clone(), Duration::from_secs(600)).with_lease(Duration::from_secs(30));
    let flag = if record_behind {
        flag.with_record_behind()
    } else {
        flag
    };
    let lock = LockLayer::new(locks.clone(), sku()).with_lease(Duration::from_secs(7));
    let stack = match composition {
        Composition::TwoLayers => boxed(ServiceBuilder::new().layer(flag).layer(lock).service(handler)),
        Composition::Joint => boxed(
            ServiceBuilder::new()
                .layer(FlagLockLayer::new(flag, lock))
                .service(handler),
        ),
        Composition::Coalesced => boxed(
            ServiceBuilder::new()
                .layer(FlagLockLayer::new(flag, lock).with_coalescing(16, 2))
                .service(handler),
        ),
    };
    let route = Route::new("orders", order_key(), stack);
    let mut observed = Vec::new();
    for step in steps {
        match *step {
            Step::Deliver(order, sku, what) => {
                let fence = |view: LockView| view.fencing_counter;
                let before = fence(locks.inspect(sku).await.unwrap());
                let body = match sku {
                    "" => format!(r#"{{"orderId":"{order}","do":"{what}"}}"#),
                    _ => format!(r#"{{"orderId":"{order}","sku":"{sku}","do":"{what}"}}"#),
                };
                let outcome = route
                    .handle(Delivery::new(oncely::Source::new("orders"), body))
                    .await;
                let (lock, flag) = (
                    locks.inspect(sku).await.unwrap(),
                    flags.inspect(&BusinessKey::new(order)).await.unwrap(),
                );
                observed.push(Observed {
                    outcome,
                    flag: flag.state,
                    flag_ttl: seconds_left(flag.ttl),
                    locked: lock.holder.is_some(),
                    lock_ttl: seconds_left(lock.ttl),
                    fenced: fence(lock) != before,
                    while_running: while_running.lock().unwrap().take(),
                });
            }
            Step::HoldFlag(order) => {
                let key = BusinessKey::new(order);
                let claim = flags.claim(&key, Token::random(), Duration::from_secs(30)).await;
                assert_eq!(claim.unwrap(), Claim::Won);
            }
            Step::HoldLock(sku) => {
                let acquired = locks.acquire(sku, Token::random(), Duration::from_secs(30)).await;
                assert!(acquired.unwrap().is_some());
            }
            Step::FreeLock(sku) => {
                let _: i64 = redis::cmd("DEL")
                    .arg(locks.redis_key(sku))
                    .query_async(&mut connection.clone())
                    .await
                    .unwrap();
            }
        }
    }
    observed
}

/// `steps` through every composition: the joint tier, coalesced or not, must leave every
/// outcome and every key as the two layers do. Returns the two layers' observations, for
/// the expectations.
async fn same_in_both(record_behind: bool, steps: &[Step]) -> Vec<Observed> {
    let two_layers = observe(Composition::TwoLayers, record_behind, steps).await;
    for composition in [Composition::Joint, Composition::Coalesced] {
        let joint = observe(composition, record_behind, steps).await;
        assert_eq!(
            joint, two_layers,
            "{composition:?}, record behind: {record_behind}, steps: {steps:?}"
        );
    }
    two_layers
}

fn is_done(flag: &FlagState) -> bool {
    matches!(flag, FlagState::Done { .. })
}

#[tokio::test]
async fn the_joint_flag_and_lock_decide_as_the_two_layers_on_the_happy_path_and_duplicates() {
    for record_behind in [false, true] {
        let seen = same_in_both(
            record_behind,
            &[
                Step::Deliver("o-1", "sku-1", "ok"),
                Step::Deliver("o-1", "sku-1", "ok"),
                Step::Deliver("o-1", "sku-1", "ok-but-another-payload"),
            ],
        )
        .await;
        assert_eq!(seen[0].outcome, Outcome::Processed);
        assert!(is_done(&seen[0].flag) && !seen[0].locked && seen[0].fenced);
        assert_eq!(
            seen[0].flag_ttl,
            Some(660),
            "the done marker's retention: the window + 1 min"
        );
        // With a record behind, the flag claims nothing: it only read the marker.
        let flag_while_running = match record_behind {
            false => (FlagState::InFlight, Some(30)),
            true => (FlagState::Absent, None),
        };
        assert_eq!(
            seen[0].while_running,
            Some((flag_while_running.0, flag_while_running.1, Some(7))),
            "the claim's and the lock's leases, as configured"
        );
        assert_eq!(seen[1].outcome, Outcome::Duplicate { tier: Tier::Flag });
        assert!(
            !seen[1].fenced,
            "a duplicate the flag answers never takes the lock"
        );
        assert_eq!(
            seen[2].outcome.dead_letter_reason(),
            Some(DeadLetterReason::PayloadMismatch)
        );
        assert!(!seen[2].fenced);
    }
}

#[tokio::test]
async fn the_joint_flag_and_lock_decide_as_the_two_layers_when_a_key_is_in_flight_elsewhere() {
    let alone = same_in_both(
        false,
        &[Step::HoldFlag("o-2"), Step::Deliver("o-2", "sku-1", "ok")],
    )
    .await;
    assert_eq!(
        alone[0].outcome.retry_reason(),
        Some(RetryReason::InFlight(Tier::Flag))
    );
    assert_eq!((alone[0].flag, alone[0].fenced), (FlagState::InFlight, false));

    let behind_a_record = same_in_both(
        true,
        &[Step::HoldFlag("o-2"), Step::Deliver("o-2", "sku-1", "ok")],
    )
    .await;
    assert_eq!(behind_a_record[0].outcome, Outcome::Processed);
    assert!(is_done(&behind_a_record[0].flag) && behind_a_record[0].fenced);
}

#[tokio::test]
async fn the_joint_flag_and_lock_decide_as_the_two_layers_when_the_entity_is_busy() {
    for record_behind in [false, true] {
        let seen = same_in_both(
            record_behind,
            &[
                Step::HoldLock("sku-2"),
                Step::Deliver("o-3", "sku-2", "ok"),
                Step::HoldFlag("o-9"),
                Step::Deliver("o-9", "sku-2", "ok"),
                Step::FreeLock("sku-2"),
                Step::Deliver("o-3", "sku-2", "ok"),
            ],
        )
        .await;
        assert_eq!(seen[0].outcome.retry_reason(), Some(RetryReason::LockBusy));
        assert_eq!(
            seen[0].flag,
            FlagState::Absent,
            "no claim is left behind a busy lock"
        );
        assert!(seen[0].locked && !seen[0].fenced);
        // Another delivery's claim: it stops the delivery, or goes on to the busy lock.
        let stopped_or_busy = if record_behind {
            RetryReason::LockBusy
        } else {
            RetryReason::InFlight(Tier::Flag)
        };
        assert_eq!(seen[1].outcome.retry_reason(), Some(stopped_or_busy));
        assert_eq!((seen[1].flag, seen[1].flag_ttl), (FlagState::InFlight, Some(30)));
        assert_eq!(seen[2].outcome, Outcome::Processed);
    }
}

#[tokio::test]
async fn the_joint_flag_and_lock_decide_as_the_two_layers_when_the_handler_fails_or_the_lock_is_lost() {
    for record_behind in [false, true] {
        let seen = same_in_both(
            record_behind,
            &[
                Step::Deliver("o-4", "sku-3", "fail"),
                Step::Deliver("o-5", "sku-3", "lose_lock"),
                Step::HoldFlag("o-6"),
                Step::Deliver("o-6", "sku-3", "lose_lock"),
                Step::Deliver("o-4", "sku-3", "ok"),
            ],
        )
        .await;
        assert_eq!(seen[0].outcome.retry_reason(), Some(RetryReason::HandlerFailed));
        assert_eq!((seen[0].flag, seen[0].locked), (FlagState::Absent, false));
        assert_eq!(seen[1].outcome.retry_reason(), Some(RetryReason::LeaseLost));
        assert_eq!(
            seen[1].flag,
            FlagState::Absent,
            "a lost lease releases the claim, or marks nothing done"
        );
        // Another delivery's claim stays as it was: stopped in flight, or left alone by a
        // copy that went on to the record without it.
        assert_eq!(seen[2].flag, FlagState::InFlight);
        let lost_or_stopped = if record_behind {
            RetryReason::LeaseLost
        } else {
            RetryReason::InFlight(Tier::Flag)
        };
        assert_eq!(seen[2].outcome.retry_reason(), Some(lost_or_stopped));
        assert_eq!(seen[3].outcome, Outcome::Processed);
    }
}

#[tokio::test]
async fn the_joint_flag_and_lock_decide_as_the_two_layers_for_a_delivery_without_an_entity() {
    for record_behind in [false, true] {
        let seen = same_in_both(
            record_behind,
            &[
                Step::Deliver("o-7", "", "ok"),
                Step::Deliver("o-8", "sku-4", "ok"),
                Step::Deliver("o-8", "", "ok"),
            ],
        )
        .await;
        assert_eq!(
            seen[0].outcome.dead_letter_reason(),
            Some(DeadLetterReason::InvalidKey)
        );
        assert_eq!(seen[0].flag, FlagState::Absent);
        assert_eq!(seen[1].outcome, Outcome::Processed);
        // The flag answers before the lock looks for the entity.
        assert_eq!(
            seen[2].outcome.dead_letter_reason(),
            Some(DeadLetterReason::PayloadMismatch)
        );
    }
}

#[tokio::test]
async fn redis_down_the_joint_flag_and_lock_fails_closed_and_names_itself() {
    let mut server = ScratchRedis::start();
    let connection = redis_connection(&server.url()).await;
    server.kill();
    let (ran, handler) = counting_handler();
    let flag = FlagLayer::new(RedisFlagStore::new(connection.clone()), Duration::from_secs(600));
    let lock = LockLayer::new(RedisLockStore::new(connection), sku());
    let stack = ServiceBuilder::new()
        .layer(FlagLockLayer::new(flag, lock))
        .service(handler);
    let outcome = Route::new("orders", order_key(), stack)
        .handle(order("o-1", "sku-1"))
        .await;
    assert_eq!(
        outcome.retry_reason(),
        Some(RetryReason::StoreUnavailable(Tier::FlagLock))
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// A real Redis connection that counts the commands sent through it (how many calls the
/// coalesced tier made: a fallback to commands per delivery counts too), and can hold the
/// first script back for a while, so that the deliveries behind it gather into the next
/// call.
#[derive(Clone)]
struct Counted {
    connection: ConnectionManager,
    commands: Arc<AtomicUsize>,
    script_sent: Arc<AtomicBool>,
    hold_first: Option<Duration>,
}

impl Counted {
    async fn new(hold_first: Option<Duration>) -> Self {
        Counted {
            connection: redis_connection(&redis_url()).await,
            commands: Arc::default(),
            script_sent: Arc::default(),
            hold_first,
        }
    }
}

impl redis::aio::ConnectionLike for Counted {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        let script = matches!(
            cmd.args_iter().next(),
            Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"EVALSHA")
        );
        self.commands.fetch_add(1, Ordering::SeqCst);
        let first = script && !self.script_sent.swap(true, Ordering::SeqCst);
        let hold = self.hold_first.filter(|_| first);
        let connection = &mut self.connection;
        Box::pin(async move {
            if let Some(hold) = hold {
                tokio::time::sleep(hold).await;
            }
            connection.req_packed_command(cmd).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.connection.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.connection.get_db()
    }
}

/// Sends every delivery of `orders` at once through `route`, and again each one answered
/// with a retry, until none is: the outcomes each copy ended with, per order.
async fn deliver_until_settled(
    route: Arc<Route<BoxedStack>>,
    orders: Vec<Delivery>,
) -> HashMap<String, Vec<Outcome>> {
    let mut pending = orders;
    let mut settled: HashMap<String, Vec<Outcome>> = HashMap::new();
    for _ in 0..100 {
        let sent: Vec<_> = (pending.drain(..))
            .map(|delivery| {
                let route = route.clone();
                tokio::spawn(async move { (delivery.clone(), route.handle(delivery).await) })
            })
            .collect();
        for handle in sent {
            let (delivery, outcome) = handle.await.unwrap();
            if matches!(outcome, Outcome::RetryLater(_)) {
                pending.push(delivery);
            } else {
                let body: serde_json::Value = serde_json::from_slice(delivery.body()).unwrap();
                let order = body["orderId"].as_str().unwrap().to_owned();
                settled.entry(order).or_default().push(outcome);
            }
        }
        if pending.is_empty() {
            return settled;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} deliveries still retried after 100 rounds", pending.len());
}

/// The shared Redis's clock in microseconds, as the lock seeds a new fencing counter.
async fn server_micros() -> u64 {
    let mut connection = redis_connection(&redis_url()).await;
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut connection).await.unwrap();
    seconds * 1_000_000 + micros
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn coalesced_copies_of_one_order_in_one_script_call_run_the_handler_once() {
    let counted = Counted::new(None).await;
    let commands = counted.commands.clone();
    let prefix = unique("oncely-coalesced");
    let flags = RedisFlagStore::new(counted.clone()).with_prefix(prefix.clone());
    let locks = RedisLockStore::new(counted).with_prefix(prefix.clone());
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let handler = handler_fn({
        let runs = runs.clone();
        move |envelope: Envelope| {
            *runs
                .lock()
                .unwrap()
                .entry(envelope.key().to_string())
                .or_default() += 1;
            async {
                // Long enough that copies and other orders are in flight together.
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<(), HandlerError>(())
            }
        }
    });
    let flag = FlagLayer::new(flags.clone(), Duration::from_secs(600));
    let lock = LockLayer::new(locks.clone(), sku());
    let stack = ServiceBuilder::new()
        .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
        .service(handler);
    let route = Arc::new(Route::new("orders", order_key(), boxed(stack)));
    // Every order three times at once, each on an entity of its own, and two orders on one
    // shared entity, so a call holds copies of one key and deliveries of one entity.
    let mut orders = Vec::new();
    for _copy in 0..3 {
        for n in 0..40 {
            orders.push(order(&format!("o-{n}"), &format!("sku-{n}")));
        }
        orders.push(order("shared-a", "sku-shared"));
        orders.push(order("shared-b", "sku-shared"));
    }
    let deliveries = orders.len();
    let clock_before = server_micros().await;
    let settled = deliver_until_settled(route, orders).await;
    let called = commands.load(Ordering::SeqCst);

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 42, "{runs:?}");
    assert!(
        runs.values().all(|&ran| ran == 1),
        "a handler ran twice: {runs:?}"
    );
    for (order, outcomes) in &settled {
        let processed = outcomes
            .iter()
            .filter(|outcome| **outcome == Outcome::Processed)
            .count();
        let duplicates = outcomes
            .iter()
            .filter(|outcome| **outcome == Outcome::Duplicate { tier: Tier::Flag })
            .count();
        assert_eq!((processed, duplicates), (1, 2), "{order}: {outcomes:?}");
        let flag = flags.inspect(&BusinessKey::new(order.as_str())).await.unwrap();
        assert!(is_done(&flag.state), "{order}: {flag:?}");
    }
    for entity in (0..40)
        .map(|n| format!("sku-{n}"))
        .chain(["sku-shared".to_owned()])
    {
        let lock = locks.inspect(&entity).await.unwrap();
        assert_eq!(lock.holder, None, "{entity}");
        // A new entity's counter starts from Redis's clock, not from 1 (how many reads of the
        // clock a call takes is the next test's).
        let fence = lock.fencing_counter.expect("a fencing counter");
        assert!(
            fence > clock_before,
            "{entity}: fencing counter {fence} not seeded from Redis's clock ({clock_before} µs before)"
        );
    }
    // Uncoalesced, every delivery makes one claim call and each one let on a settle call.
    assert!(
        called < deliveries / 3,
        "{called} commands for {deliveries} deliveries and their retries: not coalesced"
    );
}

/// A coalesced call that acquires the locks of many new entities reads Redis's clock once
/// for their fencing counters' seed, not once per entity, as the lock's script promises:
/// counted on a Redis of the test's own, whose command statistics no other test touches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_coalesced_call_seeds_new_fencing_counters_from_one_read_of_the_clock() {
    let server = ScratchRedis::start();
    let connection = redis_connection(&server.url()).await;
    let locks = RedisLockStore::new(connection.clone());
    let flag = FlagLayer::new(RedisFlagStore::new(connection.clone()), Duration::from_secs(600));
    let stack = ServiceBuilder::new()
        .layer(
            FlagLockLayer::new(flag.with_record_behind(), LockLayer::new(locks.clone(), sku()))
                .with_coalescing(64, 1),
        )
        .service(handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) }));
    let route = Arc::new(Route::new("orders", order_key(), boxed(stack)));
    let entities = 40;
    let orders = (0..entities)
        .map(|n| order(&format!("o-{n}"), &format!("sku-{n}")))
        .collect();
    let settled = deliver_until_settled(route, orders).await;
    assert_eq!(settled.len(), entities);

    for n in 0..entities {
        let fence = locks.inspect(&format!("sku-{n}")).await.unwrap().fencing_counter;
        assert!(
            fence.is_some_and(|fence| fence > 1_000_000),
            "sku-{n}: {fence:?} not seeded from the clock"
        );
    }
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut connection.clone())
        .await
        .unwrap();
    let clock_reads: usize = stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_time:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap());
    // The first delivery finds the slot free and goes alone; the others share the next calls.
    assert!(
        (1..=entities / 8).contains(&clock_reads),
        "{clock_reads} reads of the clock for {entities} new entities: not one per call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_of_another_type_fails_its_own_delivery_only_in_a_coalesced_call() {
    let connection = redis_connection(&redis_url()).await;
    // The first delivery's claim is held back, so the 32 sent next share one call.
    let counted = Counted::new(Some(Duration::from_millis(300))).await;
    let (commands, script_sent) = (counted.commands.clone(), counted.script_sent.clone());
    let prefix = unique("oncely-coalesced");
    let flags = RedisFlagStore::new(counted.clone()).with_prefix(prefix.clone());
    let locks = RedisLockStore::new(counted).with_prefix(prefix);
    // Someone else wrote a hash under the flag's key of one order: GET fails on it.
    let _: i64 = redis::cmd("HSET")
        .arg(flags.redis_key(&BusinessKey::new("o-hash")))
        .arg("field")
        .arg("value")
        .query_async(&mut connection.clone())
        .await
        .unwrap();
    let (ran, handler) = counting_handler();
    let flag = FlagLayer::new(flags, Duration::from_secs(600));
    let lock = LockLayer::new(locks.clone(), sku());
    let stack = ServiceBuilder::new()
        .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
        .service(handler);
    let route = Arc::new(Route::new("orders", order_key(), stack));
    let send = |delivery: Delivery| {
        let route = route.clone();
        tokio::spawn(async move { route.handle(delivery).await })
    };
    let first = send(order("o-first", "sku-first"));
    while !script_sent.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The key of another type in the middle of the call: deliveries before and after it.
    let sent: Vec<_> = (0..32)
        .map(|n| match n {
            16 => order("o-hash", "sku-hash"),
            _ => order(&format!("o-{n}"), &format!("sku-{n}")),
        })
        .map(send)
        .collect();
    assert_eq!(first.await.unwrap(), Outcome::Processed);
    let mut outcomes = Vec::new();
    for handle in sent {
        outcomes.push(handle.await.unwrap());
    }
    let hash = outcomes.remove(16);
    assert!(
        outcomes.iter().all(|outcome| *outcome == Outcome::Processed),
        "{outcomes:?}"
    );
    assert_eq!(
        hash.retry_reason(),
        Some(RetryReason::StoreUnavailable(Tier::FlagLock))
    );
    assert_eq!(ran.load(Ordering::SeqCst), 32);
    assert_eq!(locks.inspect("sku-hash").await.unwrap().holder, None);
    // Redis Cluster's probe, the held call, one or two for the 32 behind it, their settles,
    // and a script load after each script's first NOSCRIPT: alone, the 33 would have made
    // 65.
    let called = commands.load(Ordering::SeqCst);
    assert!(
        called < 16,
        "{called} commands: the deliveries did not share calls"
    );
}
