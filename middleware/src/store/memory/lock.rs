use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Expiring, Shared};
use crate::error::StoreError;
use crate::lock::LockStore;
use crate::token::Token;

/// An in-memory [`LockStore`] for tests and the quickstart.
///
/// Not shared between processes. Clones share one lock table. Fencing tokens come from one
/// counter for all entities, so they grow per entity as required. Expiry follows
/// `tokio::time`.
#[derive(Clone, Debug, Default)]
pub struct MemoryLockStore {
    holders: Shared<Expiring<String, Token>>,
    fencing: Arc<AtomicU64>,
}

impl MemoryLockStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Drops the lock of `entity` whoever holds it, as an expired or deleted Redis key would.
    pub fn force_release(&self, entity: &str) {
        self.holders.lock().remove(entity);
    }

    fn held_by(holders: &mut Expiring<String, Token>, entity: &str, token: Token) -> bool {
        holders.get(entity, Instant::now()) == Some(&token)
    }
}

impl LockStore for MemoryLockStore {
    async fn acquire(&self, entity: &str, token: Token, lease: Duration) -> Result<Option<u64>, StoreError> {
        let mut holders = self.holders.lock();
        let now = Instant::now();
        if holders.get(entity, now).is_some() {
            return Ok(None);
        }
        holders.insert(entity.to_owned(), token, now + lease);
        Ok(Some(self.fencing.fetch_add(1, Ordering::Relaxed) + 1))
    }

    async fn renew(&self, entity: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let mut holders = self.holders.lock();
        let held = Self::held_by(&mut holders, entity, token);
        if held {
            holders.insert(entity.to_owned(), token, Instant::now() + lease);
        }
        Ok(held)
    }

    async fn release(&self, entity: &str, token: Token) -> Result<bool, StoreError> {
        let mut holders = self.holders.lock();
        let held = Self::held_by(&mut holders, entity, token);
        if held {
            holders.remove(entity);
        }
        Ok(held)
    }
}
