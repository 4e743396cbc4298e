//! The record tier on MySQL and MariaDB: the three-step store and the transactional mode.

mod batched;
mod transactional;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::MySqlPool;

pub use self::batched::{MysqlBatchHandlerService, MysqlBatchedLayer, MysqlBatchedService};
pub use self::transactional::{MysqlTransactionalLayer, MysqlTransactionalTicket};
use super::Table;
use super::claims::{Statements, claim, kept_error, key_of, read_record};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus, RecordStore, StuckRecords};
use crate::store::sql::{ClaimRequest, micros, to_i64};

/// A three-step [`RecordStore`] on MySQL 8 or MariaDB, shared by every consumer process.
///
/// A claim of a new key is one `INSERT`; of a key with a row, one read of it and, when it
/// may be taken over, an `UPDATE` that takes it. Each runs in autocommit, so what it locks
/// (the row, or under REPEATABLE READ the index range a duplicate `INSERT` checks) is held
/// for that one statement only. Leases and timestamps run on the server's clock, in UTC
/// whatever the session's time zone.
///
/// Limits: business keys up to [`MYSQL_MAX_KEY_BYTES`](crate::record::MYSQL_MAX_KEY_BYTES)
/// (the route's default limit of 256 bytes fits): a longer one is refused with a [`StoreError`], never cut, since a cut key could
/// be another key. Error texts are kept up to 16 KiB. No claim coalescing yet (PostgreSQL's
/// only). For effects in the same database, the
/// [`MysqlTransactionalLayer`] commits the record with them instead.
#[derive(Clone)]
pub struct MysqlRecordStore {
    pool: MySqlPool,
    table: Table,
    statements: Arc<Statements>,
}

impl MysqlRecordStore {
    /// A store on `pool` using the record table `table` (create it with
    /// [`migrate`](crate::mysql::migrate)).
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        MysqlRecordStore {
            statements: Statements::new(&table),
            pool,
            table,
        }
    }

    /// The record table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    async fn settle(
        &self,
        key: &BusinessKey,
        attempt: u32,
        status: RecordStatus,
        error: Option<&str>,
    ) -> Result<bool, StoreError> {
        let retry_count = crate::store::sql::retry_count(attempt);
        let settled = sqlx::query(&self.statements.settle)
            .bind(status.as_str())
            .bind(error)
            .bind(key.as_str())
            .bind(retry_count)
            .execute(&self.pool)
            .await?;
        Ok(settled.rows_affected() == 1)
    }
}

impl fmt::Debug for MysqlRecordStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlRecordStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl RecordStore for MysqlRecordStore {
    async fn begin(
        &self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        lease: Duration,
        fencing_token: Option<u64>,
    ) -> Result<Begin, StoreError> {
        let request = ClaimRequest {
            key: key.clone(),
            fingerprint,
            fencing_token,
            lease: Some(lease),
        };
        let mut connection = self.pool.acquire().await?;
        claim(
            &mut connection,
            &self.statements,
            &request,
            RecordStatus::Processing,
        )
        .await
    }

    async fn succeed(&self, key: &BusinessKey, attempt: u32) -> Result<bool, StoreError> {
        self.settle(key, attempt, RecordStatus::Success, None).await
    }

    async fn fail(&self, key: &BusinessKey, attempt: u32, error: &str) -> Result<bool, StoreError> {
        self.settle(key, attempt, RecordStatus::Failure, Some(kept_error(error)))
            .await
    }

    async fn get(&self, key: &BusinessKey) -> Result<Option<ConsumptionRecord>, StoreError> {
        let row = sqlx::query(&self.statements.get)
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(read_record).transpose()
    }
}

impl StuckRecords for MysqlRecordStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<(BusinessKey, u32)>, StoreError> {
        let rows: Vec<(Vec<u8>, i32)> = sqlx::query_as(&self.statements.stuck)
            .bind(to_i64(limit as u64))
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter()
            .map(|(key, retry_count)| Ok((key_of(key)?, u32::try_from(retry_count).unwrap_or(0) + 1)))
            .collect()
    }

    async fn settle_stuck(
        &self,
        key: &BusinessKey,
        attempt: u32,
        status: RecordStatus,
        note: Option<&str>,
    ) -> Result<bool, StoreError> {
        let settled = sqlx::query(&self.statements.settle_stuck)
            .bind(status.as_str())
            .bind(note)
            .bind(key.as_str())
            .bind(crate::store::sql::retry_count(attempt))
            .execute(&self.pool)
            .await?;
        Ok(settled.rows_affected() == 1)
    }

    async fn purge_slice(&self, age: Duration) -> Result<u64, StoreError> {
        let purged = sqlx::query(&self.statements.purge)
            .bind(micros(age))
            .execute(&self.pool)
            .await?;
        Ok(purged.rows_affected())
    }
}
