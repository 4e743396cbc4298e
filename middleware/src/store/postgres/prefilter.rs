//! Filling a pre-filter on start from the PostgreSQL record table.

use std::time::Duration;

use deadpool_postgres::Pool;

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::prefilter::PreFilter;
use crate::store::postgres::Table;
use crate::store::postgres::claims::Statements;

/// Rows read per query while rebuilding.
const REBUILD_BATCH: i64 = 10_000;

/// Fills `filter` with the keys the record table `records` holds as `SUCCESS`, settled
/// within the last `window`, and returns how many it read. `progress` is called after each
/// batch of 10,000 rows with the count so far, for logs on large rebuilds.
///
/// A consumer may instead start with an empty filter, which fills from new traffic: until
/// then every key looks certainly new and duplicates of older keys go to the record, which
/// answers for them. Rebuilding trades a start-up scan for that. Pick the window as the
/// time within which duplicates arrive (the flag's retry window); keys settled before it
/// still get their full path. Reads in pages by id, so it holds no long transaction; rows
/// settled while it runs may be missed, which only costs speed.
pub async fn rebuild_from_records<F: PreFilter>(
    filter: &F,
    pool: &Pool,
    records: &Table,
    window: Duration,
    mut progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let client = pool.get().await?;
    let statement = client.prepare(&Statements::new(records).recent_successes).await?;
    let (mut after, mut read) = (0_i64, 0_u64);
    loop {
        let rows = client
            .query(&statement, &[&window.as_secs_f64(), &after, &REBUILD_BATCH])
            .await?;
        for row in &rows {
            after = row.get(0);
            filter.remember(&BusinessKey::new(row.get::<_, String>(1)));
        }
        read += rows.len() as u64;
        if rows.is_empty() {
            return Ok(read);
        }
        progress(read);
    }
}
