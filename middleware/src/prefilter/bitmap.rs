use std::fmt;
use std::sync::Mutex;

use roaring::RoaringTreemap;

use super::store::{PreFilter, Verdict};
use crate::envelope::BusinessKey;

/// A [`PreFilter`] on a roaring bitmap, for numeric keys such as auto-increment ids: exact
/// (no false positives) and compact for dense id ranges.
///
/// The id is the key, or its part before the first `:` for namespaced keys
/// (`12345:grant_points`), read as decimal digits. Ids are stored relative to a base offset
/// (`id - base`), so that ids starting high do not waste space. A key that is not numeric,
/// or an id below the base, is always [`Verdict::MaybeSeen`]: it takes the full path. Clones
/// of the layer share one bitmap behind a mutex held for one lookup or insert.
pub struct BitmapPreFilter {
    base: u64,
    ids: Mutex<RoaringTreemap>,
}

impl BitmapPreFilter {
    /// An empty bitmap for ids from `base` up.
    pub fn new(base: u64) -> Self {
        BitmapPreFilter {
            base,
            ids: Mutex::new(RoaringTreemap::new()),
        }
    }

    /// The offset of `key`'s id from the base, if the key is numeric and not below it.
    fn offset_of(&self, key: &BusinessKey) -> Option<u64> {
        let id = key.as_str().split(':').next()?;
        if id.is_empty() || !id.bytes().all(|byte| byte.is_ascii_digit()) {
            return None;
        }
        id.parse::<u64>().ok()?.checked_sub(self.base)
    }

    fn ids(&self) -> std::sync::MutexGuard<'_, RoaringTreemap> {
        // A panic while holding the lock cannot leave the bitmap half-written (an insert is
        // one call), so a poisoned lock is still usable.
        self.ids.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl PreFilter for BitmapPreFilter {
    fn check(&self, key: &BusinessKey) -> Verdict {
        match self.offset_of(key) {
            Some(offset) if !self.ids().contains(offset) => Verdict::CertainlyNew,
            _ => Verdict::MaybeSeen,
        }
    }

    fn remember(&self, key: &BusinessKey) {
        if let Some(offset) = self.offset_of(key) {
            self.ids().insert(offset);
        }
    }
}

impl fmt::Debug for BitmapPreFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BitmapPreFilter")
            .field("base", &self.base)
            .field("ids", &self.ids().len())
            .finish()
    }
}
