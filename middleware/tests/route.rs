//! The route: keys, handler errors and the attempt limit.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Effects, delivery, order};
use oncely::deliveries::DeliveryCounter;
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::{
    BoxFuture, BusinessKey, DeadLetterReason, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason,
    Route, StoreError, handler_fn,
};
use tower::ServiceBuilder;

#[tokio::test]
async fn a_bad_key_is_dead_lettered_before_any_tier_runs() {
    let effects = Effects::default();
    let route = Route::new(
        "orders",
        KeyExtractor::json_pointer("/orderId"),
        effects.handler(Duration::ZERO, 0),
    );
    for body in ["not json", r#"{"sku":"A"}"#, r#"{"orderId":""}"#] {
        let outcome = route.handle(delivery(body)).await;
        assert_eq!(
            outcome.dead_letter_reason(),
            Some(DeadLetterReason::InvalidKey),
            "{body}"
        );
    }
    assert_eq!(effects.total(), 0);
}

#[tokio::test]
async fn retries_stop_at_the_attempt_limit_with_a_dead_letter() {
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(RecordLayer::new(MemoryRecordStore::new()))
        .service(effects.handler(Duration::ZERO, usize::MAX));
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack).with_max_attempts(3);
    for attempt in 1..3 {
        let outcome = route.handle(order("o-1", "A").with_attempt(attempt)).await;
        assert_eq!(outcome.retry_reason(), Some(RetryReason::HandlerFailed));
    }
    let last = route.handle(order("o-1", "A").with_attempt(3)).await;
    assert_eq!(
        last.dead_letter_reason(),
        Some(DeadLetterReason::AttemptsExhausted)
    );
    let Outcome::DeadLetter(dead) = last else {
        unreachable!()
    };
    assert!(dead.detail.contains("database busy"), "{}", dead.detail);
}

#[tokio::test]
async fn a_permanent_handler_error_is_dead_lettered_at_once() {
    let route = Route::new(
        "orders",
        KeyExtractor::json_pointer("/orderId"),
        handler_fn(|_: Envelope| async { Err::<(), _>(HandlerError::permanent("order does not exist")) }),
    );
    let outcome = route.handle(order("o-1", "A")).await;
    assert_eq!(outcome.dead_letter_reason(), Some(DeadLetterReason::Rejected));
}

#[tokio::test]
async fn waiting_for_another_delivery_never_exhausts_attempts() {
    let flags = oncely::flag::MemoryFlagStore::new();
    let stack = ServiceBuilder::new()
        .layer(oncely::flag::FlagLayer::new(
            flags.clone(),
            Duration::from_secs(600),
        ))
        .service(Effects::default().handler(Duration::ZERO, 0));
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack).with_max_attempts(2);
    // Another consumer holds the key (it crashed, or it is slow): its lease bounds the wait.
    use oncely::flag::FlagStore;
    let key = oncely::BusinessKey::new("o-1");
    flags
        .claim(&key, oncely::Token::random(), Duration::from_secs(30))
        .await
        .unwrap();
    let outcome = route.handle(order("o-1", "A").with_attempt(5)).await;
    assert_eq!(
        outcome.retry_reason(),
        Some(RetryReason::InFlight(oncely::Tier::Flag))
    );
}

/// A delivery whose consumer dies mid-handler, as far as the route can tell: its future is
/// dropped before the stack answers.
async fn crash<S>(route: &Route<S>, id: &str) -> Option<Outcome>
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    tokio::time::timeout(Duration::from_millis(50), route.handle(order(id, "A")))
        .await
        .ok()
}

#[tokio::test]
async fn a_key_that_never_settles_is_dead_lettered_at_the_delivery_limit_and_answered_keys_reset() {
    let runs = std::sync::Arc::new(std::sync::Mutex::new(
        std::collections::HashMap::<String, u32>::new(),
    ));
    let counted = runs.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        let run = {
            let mut runs = counted.lock().unwrap();
            let run = runs.entry(envelope.key().to_string()).or_default();
            *run += 1;
            *run
        };
        async move {
            let key = envelope.key().as_str();
            if key == "poison" || (key == "once" && run == 1) {
                std::future::pending::<()>().await;
            }
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), handler)
        .with_delivery_limit(oncely::deliveries::MemoryDeliveryCounter::new(), 3);

    // A first crash (perhaps among others), then three alone.
    for _ in 0..4 {
        assert_eq!(
            crash(&route, "poison").await,
            None,
            "the crash cuts the delivery off"
        );
    }
    let last = route.handle(order("poison", "A")).await;
    assert_eq!(
        last.dead_letter_reason(),
        Some(DeadLetterReason::DeliveryLimit),
        "{last}"
    );
    assert_eq!(runs.lock().unwrap()["poison"], 4, "never started a fifth time");

    // A key caught in one crash runs again (alone, as a suspect) and, once answered, starts
    // from zero.
    assert_eq!(crash(&route, "once").await, None);
    assert_eq!(route.handle(order("once", "A")).await, Outcome::Processed);
    assert_eq!(runs.lock().unwrap()["once"], 2);
}

/// A memory counter whose first `together` reads of a count wait for each other, so that
/// as many copies of a key find it unmarked, as copies that arrive at once can.
struct ReadTogether {
    counter: oncely::deliveries::MemoryDeliveryCounter,
    reads: std::sync::Arc<tokio::sync::Barrier>,
    waiting: std::sync::atomic::AtomicUsize,
}

impl ReadTogether {
    fn new(together: usize) -> Self {
        ReadTogether {
            counter: oncely::deliveries::MemoryDeliveryCounter::new(),
            reads: std::sync::Arc::new(tokio::sync::Barrier::new(together)),
            waiting: std::sync::atomic::AtomicUsize::new(together),
        }
    }
}

impl DeliveryCounter for ReadTogether {
    fn unsettled(&self, key: &BusinessKey) -> BoxFuture<Result<u32, StoreError>> {
        let (reads, read) = (self.reads.clone(), self.counter.unsettled(key));
        let wait = self
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            if wait {
                reads.wait().await;
            }
            read.await
        })
    }

    fn mark(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>> {
        self.counter.mark(key, ttl)
    }

    fn start(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>> {
        self.counter.start(key, ttl)
    }

    fn release(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>> {
        self.counter.release(key)
    }

    fn settle(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>> {
        self.counter.settle(key)
    }
}

/// With the strictest limit, 1, a message caught once in a crash (its first start, perhaps
/// beside the message that caused it) runs again alone and is processed — also when two
/// copies of it were caught at once; one that then crashes alone too is dead-lettered.
#[tokio::test]
async fn with_a_limit_of_one_a_first_crash_is_not_blamed_a_crash_alone_is() {
    let caught_runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let handler = handler_fn(move |envelope: Envelope| {
        let caught_in_crash = envelope.key().as_str() == "caught"
            && caught_runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2;
        async move {
            if envelope.key().as_str() == "poison" || caught_in_crash {
                std::future::pending::<()>().await;
            }
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), handler)
        .with_delivery_limit(ReadTogether::new(2), 1);
    let twins = tokio::join!(crash(&route, "caught"), crash(&route, "caught"));
    assert_eq!(twins, (None, None), "two copies caught in one crash");
    assert_eq!(route.handle(order("caught", "A")).await, Outcome::Processed);

    assert_eq!(crash(&route, "poison").await, None, "among others");
    assert_eq!(crash(&route, "poison").await, None, "alone");
    let last = route.handle(order("poison", "A")).await;
    assert_eq!(
        last.dead_letter_reason(),
        Some(DeadLetterReason::DeliveryLimit),
        "{last}"
    );
}

/// A crash leaves the flag's in-flight claim behind until its lease runs out; the waits it
/// causes run nothing and must not wipe the crashes counted so far.
#[tokio::test(start_paused = true)]
async fn waits_behind_a_dead_consumers_claim_keep_its_crashes_counted() {
    let handler = handler_fn(|_envelope: Envelope| async move {
        std::future::pending::<()>().await;
        Ok::<(), HandlerError>(())
    });
    let stack = ServiceBuilder::new()
        .layer(
            oncely::flag::FlagLayer::new(oncely::flag::MemoryFlagStore::new(), Duration::from_secs(600))
                .with_lease(Duration::from_secs(10)),
        )
        .service(handler);
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack)
        .with_delivery_limit(oncely::deliveries::MemoryDeliveryCounter::new(), 3);
    for _ in 0..3 {
        assert_eq!(crash(&route, "poison").await, None);
        let wait = route.handle(order("poison", "A")).await;
        assert_eq!(
            wait.retry_reason(),
            Some(RetryReason::InFlight(oncely::Tier::Flag)),
            "{wait}"
        );
        tokio::time::advance(Duration::from_secs(11)).await;
    }
    assert_eq!(crash(&route, "poison").await, None);
    let last = route.handle(order("poison", "A")).await;
    assert_eq!(
        last.dead_letter_reason(),
        Some(DeadLetterReason::DeliveryLimit),
        "{last}"
    );
}

/// A suspect (a key that came back unsettled) must run alone: a fresh delivery that arrives
/// while it runs waits, so a crash then is charged to the suspect only.
#[tokio::test]
async fn a_suspect_runs_alone_on_its_route() {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let started = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (open, log) = (gate.clone(), started.clone());
    let handler = handler_fn(move |envelope: Envelope| {
        let (open, log) = (open.clone(), log.clone());
        async move {
            let key = envelope.key().to_string();
            log.lock().unwrap().push(key.clone());
            if key == "suspect" {
                open.notified().await;
            }
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), handler)
        .with_delivery_limit(oncely::deliveries::MemoryDeliveryCounter::new(), 5);
    assert_eq!(
        crash(&route, "suspect").await,
        None,
        "counted once, now a suspect"
    );

    let suspect = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("suspect", "A")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let fresh = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("fresh", "B")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        *started.lock().unwrap(),
        ["suspect", "suspect"],
        "the fresh delivery waits while the suspect runs"
    );
    gate.notify_one();
    assert_eq!(suspect.await.unwrap(), Outcome::Processed);
    assert_eq!(fresh.await.unwrap(), Outcome::Processed);
    assert_eq!(started.lock().unwrap().last().map(String::as_str), Some("fresh"));
}
