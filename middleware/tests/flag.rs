//! The flag tier on its in-memory store.

mod common;

use std::time::Duration;

use common::{Effects, order};
use oncely::flag::{Claim, FlagLayer, FlagStore, MemoryFlagStore};
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::{
    BusinessKey, FailurePolicy, Fingerprint, KeyExtractor, Outcome, RetryReason, Route, StoreError, Tier,
    Token,
};
use tower::ServiceBuilder;

const WINDOW: Duration = Duration::from_secs(600);

fn route(
    layer: FlagLayer<MemoryFlagStore>,
    effects: &Effects,
    work: Duration,
    failures: usize,
) -> Route<impl common::Stack> {
    let stack = ServiceBuilder::new()
        .layer(layer)
        .service(effects.handler(work, failures));
    Route::new("test", KeyExtractor::json_pointer("/orderId"), stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_deliveries_of_one_key_run_the_handler_once() {
    let effects = Effects::default();
    let route = route(
        FlagLayer::new(MemoryFlagStore::new(), WINDOW),
        &effects,
        Duration::from_millis(50),
        0,
    );
    common::one_of_thirty_two_concurrent_copies_runs(&route, &effects, Tier::Flag).await;
}

#[tokio::test]
async fn a_failed_handler_releases_the_claim_and_the_redelivery_is_processed_once() {
    let effects = Effects::default();
    let route = route(
        FlagLayer::new(MemoryFlagStore::new(), WINDOW),
        &effects,
        Duration::ZERO,
        1,
    );

    let first = route.handle(order("o-1", "A")).await;
    assert_eq!(first.retry_reason(), Some(RetryReason::HandlerFailed));
    assert_eq!(effects.of("o-1"), 0);
    assert_eq!(
        route.handle(order("o-1", "A").with_attempt(2)).await,
        Outcome::Processed
    );
    assert_eq!(
        route.handle(order("o-1", "A").with_attempt(3)).await,
        Outcome::Duplicate { tier: Tier::Flag }
    );
    assert_eq!(effects.of("o-1"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_runs_out_lets_a_new_claim_in_and_the_record_behind_catches_it() {
    let flag = FlagLayer::new(MemoryFlagStore::new(), WINDOW).with_lease(Duration::from_secs(1));

    // The flag alone: a handler slower than the lease lets a second delivery in.
    let effects = Effects::default();
    let alone = route(flag.clone(), &effects, Duration::from_secs(5), 0);
    let slow = tokio::spawn({
        let alone = alone.clone();
        async move { alone.handle(order("o-1", "A")).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(alone.handle(order("o-1", "A")).await, Outcome::Processed);
    assert_eq!(slow.await.unwrap(), Outcome::Processed);
    assert_eq!(effects.of("o-1"), 2, "the documented limit of the flag alone");

    // With the record behind it, the second delivery waits instead.
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(flag)
        .layer(RecordLayer::new(MemoryRecordStore::new()))
        .service(effects.handler(Duration::from_secs(5), 0));
    let guarded = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let slow = tokio::spawn({
        let guarded = guarded.clone();
        async move { guarded.handle(order("o-1", "A")).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = guarded.handle(order("o-1", "A")).await;
    assert_eq!(second.retry_reason(), Some(RetryReason::InFlight(Tier::Record)));
    assert_eq!(slow.await.unwrap(), Outcome::Processed);
    assert_eq!(effects.of("o-1"), 1);
}

#[tokio::test]
async fn with_a_record_behind_a_dead_consumers_claim_does_not_hold_its_key_back() {
    let flags = MemoryFlagStore::new();
    let records = MemoryRecordStore::new();
    // A consumer claimed o-1 and died: its marker stays in flight for the whole lease.
    let key = BusinessKey::new("o-1");
    let lease = Duration::from_secs(600);
    assert_eq!(
        flags.claim(&key, Token::random(), lease).await.unwrap(),
        Claim::Won
    );
    let effects = Effects::default();
    let stack = |flag: FlagLayer<MemoryFlagStore>| {
        let stack = ServiceBuilder::new()
            .layer(flag.with_lease(lease))
            .layer(RecordLayer::new(records.clone()))
            .service(effects.handler(Duration::ZERO, 0));
        Route::new("test", KeyExtractor::json_pointer("/orderId"), stack)
    };

    let waiting = stack(FlagLayer::new(flags.clone(), WINDOW));
    let first = waiting.handle(order("o-1", "A")).await;
    assert_eq!(first.retry_reason(), Some(RetryReason::InFlight(Tier::Flag)));
    assert_eq!(
        effects.of("o-1"),
        0,
        "without it, the redelivery waits out the lease"
    );

    let recovering = stack(FlagLayer::new(flags.clone(), WINDOW).with_record_behind());
    assert_eq!(recovering.handle(order("o-1", "A")).await, Outcome::Processed);
    assert_eq!(
        waiting.handle(order("o-1", "A")).await,
        Outcome::Duplicate { tier: Tier::Flag },
        "the flag remembers done once the record settled the key"
    );
    assert_eq!(effects.of("o-1"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_record_behind_concurrent_copies_still_run_the_handler_once() {
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(FlagLayer::new(MemoryFlagStore::new(), WINDOW).with_record_behind())
        .layer(RecordLayer::new(MemoryRecordStore::new()))
        .service(effects.handler(Duration::from_millis(50), 0));
    let route = Route::new("test", KeyExtractor::json_pointer("/orderId"), stack);
    let outcomes = common::handle_concurrently(&route, vec![order("o-1", "A"); 32]).await;
    let processed = outcomes.iter().filter(|o| **o == Outcome::Processed).count();
    let waiting = outcomes
        .iter()
        .filter(|o| o.retry_reason() == Some(RetryReason::InFlight(Tier::Record)))
        .count();
    assert_eq!(
        (processed, waiting),
        (1, 31),
        "the record, not the flag, held the copies back"
    );
    assert_eq!(effects.of("o-1"), 1);
}

/// A flag store whose every call fails, as an unreachable Redis would.
#[derive(Clone)]
struct Unreachable;

impl FlagStore for Unreachable {
    async fn look(&self, _: &BusinessKey) -> Result<Option<Fingerprint>, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn claim(&self, _: &BusinessKey, _: Token, _: Duration) -> Result<Claim, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn complete(
        &self,
        _: &BusinessKey,
        _: Token,
        _: Fingerprint,
        _: Duration,
    ) -> Result<bool, StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn mark_done(&self, _: &BusinessKey, _: Fingerprint, _: Duration) -> Result<(), StoreError> {
        Err(StoreError::new("connection refused"))
    }
    async fn release(&self, _: &BusinessKey, _: Token) -> Result<bool, StoreError> {
        Err(StoreError::new("connection refused"))
    }
}

#[tokio::test]
async fn a_failing_store_fails_open_by_default_and_closed_when_configured() {
    let effects = Effects::default();
    let open = ServiceBuilder::new()
        .layer(FlagLayer::new(Unreachable, WINDOW))
        .service(effects.handler(Duration::ZERO, 0));
    let open = Route::new("test", KeyExtractor::json_pointer("/orderId"), open);
    assert_eq!(open.handle(order("o-1", "A")).await, Outcome::Processed);

    let closed = ServiceBuilder::new()
        .layer(FlagLayer::new(Unreachable, WINDOW).with_failure_policy(FailurePolicy::FailClosed))
        .service(effects.handler(Duration::ZERO, 0));
    let closed = Route::new("test", KeyExtractor::json_pointer("/orderId"), closed);
    let outcome = closed.handle(order("o-2", "A")).await;
    assert_eq!(
        outcome.retry_reason(),
        Some(RetryReason::StoreUnavailable(Tier::Flag))
    );
    assert_eq!(effects.of("o-2"), 0);
}

#[tokio::test]
async fn the_flag_applies_the_routes_fingerprint_policy() {
    let effects = Effects::default();
    let flag = |policy| {
        route(
            FlagLayer::new(MemoryFlagStore::new(), WINDOW),
            &effects,
            Duration::ZERO,
            0,
        )
        .with_fingerprint(policy)
    };
    common::fingerprint_policies_are_applied(flag, &effects, Tier::Flag).await;
}
