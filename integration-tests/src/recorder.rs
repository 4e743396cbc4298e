//! A metrics recorder that counts, for tests and the bench to read back what the tiers
//! recorded.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// Counts per metric key (`name{label=value,…}`); a histogram counts its records.
///
/// The tiers register their metrics per envelope, so the bench's end-to-end rows pay this
/// recorder's lookup on every delivery: a key seen before is found by its hash under a
/// read lock, as a production registry (`metrics-util`'s, which the Prometheus exporter
/// uses) finds it. Naming the key and taking one mutex each time made this recorder a cost
/// of the bench's own in every end-to-end row (about 4 % of the consumer's CPU samples in a
/// `perf` profile of the full stack).
#[derive(Debug, Default)]
pub struct Counts {
    /// The counts by name, for [`get`](Counts::get).
    by_name: Mutex<BTreeMap<String, Arc<Count>>>,
    /// The same counts by the key the tiers register.
    by_key: RwLock<HashMap<Key, Arc<Count>>>,
}

#[derive(Debug, Default)]
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
    /// The count of `key`: found by the key, else found or made by its name, and kept by the
    /// key for the next registration.
    fn slot(&self, key: &Key) -> Arc<Count> {
        if let Some(count) = self.by_key.read().unwrap().get(key) {
            return count.clone();
        }
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let count = self.by_name.lock().unwrap().entry(name).or_default().clone();
        // `Key` ignores its labels' order: the first order registered keeps the count.
        let mut by_key = self.by_key.write().unwrap();
        by_key.entry(key.clone()).or_insert(count).clone()
    }

    /// The count of `name{label=value,…}` (labels in the order first recorded); 0 if never recorded.
    pub fn get(&self, name: &str) -> u64 {
        self.by_name
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
