//! The record tier on its in-memory store.

mod common;

use std::time::Duration;

use common::{Effects, order};
use oncely::record::{MemoryRecordStore, RecordLayer, RecordStatus, RecordStore};
use oncely::{BusinessKey, KeyExtractor, Outcome, RetryReason, Route, Tier};
use tower::ServiceBuilder;

fn route(
    store: &MemoryRecordStore,
    effects: &Effects,
    work: Duration,
    failures: usize,
) -> Route<impl common::Stack> {
    let stack = ServiceBuilder::new()
        .layer(RecordLayer::new(store.clone()).with_lease(Duration::from_secs(10)))
        .service(effects.handler(work, failures));
    Route::new("test", KeyExtractor::json_pointer("/orderId"), stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_deliveries_of_one_key_run_the_handler_once() {
    let store = MemoryRecordStore::new();
    let effects = Effects::default();
    let route = route(&store, &effects, Duration::from_millis(50), 0);
    common::one_of_thirty_two_concurrent_copies_runs(&route, &effects, Tier::Record).await;
    let record = store.get(&BusinessKey::new("o-1")).await.unwrap().unwrap();
    assert_eq!((record.status, record.attempts), (RecordStatus::Success, 1));
}

#[tokio::test]
async fn a_failure_is_recorded_and_the_retry_takes_over() {
    let store = MemoryRecordStore::new();
    let effects = Effects::default();
    let route = route(&store, &effects, Duration::ZERO, 1);
    let key = BusinessKey::new("o-1");

    let first = route.handle(order("o-1", "A")).await;
    assert_eq!(first.retry_reason(), Some(RetryReason::HandlerFailed));
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Failure);
    assert!(record.last_error.unwrap().contains("database busy"));

    assert_eq!(
        route.handle(order("o-1", "A").with_attempt(2)).await,
        Outcome::Processed
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!((record.status, record.attempts), (RecordStatus::Success, 2));
    assert_eq!(effects.of("o-1"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_processing_record_past_its_lease_is_taken_over_once() {
    let store = MemoryRecordStore::new();
    let key = BusinessKey::new("o-1");
    let fingerprint = oncely::Fingerprint::of(b"x");
    let lease = Duration::from_secs(10);

    // A consumer began the record and crashed.
    assert_eq!(
        store.begin(&key, fingerprint, lease, None).await.unwrap(),
        oncely::record::Begin::Started { attempt: 1 }
    );
    assert_eq!(
        store.begin(&key, fingerprint, lease, None).await.unwrap(),
        oncely::record::Begin::InProgress
    );
    tokio::time::sleep(lease).await;
    assert_eq!(
        store.begin(&key, fingerprint, lease, None).await.unwrap(),
        oncely::record::Begin::Started { attempt: 2 }
    );
    // The crashed attempt, waking up late, cannot settle what it no longer owns.
    assert!(!store.succeed(&key, 1).await.unwrap());
    assert!(store.succeed(&key, 2).await.unwrap());
}

#[tokio::test]
async fn the_record_applies_the_routes_fingerprint_policy() {
    let (store, effects) = (MemoryRecordStore::new(), Effects::default());
    let record = |policy| route(&store, &effects, Duration::ZERO, 0).with_fingerprint(policy);
    common::fingerprint_policies_are_applied(record, &effects, Tier::Record).await;
}
