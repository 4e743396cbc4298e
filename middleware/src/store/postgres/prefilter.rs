//! Filling a pre-filter on start from the PostgreSQL record table.

use std::time::Duration;

use deadpool_postgres::Pool;

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::prefilter::PreFilter;
use crate::store::postgres::Table;
use crate::store::postgres::claims::Statements;
use crate::store::sql::prefilter::{REBUILD_BATCH, RecentSuccesses, fill};

/// Fills `filter` with the keys the record table `records` holds as `SUCCESS`, settled
/// within the last `window`, and returns how many it read. `progress` is called after each
/// batch of 10,000 rows with the count so far, for logs on large rebuilds.
///
/// A consumer may instead start with an empty filter, which fills from new traffic: until
/// then every key looks certainly new and duplicates of older keys go to the record, which
/// answers for them. Rebuilding trades a start-up scan for that. Pick the window as the
/// time within which duplicates arrive (the flag's retry window); keys settled before it
/// still get their full path. Reads in pages by id, so it holds no long transaction; rows
/// settled while it runs may be missed, which only costs speed. On MySQL/MariaDB:
/// `rebuild_from_mysql_records`.
pub async fn rebuild_from_records<F: PreFilter>(
    filter: &F,
    pool: &Pool,
    records: &Table,
    window: Duration,
    progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let client = pool.get().await?;
    let statement = client.prepare(&Statements::new(records).recent_successes).await?;
    fill(filter, &Pages { client, statement }, window, progress).await
}

/// The PostgreSQL record table's pages: one prepared statement on one connection.
struct Pages {
    client: deadpool_postgres::Object,
    statement: deadpool_postgres::tokio_postgres::Statement,
}

impl RecentSuccesses for Pages {
    async fn page(&self, window: Duration, after: i64) -> Result<Vec<(i64, BusinessKey)>, StoreError> {
        let limit = REBUILD_BATCH as i64;
        let rows = (self.client)
            .query(&self.statement, &[&window.as_secs_f64(), &after, &limit])
            .await?;
        Ok(rows
            .iter()
            .map(|row| (row.get(0), BusinessKey::new(row.get::<_, String>(1))))
            .collect())
    }
}
