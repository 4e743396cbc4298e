//! What the lanes of one layer know of each other: which keys their open batches hold, and
//! how many batches are open.
//!
//! Two copies of a key must never be claimed in two open transactions at once: the second
//! claim waits on the first one's row lock until that batch commits, and every delivery of
//! the second batch waits with it — or, when the first batch then claims a key the second
//! holds, the two deadlock until the server fails one (PostgreSQL after `deadlock_timeout`,
//! 1 s by default). Producer retries and re-sends come back right behind their originals, so
//! this is the common case of a duplicate, not a rare one. A copy of a held key is parked
//! behind the batch that holds it instead. When that batch commits the key, a copy of the
//! same payload is answered duplicate from the commit ([`answer_from_commit`]), without a
//! statement; any other copy (another payload, a rollback, the first copy sent to run alone)
//! joins a later batch, where its claim finds the key as the batch left it, without waiting
//! on anyone.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use super::lane::{Joiner, Word};
use crate::envelope::BusinessKey;
use crate::fingerprint::Fingerprint;
use crate::record::Begin;

/// The keys held by the open batches of every lane of a layer, with the copies parked behind
/// them; and how many batches are open, which an idle lane reads to decide whether to start
/// at once or keep collecting.
pub(super) struct Traffic<W> {
    /// Each key an open batch claimed, with the copies that arrived while it was open.
    held: Mutex<HashMap<BusinessKey, Vec<Joiner<W>>>>,
    /// Copies whose key's batch has ended, for the next batch of whichever lane takes them
    /// first: one collecting deliveries (woken by that end), else the lane that ended it.
    released: Mutex<Vec<Joiner<W>>>,
    /// Batches between their first claim and the end of their transaction.
    open: AtomicUsize,
    /// How many batches have ended: a lane collecting deliveries starts when it changes.
    ends: AtomicU64,
    /// Woken when a batch ends.
    ended: Notify,
}

impl<W> Default for Traffic<W> {
    fn default() -> Self {
        Traffic {
            held: Mutex::new(HashMap::new()),
            released: Mutex::new(Vec::new()),
            open: AtomicUsize::new(0),
            ends: AtomicU64::new(0),
            ended: Notify::new(),
        }
    }
}

impl<W> Traffic<W> {
    /// How many batches are open now.
    pub(super) fn open_batches(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// How many batches have ended so far.
    pub(super) fn ends(&self) -> u64 {
        self.ends.load(Ordering::Acquire)
    }

    /// Told when a batch ends; enable the returned future before reading
    /// [`ends`](Self::ends), or an end in between is missed.
    pub(super) fn batch_ended(&self) -> tokio::sync::futures::Notified<'_> {
        self.ended.notified()
    }

    /// A batch begins: the keys it takes are held until the returned guard releases them.
    /// It counts as open from its first key on: one that took none opens no transaction.
    pub(super) fn open_batch(&self) -> Holding<'_, W> {
        Holding {
            traffic: self,
            keys: Vec::new(),
            opened: false,
        }
    }

    /// Takes up to `room` of the copies released by batches that ended (the rest wait for
    /// the next batch: a batch never grows past its maximum).
    pub(super) fn take_released(&self, room: usize) -> Vec<Joiner<W>> {
        let mut released = (self.released.lock()).unwrap_or_else(std::sync::PoisonError::into_inner);
        let taken = released.len().min(room);
        released.drain(..taken).collect()
    }

    /// The map, whatever a panicking holder left in it: every change to it is one insert or
    /// one removal, complete or not made.
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<BusinessKey, Vec<Joiner<W>>>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An open batch's hold on its keys. Dropped, it releases them: parked copies that were not
/// taken with [`Holding::release`] (the lane panicked) are dropped, and their deliveries
/// answered as when the lanes stop (retry later).
pub(super) struct Holding<'a, W> {
    traffic: &'a Traffic<W>,
    keys: Vec<BusinessKey>,
    /// Counted in [`Traffic::open_batches`]: it took a key.
    opened: bool,
}

impl<W> Holding<'_, W> {
    /// How many keys this batch holds.
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Takes the deliveries of `intake` whose keys no open batch holds into this batch,
    /// sorted by key so that concurrent batches lock their keys' rows in one order; parks the
    /// copies of held keys (this batch's own included) behind the batch that holds them.
    /// Deliveries whose future is already gone (a timeout in front while they queued) are
    /// left out: claimed, they would roll the batch back.
    pub(super) fn take(&mut self, intake: Vec<Joiner<W>>) -> Vec<Joiner<W>> {
        let mut fresh = Vec::with_capacity(intake.len());
        let mut held = self.traffic.held();
        for joiner in intake.into_iter().filter(|joiner| !joiner.reply.is_closed()) {
            match held.get_mut(&joiner.request.key) {
                Some(parked) => parked.push(joiner),
                None => {
                    held.insert(joiner.request.key.clone(), Vec::new());
                    self.keys.push(joiner.request.key.clone());
                    fresh.push(joiner);
                }
            }
        }
        drop(held);
        if !self.opened && !self.keys.is_empty() {
            self.opened = true;
            self.traffic.open.fetch_add(1, Ordering::AcqRel);
        }
        fresh.sort_by(|a, b| a.request.key.cmp(&b.request.key));
        fresh
    }

    /// Releases this batch's keys once its transaction has ended. Each copy parked behind
    /// them is first offered to `answer`, which answers it when the batch's commit decided it
    /// (the key is done) and hands it back otherwise; those go to
    /// [`Traffic::take_released`], for the next batch of a lane collecting deliveries, which
    /// this end wakes, or else of this one, where their claims find what this batch left.
    pub(super) fn release(mut self, mut answer: impl FnMut(Joiner<W>) -> Option<Joiner<W>>) {
        let parked: Vec<Joiner<W>> = self.unhold().into_iter().filter_map(&mut answer).collect();
        if !parked.is_empty() {
            let released = &self.traffic.released;
            let mut released = released.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            released.extend(parked);
        }
    }

    /// Gives up every key this batch holds; answers the copies parked behind them.
    fn unhold(&mut self) -> Vec<Joiner<W>> {
        let mut held = self.traffic.held();
        (self.keys.drain(..))
            .filter_map(|key| held.remove(&key))
            .flatten()
            .collect()
    }
}

impl<W> Drop for Holding<'_, W> {
    fn drop(&mut self) {
        // Released already, or the lane panicked: its parked copies are dropped, outside the
        // map's lock (dropping a joiner wakes its delivery).
        drop(self.unhold());
        if self.opened {
            self.traffic.open.fetch_sub(1, Ordering::AcqRel);
            self.traffic.ends.fetch_add(1, Ordering::AcqRel);
            self.traffic.ended.notify_waiters();
        }
    }
}

/// Answers `copy` from what its key's batch committed, `done` (each key claimed and
/// committed, with the fingerprint its claim carried), without a statement: a copy right
/// behind its original, carrying the same payload's fingerprint (or none checked), is a
/// duplicate whatever the key's row holds. Hands it back otherwise — its key not in `done`
/// (the batch rolled back, the first copy ran elsewhere), or another payload, which its
/// claim judges against the row (a row taken over keeps the fingerprint it was first
/// recorded with, which may differ from the claim's when either is unchecked).
pub(super) fn answer_from_commit<W>(
    copy: Joiner<W>,
    done: &HashMap<BusinessKey, Fingerprint>,
    in_flight_delay: Duration,
) -> Option<Joiner<W>> {
    let request = &copy.request;
    let same_payload = (done.get(&request.key)).is_some_and(|claimed| {
        request.fingerprint == *claimed || request.fingerprint == Fingerprint::UNCHECKED
    });
    if !same_payload {
        return Some(copy);
    }
    // The transactional mode's rows are `SUCCESS` once committed: the one reading of a
    // claim that finds one.
    match Begin::Done.into_attempt(&request.key, request.fingerprint, in_flight_delay) {
        Err(outcome) => {
            let _ = copy.reply.send(Word::Answer(outcome));
            None
        }
        Ok(_) => Some(copy),
    }
}
