//! The lock tier on its in-memory store.

mod common;

use std::time::Duration;

use common::{Effects, count, handle_concurrently, order};
use oncely::lock::{LockLayer, LockLease, LockStore, MemoryLockStore};
use oncely::{
    DeadLetterReason, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, StoreError, Token,
    handler_fn,
};
use tower::ServiceBuilder;

fn sku() -> KeyExtractor {
    KeyExtractor::json_pointer("/sku")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_entity_is_handled_by_one_delivery_at_a_time() {
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(MemoryLockStore::new(), sku()))
        .service(effects.handler(Duration::from_millis(20), 0));
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let deliveries = (0..32).map(|i| order(&format!("o-{i}"), "sku-1")).collect();
    let outcomes = handle_concurrently(&route, deliveries).await;

    assert_eq!(effects.max_concurrency(), 1);
    let processed = count(&outcomes, |o| *o == Outcome::Processed);
    let busy = count(&outcomes, |o| o.retry_reason() == Some(RetryReason::LockBusy));
    assert!(processed >= 1);
    assert_eq!(processed + busy, 32);
    assert_eq!(effects.total(), processed);
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_keeps_the_lock_while_a_long_handler_runs() {
    let store = MemoryLockStore::new();
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(store.clone(), sku()).with_lease(Duration::from_secs(3)))
        .service(effects.handler(Duration::from_secs(10), 0));
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let long = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("o-1", "sku-1")).await }
    });
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        store
            .acquire("sku-1", Token::random(), Duration::from_secs(3))
            .await
            .unwrap(),
        None
    );
    assert_eq!(long.await.unwrap(), Outcome::Processed);
    assert!(
        store
            .acquire("sku-1", Token::random(), Duration::from_secs(3))
            .await
            .unwrap()
            .is_some()
    );
}

/// The watchdog runs in the delivery's future: a delivery cut off (a timeout in front, a
/// shutdown) stops renewing, and its lock expires with its lease.
#[tokio::test(start_paused = true)]
async fn a_dropped_delivery_stops_renewing_and_its_lock_expires_with_its_lease() {
    let store = MemoryLockStore::new();
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(store.clone(), sku()).with_lease(Duration::from_secs(3)))
        .service(effects.handler(Duration::from_secs(100), 0));
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let cut = tokio::time::timeout(Duration::from_secs(5), route.handle(order("o-1", "sku-1"))).await;
    assert!(cut.is_err(), "the handler outlasts the timeout");
    let taken = store
        .acquire("sku-1", Token::random(), Duration::from_secs(3))
        .await;
    assert_eq!(taken.unwrap(), None, "renewed until the delivery was dropped");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let taken = store
        .acquire("sku-1", Token::random(), Duration::from_secs(3))
        .await;
    assert!(
        taken.unwrap().is_some(),
        "no renewal after the drop: the lock expired with its lease"
    );
}

/// A handler whose I/O is always ready spends its task's Tokio budget on every turn; the
/// watchdog, in the same task, still renews the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_always_ready_does_not_starve_the_watchdog() {
    let store = MemoryLockStore::new();
    let busy = handler_fn(|_: Envelope| async {
        let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        sender.send(()).unwrap();
        let started = tokio::time::Instant::now();
        while started.elapsed() < Duration::from_millis(1_500) {
            receiver.recv().await;
            sender.send(()).unwrap();
        }
        Ok::<(), HandlerError>(())
    });
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(store.clone(), sku()).with_lease(Duration::from_millis(300)))
        .service(busy);
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let running = tokio::spawn(async move { route.handle(order("o-1", "sku-1")).await });
    tokio::time::sleep(Duration::from_millis(900)).await;
    let intruder = store
        .acquire("sku-1", Token::random(), Duration::from_secs(1))
        .await;
    assert_eq!(intruder.unwrap(), None, "renewed past three leases");
    assert_eq!(running.await.unwrap(), Outcome::Processed);
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_tells_the_handler_and_is_never_acked() {
    let store = MemoryLockStore::new();
    let handler = handler_fn(|envelope: Envelope| async move {
        let lease = envelope
            .extensions()
            .get::<LockLease>()
            .expect("the lock hands its lease on")
            .clone();
        tokio::select! {
            () = lease.lost() => Err(HandlerError::transient("stopped: lease lost")),
            () = tokio::time::sleep(Duration::from_secs(60)) => Ok(()),
        }
    });
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(store.clone(), sku()).with_lease(Duration::from_secs(3)))
        .service(handler);
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let running = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("o-1", "sku-1")).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.force_release("sku-1");
    let outcome = tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome.retry_reason(), Some(RetryReason::LeaseLost));
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_ignores_the_lost_lease_still_gets_retry_later() {
    let store = MemoryLockStore::new();
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(store.clone(), sku()).with_lease(Duration::from_secs(3)))
        .service(effects.handler(Duration::from_secs(5), 0));
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let running = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("o-1", "sku-1")).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.force_release("sku-1");
    let outcome = running.await.unwrap();
    assert_eq!(outcome.retry_reason(), Some(RetryReason::LeaseLost));
}

/// A lock store whose renewals answer after `renew_delay`, or never (`None`: a Redis that
/// stopped answering), and whose releases fail when the renewals never answer.
#[derive(Clone)]
struct SlowRenewals {
    store: MemoryLockStore,
    renew_delay: Option<Duration>,
}

impl LockStore for SlowRenewals {
    async fn acquire(&self, entity: &str, token: Token, lease: Duration) -> Result<Option<u64>, StoreError> {
        self.store.acquire(entity, token, lease).await
    }

    async fn renew(&self, entity: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let Some(delay) = self.renew_delay else {
            return std::future::pending().await;
        };
        tokio::time::sleep(delay).await;
        self.store.renew(entity, token, lease).await
    }

    async fn release(&self, entity: &str, token: Token) -> Result<bool, StoreError> {
        match self.renew_delay {
            Some(_) => self.store.release(entity, token).await,
            None => Err(StoreError::new("connection refused")),
        }
    }
}

/// Runs a 10-second handler under a 3-second lease on `store`: the outcome, and when (from
/// the start) the handler was told its lease was lost, if it was.
async fn through_a_long_handler(store: SlowRenewals) -> (Outcome, Option<Duration>) {
    let started = tokio::time::Instant::now();
    let told = std::sync::Arc::new(std::sync::Mutex::new(None));
    let handler = handler_fn({
        let told = told.clone();
        move |envelope: Envelope| {
            let lease = envelope.extensions().get::<LockLease>().cloned();
            let told = told.clone();
            async move {
                let lease = lease.expect("the lock hands its lease on");
                tokio::select! {
                    () = lease.lost() => *told.lock().unwrap() = Some(started.elapsed()),
                    () = tokio::time::sleep(Duration::from_secs(10)) => {}
                }
                Ok::<(), HandlerError>(())
            }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(store, sku()).with_lease(Duration::from_secs(3)))
        .service(handler);
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let outcome = route.handle(order("o-1", "sku-1")).await;
    let told = *told.lock().unwrap();
    (outcome, told)
}

/// A renewal that never answers does not keep the lease: once the lease could have run
/// out, the handler is told it is lost, and the outcome is a retry rather than an ack —
/// the release, failing, cannot tell whether someone else took the lock meanwhile.
#[tokio::test(start_paused = true)]
async fn a_renewal_unanswered_until_the_lease_runs_out_loses_the_lease() {
    let silent = SlowRenewals {
        store: MemoryLockStore::new(),
        renew_delay: None,
    };
    let (outcome, told) = through_a_long_handler(silent).await;
    assert_eq!(outcome.retry_reason(), Some(RetryReason::LeaseLost));
    assert_eq!(
        told,
        Some(Duration::from_secs(3)),
        "told when the lease could have run out"
    );
}

/// Renewals that answer slowly, but within the lease, keep it: each is paced from the start
/// of the one before, so a slow answer does not push the next one past the lease (paced
/// from the answer, the second renewal here would start 2.2 s after the first and answer
/// after the lease it renews ran out).
#[tokio::test(start_paused = true)]
async fn renewals_answered_slowly_within_the_lease_keep_it() {
    let slow = SlowRenewals {
        store: MemoryLockStore::new(),
        renew_delay: Some(Duration::from_millis(1_200)),
    };
    let (outcome, told) = through_a_long_handler(slow).await;
    assert_eq!((outcome, told), (Outcome::Processed, None));
}

#[tokio::test]
async fn fencing_tokens_grow_and_reach_the_handler() {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler = handler_fn({
        let seen = seen.clone();
        move |envelope: Envelope| {
            let token = envelope
                .extensions()
                .get::<LockLease>()
                .map(LockLease::fencing_token);
            seen.lock().unwrap().push(token);
            async { Ok::<(), HandlerError>(()) }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(MemoryLockStore::new(), sku()))
        .service(handler);
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    for i in 0..3 {
        assert_eq!(
            route.handle(order(&format!("o-{i}"), "sku-1")).await,
            Outcome::Processed
        );
    }
    let seen: Vec<u64> = seen.lock().unwrap().iter().map(|token| token.unwrap()).collect();
    assert!(seen.windows(2).all(|pair| pair[0] < pair[1]), "{seen:?}");
}

#[tokio::test]
async fn a_delivery_without_an_entity_id_is_dead_lettered() {
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(LockLayer::new(MemoryLockStore::new(), sku()))
        .service(effects.handler(Duration::ZERO, 0));
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let outcome = route.handle(common::delivery(r#"{"orderId":"o-1"}"#)).await;
    assert_eq!(outcome.dead_letter_reason(), Some(DeadLetterReason::InvalidKey));
    assert_eq!(effects.total(), 0);
}
