use std::time::Duration;

use tokio::time::Instant;

use super::{Expiring, Shared};
use crate::deliveries::DeliveryCounter;
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::tier::BoxFuture;

/// An in-memory [`DeliveryCounter`] for tests. It dies with the process, so it cannot see
/// the crash it exists for: use `RedisDeliveryCounter` (feature `redis`)
/// (feature `redis`) between processes. Clones share one map.
#[derive(Clone, Debug, Default)]
pub struct MemoryDeliveryCounter {
    counts: Shared<Expiring<BusinessKey, u32>>,
}

impl MemoryDeliveryCounter {
    /// An empty counter.
    pub fn new() -> Self {
        Self::default()
    }
}

impl DeliveryCounter for MemoryDeliveryCounter {
    fn unsettled(&self, key: &BusinessKey) -> BoxFuture<Result<u32, StoreError>> {
        let count = self.counts.lock().get(key, Instant::now()).copied().unwrap_or(0);
        Box::pin(async move { Ok(count) })
    }

    fn start(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>> {
        let now = Instant::now();
        let mut counts = self.counts.lock();
        let count = counts.get(key, now).copied().unwrap_or(0);
        counts.insert(key.clone(), count.saturating_add(1), now + ttl);
        Box::pin(async { Ok(()) })
    }

    fn mark(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>> {
        let now = Instant::now();
        let mut counts = self.counts.lock();
        if counts.get(key, now).is_none() {
            counts.insert(key.clone(), 1, now + ttl);
        }
        Box::pin(async { Ok(()) })
    }

    fn release(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>> {
        let now = Instant::now();
        let mut counts = self.counts.lock();
        match counts.get(key, now).copied() {
            Some(count) if count > 1 => {
                counts.insert(key.clone(), count - 1, now + crate::deliveries::COUNT_TTL)
            }
            _ => {
                counts.remove(key);
            }
        }
        Box::pin(async { Ok(()) })
    }

    fn settle(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>> {
        self.counts.lock().remove(key);
        Box::pin(async { Ok(()) })
    }
}
