//! The route: keys, handler errors and the attempt limit.

mod common;

use std::time::Duration;

use common::{Effects, delivery, order};
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::{
    DeadLetterReason, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, handler_fn,
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
