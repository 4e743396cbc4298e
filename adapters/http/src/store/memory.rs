//! In-memory stores, for tests and demos.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::{BusinessKey, Envelope, StoreError};

use crate::response::{ResponseStore, SaveFailure, StoredResponse};

/// Stored responses in this process's memory, for tests and demos: not shared between
/// processes, lost with the process, and not part of any transaction. Expired responses are
/// dropped whenever one is saved.
#[derive(Clone, Debug, Default)]
pub struct MemoryResponses(Arc<Mutex<HashMap<BusinessKey, (StoredResponse, Instant)>>>);

impl MemoryResponses {
    /// An empty store.
    pub fn new() -> Self {
        MemoryResponses::default()
    }
}

impl ResponseStore for MemoryResponses {
    fn lend(&self, _: &Envelope, _: &mut http::Extensions) {}

    async fn interrupt(&self, _: &Envelope) {}

    async fn save(
        &self,
        envelope: &Envelope,
        response: &StoredResponse,
        expiry: Duration,
    ) -> Result<(), SaveFailure> {
        let mut responses = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        responses.retain(|_, (_, expires)| *expires > now);
        let expires = now + expiry;
        responses.insert(envelope.key().clone(), (response.clone(), expires));
        Ok(())
    }

    async fn load(&self, key: &BusinessKey) -> Result<Option<StoredResponse>, StoreError> {
        let responses = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Ok(responses
            .get(key)
            .filter(|(_, expires)| *expires > Instant::now())
            .map(|(response, _)| response.clone()))
    }
}
