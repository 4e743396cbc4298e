//! The store suites against the in-memory backends, and the tiers' metrics on them.

use std::time::Duration;

use integration_tests::recorder::Counts;
use oncely::flag::FlagLayer;
use oncely::record::RecordLayer;
use oncely::{Delivery, Envelope, HandlerError, KeyExtractor, Outcome, Route, Source, Tier, handler_fn};
use tower::ServiceBuilder;

use oncely::flag::MemoryFlagStore;
use oncely::lock::MemoryLockStore;
use oncely::record::MemoryRecordStore;
use oncely::state_guard::MemoryStateStore;

async fn flag_store() -> MemoryFlagStore {
    MemoryFlagStore::new()
}

async fn lock_store() -> MemoryLockStore {
    MemoryLockStore::new()
}

async fn record_store() -> MemoryRecordStore {
    MemoryRecordStore::new()
}

async fn state_store() -> MemoryStateStore {
    MemoryStateStore::new()
}

oncely::store_suite!(flag, flag_store);
oncely::store_suite!(lock, lock_store);
oncely::store_suite!(record, record_store);
oncely::store_suite!(state, state_store);

#[test]
fn each_tier_counts_what_reached_it_what_it_caught_and_what_it_passed_on() {
    let counts = Counts::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let order = |id: &str| Delivery::new(Source::new("orders"), format!(r#"{{"orderId":"{id}"}}"#));
    metrics::with_local_recorder(&counts, || {
        runtime.block_on(async {
            let stack = ServiceBuilder::new()
                .layer(FlagLayer::new(MemoryFlagStore::new(), Duration::from_secs(600)))
                .layer(RecordLayer::new(MemoryRecordStore::new()))
                .service(handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) }));
            let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack);
            assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
            assert_eq!(
                route.handle(order("o-1")).await,
                Outcome::Duplicate { tier: Tier::Flag }
            );
            assert_eq!(route.handle(order("o-2")).await, Outcome::Processed);
        });
    });

    let tier = |name: &str, tier: &str| counts.get(&format!("{name}{{route=orders,tier={tier}}}"));
    assert_eq!(tier("oncely_tier_envelopes_total", "flag"), 3);
    assert_eq!(tier("oncely_tier_duplicates_total", "flag"), 1);
    assert_eq!(tier("oncely_tier_passed_total", "flag"), 2);
    assert_eq!(tier("oncely_tier_seconds", "flag"), 3, "one latency per envelope");
    assert_eq!(tier("oncely_tier_envelopes_total", "record"), 2);
    assert_eq!(tier("oncely_tier_duplicates_total", "record"), 0);
    assert_eq!(tier("oncely_tier_passed_total", "record"), 2);
    assert_eq!(tier("oncely_tier_errors_total", "flag"), 0);
    assert_eq!(
        counts.get("oncely_outcomes_total{route=orders,outcome=processed}"),
        2
    );
    assert_eq!(
        counts.get("oncely_outcomes_total{route=orders,outcome=duplicate}"),
        1
    );
}
