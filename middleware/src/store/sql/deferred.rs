//! Rows the handlers of a record transaction leave for the tier to write as it commits:
//! gathered per type, in the order they first came. Each SQL store writes them on its own
//! driver (`postgres/record/commit_rows.rs`, `mysql/commit_rows.rs`); this is what they share.

use std::any::Any;
use std::sync::{Mutex, PoisonError};

/// Rows waiting for the commit as `P` (the store's boxed writer): found again by their type
/// when more of them come.
pub(crate) trait Gathered: Send {
    fn as_any(&mut self) -> &mut dyn Any;
}

impl<T: Any + Send> Gathered for T {
    fn as_any(&mut self) -> &mut dyn Any {
        self
    }
}

/// The rows one transaction's handlers deferred, as the store's writers `P`.
pub(crate) struct Deferred<P: ?Sized>(Mutex<Vec<Box<P>>>);

impl<P: ?Sized> Default for Deferred<P> {
    fn default() -> Self {
        Deferred(Mutex::new(Vec::new()))
    }
}

impl<P: ?Sized + Gathered> Deferred<P> {
    /// Gathers `rows` into the first deferred rows of their type that `absorb` them; keeps
    /// them apart (boxed by `boxed`) when none does.
    pub(crate) fn add<R: 'static>(
        &self,
        mut rows: R,
        absorb: impl Fn(&mut R, R) -> Option<R>,
        boxed: impl FnOnce(R) -> Box<P>,
    ) {
        let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for gathered in pending.iter_mut() {
            // Through the box: `Box<P>` is itself `Any`, and would answer its own type.
            if let Some(gathered) = (**gathered).as_any().downcast_mut::<R>() {
                match absorb(gathered, rows) {
                    None => return,
                    Some(back) => rows = back,
                }
            }
        }
        pending.push(boxed(rows));
    }

    /// Every deferred row, in order, forgotten here: to write now.
    pub(crate) fn take(&self) -> Vec<Box<P>> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}
