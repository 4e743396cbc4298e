//! Filling a pre-filter on start from a SQL record table: the paging, written once; each
//! store reads its pages ([`RecentSuccesses`]).

use std::future::Future;
use std::time::Duration;

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::prefilter::PreFilter;

/// Rows read per query while rebuilding.
pub(crate) const REBUILD_BATCH: u64 = 10_000;

/// A record table's `SUCCESS` rows settled within a window, page by page in `id` order.
pub(crate) trait RecentSuccesses {
    /// Up to [`REBUILD_BATCH`] rows with an `id` above `after`, settled within `window`: each
    /// row's `id` and key, in `id` order.
    fn page(
        &self,
        window: Duration,
        after: i64,
    ) -> impl Future<Output = Result<Vec<(i64, BusinessKey)>, StoreError>> + Send;
}

/// Fills `filter` from `table`'s pages and returns how many keys it read, calling `progress`
/// after each page with the count so far. Reads in pages by id, so it holds no long
/// transaction; rows settled while it runs may be missed, which only costs speed.
pub(crate) async fn fill<F: PreFilter>(
    filter: &F,
    table: &impl RecentSuccesses,
    window: Duration,
    mut progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let (mut after, mut read) = (0_i64, 0_u64);
    loop {
        let page = table.page(window, after).await?;
        if page.is_empty() {
            return Ok(read);
        }
        for (id, key) in &page {
            after = *id;
            filter.remember(key);
        }
        read += page.len() as u64;
        progress(read);
    }
}
