//! Filling a pre-filter on start from the MySQL/MariaDB record table.

use std::time::Duration;

use sqlx::MySqlPool;

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::prefilter::PreFilter;
use crate::store::mysql::Table;
use crate::store::mysql::claims::key_of;
use crate::store::sql::prefilter::{REBUILD_BATCH, RecentSuccesses, fill};
use crate::store::sql::{micros, to_i64};

/// Fills `filter` with the keys the MySQL/MariaDB record table `records` holds as
/// `SUCCESS`, settled within the last `window` (on the server's clock), and returns how many
/// it read; `progress` is called after each batch of 10,000 rows with the count so far.
/// What `rebuild_from_records` is for PostgreSQL, with the same trade-offs: reads in pages
/// by id in autocommit, holding no long transaction; rows settled while it runs may be
/// missed, which only costs speed.
pub async fn rebuild_from_mysql_records<F: PreFilter>(
    filter: &F,
    pool: &MySqlPool,
    records: &Table,
    window: Duration,
    progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let pages = Pages {
        pool: pool.clone(),
        sql: format!(
            "SELECT id, message_key FROM {records}
             WHERE status = 'SUCCESS' AND updated_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND id > ?
             ORDER BY id LIMIT ?"
        ),
    };
    fill(filter, &pages, window, progress).await
}

/// The MySQL record table's pages.
struct Pages {
    pool: MySqlPool,
    sql: String,
}

impl RecentSuccesses for Pages {
    async fn page(&self, window: Duration, after: i64) -> Result<Vec<(i64, BusinessKey)>, StoreError> {
        let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(&self.sql)
            .bind(micros(window))
            .bind(after)
            .bind(to_i64(REBUILD_BATCH))
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter().map(|(id, key)| Ok((id, key_of(key)?))).collect()
    }
}
