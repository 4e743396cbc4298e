use std::collections::HashMap;

use super::Shared;
use crate::error::StoreError;
use crate::state_guard::StateStore;

/// An in-memory [`StateStore`] for tests and the quickstart.
///
/// Not durable and not shared between processes; clones share one table, which grows with
/// the number of entities.
#[derive(Clone, Debug, Default)]
pub struct MemoryStateStore {
    states: Shared<HashMap<String, String>>,
}

impl MemoryStateStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl StateStore for MemoryStateStore {
    async fn current(&self, entity: &str) -> Result<Option<String>, StoreError> {
        Ok(self.states.lock().get(entity).cloned())
    }

    async fn compare_and_set(&self, entity: &str, from: Option<&str>, to: &str) -> Result<bool, StoreError> {
        let mut states = self.states.lock();
        if states.get(entity).map(String::as_str) != from {
            return Ok(false);
        }
        states.insert(entity.to_owned(), to.to_owned());
        Ok(true)
    }
}
