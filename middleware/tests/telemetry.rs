//! The per-tier metrics a route records, read back through a recorder of the test's own.
#![cfg(feature = "memory")]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Effects, order};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use oncely::flag::{FlagLayer, MemoryFlagStore};
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::{KeyExtractor, Outcome, Route, Tier};
use tower::ServiceBuilder;

/// Counts per metric key (`name{label=value,…}`); a histogram counts its records.
#[derive(Default)]
struct Counts(Mutex<BTreeMap<String, Arc<Count>>>);

#[derive(Default)]
struct Count(AtomicU64);

impl CounterFn for Count {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

impl HistogramFn for Count {
    fn record(&self, _: f64) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl Counts {
    fn slot(&self, key: &Key) -> Arc<Count> {
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        self.0.lock().unwrap().entry(name).or_default().clone()
    }

    fn get(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |count| count.0.load(Ordering::Relaxed))
    }
}

impl Recorder for Counts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.slot(key))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.slot(key))
    }
}

#[test]
fn each_tier_counts_what_reached_it_what_it_caught_and_what_it_passed_on() {
    let counts = Counts::default();
    let effects = Effects::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&counts, || {
        runtime.block_on(async {
            let stack = ServiceBuilder::new()
                .layer(FlagLayer::new(MemoryFlagStore::new(), Duration::from_secs(600)))
                .layer(RecordLayer::new(MemoryRecordStore::new()))
                .service(effects.handler(Duration::ZERO, 0));
            let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack);
            assert_eq!(route.handle(order("o-1", "A")).await, Outcome::Processed);
            assert_eq!(
                route.handle(order("o-1", "A")).await,
                Outcome::Duplicate { tier: Tier::Flag }
            );
            assert_eq!(route.handle(order("o-2", "A")).await, Outcome::Processed);
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
