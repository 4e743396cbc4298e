//! The state-machine guard on its in-memory store.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Effects, delivery};
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::state_guard::{MemoryStateStore, StateGuardLayer, StateMachine, StateStore};
use oncely::{DeadLetterReason, KeyExtractor, Outcome, RetryReason, Route, StoreError, Tier};
use tower::ServiceBuilder;

const LIFECYCLE: &str = "Created Assigned Departed Arrived PickedUp Completed";

fn event(shipment: &str, state: &str) -> oncely::Delivery {
    delivery(format!(r#"{{"shipment":"{shipment}","state":"{state}"}}"#))
}

fn guard<St>(store: St) -> StateGuardLayer<St> {
    StateGuardLayer::new(
        store,
        StateMachine::forward_only(LIFECYCLE.split(' ')).unwrap(),
        KeyExtractor::json_pointer("/shipment"),
        KeyExtractor::json_pointer("/state"),
    )
}

fn key() -> KeyExtractor {
    KeyExtractor::template("{/shipment}:{/state}").unwrap()
}

#[tokio::test]
async fn an_older_event_after_a_newer_one_is_stale_and_not_handled() {
    let store = MemoryStateStore::new();
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(guard(store.clone()))
        .service(effects.handler(Duration::ZERO, 0));
    let route = Route::new("shipments", key(), stack);

    assert_eq!(route.handle(event("s-1", "Created")).await, Outcome::Processed);
    assert_eq!(route.handle(event("s-1", "Arrived")).await, Outcome::Processed);
    assert_eq!(
        route.handle(event("s-1", "Departed")).await,
        Outcome::Stale {
            current: Some("Arrived".into()),
            target: "Departed".into()
        }
    );
    assert_eq!(store.current("s-1").await.unwrap().as_deref(), Some("Arrived"));
    assert_eq!(effects.of("s-1:Departed"), 0);
    assert_eq!(effects.total(), 2);
}

#[tokio::test]
async fn an_unknown_state_is_dead_lettered() {
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(guard(MemoryStateStore::new()))
        .service(effects.handler(Duration::ZERO, 0));
    let route = Route::new("shipments", key(), stack);
    let outcome = route.handle(event("s-1", "Teleported")).await;
    assert_eq!(outcome.dead_letter_reason(), Some(DeadLetterReason::UnknownState));
    assert_eq!(effects.total(), 0);
}

#[tokio::test]
async fn a_failed_handler_leaves_the_state_unchanged() {
    let store = MemoryStateStore::new();
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(guard(store.clone()))
        .service(effects.handler(Duration::ZERO, 1));
    let route = Route::new("shipments", key(), stack);
    let failed = route.handle(event("s-1", "Created")).await;
    assert_eq!(failed.retry_reason(), Some(RetryReason::HandlerFailed));
    assert_eq!(store.current("s-1").await.unwrap(), None);
    assert_eq!(route.handle(event("s-1", "Created")).await, Outcome::Processed);
    assert_eq!(store.current("s-1").await.unwrap().as_deref(), Some("Created"));
}

/// A state store whose first commit fails, as a connection dropped after the handler ran.
#[derive(Clone)]
struct FirstCommitFails {
    store: MemoryStateStore,
    failed: Arc<AtomicBool>,
}

impl StateStore for FirstCommitFails {
    async fn current(&self, entity: &str) -> Result<Option<String>, StoreError> {
        self.store.current(entity).await
    }

    async fn compare_and_set(&self, entity: &str, from: Option<&str>, to: &str) -> Result<bool, StoreError> {
        if !self.failed.swap(true, Ordering::SeqCst) {
            return Err(StoreError::new("connection reset"));
        }
        self.store.compare_and_set(entity, from, to).await
    }
}

#[tokio::test]
async fn a_lost_commit_is_repaired_by_the_redelivery_without_a_second_effect() {
    let store = FirstCommitFails {
        store: MemoryStateStore::new(),
        failed: Arc::new(AtomicBool::new(false)),
    };
    let effects = Effects::default();
    let stack = ServiceBuilder::new()
        .layer(guard(store.clone()))
        .layer(RecordLayer::new(MemoryRecordStore::new()))
        .service(effects.handler(Duration::ZERO, 0));
    let route = Route::new("shipments", key(), stack);

    let first = route.handle(event("s-1", "Created")).await;
    assert_eq!(
        first.retry_reason(),
        Some(RetryReason::StoreUnavailable(Tier::StateGuard))
    );
    assert_eq!(effects.of("s-1:Created"), 1);
    assert_eq!(
        route.handle(event("s-1", "Created")).await,
        Outcome::Duplicate { tier: Tier::Record }
    );
    assert_eq!(store.current("s-1").await.unwrap().as_deref(), Some("Created"));
    assert_eq!(effects.of("s-1:Created"), 1);
}
