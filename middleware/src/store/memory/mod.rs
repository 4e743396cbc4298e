//! The in-memory store: every tier's backend on it, for unit tests and the quickstart, and
//! the shared, expiring maps behind them.

pub(crate) mod deliveries;
pub(crate) mod flag;
pub(crate) mod lock;
pub(crate) mod record;
pub(crate) mod state;

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::Instant;

/// A map whose entries expire at a deadline. Expired entries are invisible at once and are
/// dropped when touched, or by a sweep each time the map has doubled since the last one,
/// which keeps memory bounded by the live entries at an amortised O(1) per insert.
#[derive(Debug)]
pub(crate) struct Expiring<K, V> {
    entries: HashMap<K, (V, Instant)>,
    sweep_at: usize,
}

impl<K, V> Default for Expiring<K, V> {
    fn default() -> Self {
        Expiring {
            entries: HashMap::new(),
            sweep_at: 1024,
        }
    }
}

impl<K: Eq + Hash, V> Expiring<K, V> {
    /// The live value of `key`; an expired one is removed.
    pub(crate) fn get<Q>(&mut self, key: &Q, now: Instant) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        if self
            .entries
            .get(key)
            .is_some_and(|(_, deadline)| *deadline <= now)
        {
            self.entries.remove(key);
        }
        self.entries.get(key).map(|(value, _)| value)
    }

    /// Sets `key` to `value` until `deadline`.
    pub(crate) fn insert(&mut self, key: K, value: V, deadline: Instant) {
        self.entries.insert(key, (value, deadline));
        if self.entries.len() >= self.sweep_at {
            let now = Instant::now();
            self.entries.retain(|_, (_, deadline)| *deadline > now);
            self.sweep_at = (self.entries.len() * 2).max(1024);
        }
    }

    /// Removes `key`.
    pub(crate) fn remove<Q>(&mut self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.entries.remove(key);
    }

    /// Removes everything.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }
}

/// State shared by the clones of one in-memory store.
#[derive(Debug, Default)]
pub(crate) struct Shared<T>(Arc<Mutex<T>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<T> Shared<T> {
    /// Locks the state. Every store update under this lock is a single map operation, so a
    /// panic elsewhere while it was held cannot have left it half-updated: a poisoned lock
    /// is safe to reuse.
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
