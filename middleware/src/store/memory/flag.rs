use std::time::Duration;

use tokio::time::Instant;

use super::{Expiring, Shared};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::flag::{Claim, FlagStore};
use crate::token::Token;

#[derive(Clone, Copy, Debug)]
enum Marker {
    InFlight(Token),
    Done(Fingerprint),
}

/// An in-memory [`FlagStore`] for tests and the quickstart.
///
/// Not shared between processes and lost when the process exits. Clones share one map.
/// Expiry follows `tokio::time`, so tests with a paused clock can run out leases instantly.
/// Expired markers are dropped when their key is touched and by a sweep as the map grows.
#[derive(Clone, Debug, Default)]
pub struct MemoryFlagStore {
    markers: Shared<Expiring<BusinessKey, Marker>>,
}

impl MemoryFlagStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every marker, as a Redis `FLUSHALL` would.
    pub fn clear(&self) {
        self.markers.lock().clear();
    }

    fn swap_if_held(&self, key: &BusinessKey, token: Token, next: Option<(Marker, Duration)>) -> bool {
        let mut markers = self.markers.lock();
        let now = Instant::now();
        match markers.get(key, now) {
            Some(Marker::InFlight(held)) if *held == token => {
                match next {
                    Some((marker, ttl)) => markers.insert(key.clone(), marker, now + ttl),
                    None => markers.remove(key),
                }
                true
            }
            _ => false,
        }
    }
}

impl FlagStore for MemoryFlagStore {
    async fn look(&self, key: &BusinessKey) -> Result<Option<Fingerprint>, StoreError> {
        Ok(match self.markers.lock().get(key, Instant::now()) {
            Some(Marker::Done(fingerprint)) => Some(*fingerprint),
            Some(Marker::InFlight(_)) | None => None,
        })
    }

    async fn claim(&self, key: &BusinessKey, token: Token, lease: Duration) -> Result<Claim, StoreError> {
        let mut markers = self.markers.lock();
        let now = Instant::now();
        Ok(match markers.get(key, now) {
            Some(Marker::InFlight(_)) => Claim::InFlight,
            Some(Marker::Done(fingerprint)) => Claim::Done(*fingerprint),
            None => {
                markers.insert(key.clone(), Marker::InFlight(token), now + lease);
                Claim::Won
            }
        })
    }

    async fn complete(
        &self,
        key: &BusinessKey,
        token: Token,
        fingerprint: Fingerprint,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.swap_if_held(key, token, Some((Marker::Done(fingerprint), retention))))
    }

    async fn mark_done(
        &self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        self.markers
            .lock()
            .insert(key.clone(), Marker::Done(fingerprint), now + retention);
        Ok(())
    }

    async fn release(&self, key: &BusinessKey, token: Token) -> Result<bool, StoreError> {
        Ok(self.swap_if_held(key, token, None))
    }
}
