//! The record tier on MySQL and MariaDB: the three-step store and the transactional mode.

mod batched;
mod retention;
mod transactional;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::MySqlPool;

pub use self::batched::{MysqlBatchHandlerService, MysqlBatchedLayer, MysqlBatchedService};
pub use self::retention::MysqlRetentionRunner;
pub use self::transactional::{MysqlTransactionalLayer, MysqlTransactionalTicket};
use super::Table;
use super::claims::{Statements, check_key_len, claim, claim_many, kept_error, key_of, read_record};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus, RecordStore, StuckRecords};
use crate::store::sql::coalesce::{self, ClaimCoalescer, ClaimMany};
use crate::store::sql::{ClaimRequest, to_i64};

/// A three-step [`RecordStore`] on MySQL 8 or MariaDB, shared by every consumer process.
///
/// A claim of a new key is one `INSERT`; of a key with a row, one read of it and, when it
/// may be taken over, an `UPDATE` that takes it. Each runs in autocommit, so what it locks
/// (the row, or under REPEATABLE READ the index range a duplicate `INSERT` checks) is held
/// for that one statement only. With [coalescing](MysqlRecordStore::with_coalescing), the
/// claims that wait at the same moment share two round trips: one read of the rows their
/// keys have, one multi-row `INSERT` of the new keys. Leases and timestamps run on the
/// server's clock, in UTC whatever the session's time zone.
///
/// Limits: business keys up to [`MYSQL_MAX_KEY_BYTES`](crate::record::MYSQL_MAX_KEY_BYTES)
/// (the route's default limit of 256 bytes fits): a longer one is refused with a
/// [`StoreError`], never cut, since a cut key could be another key. Error texts are kept up
/// to 16,383 characters (what `TEXT` holds of 4-byte ones). For effects in the same database, the [`MysqlTransactionalLayer`] commits the
/// record with them instead.
#[derive(Clone)]
pub struct MysqlRecordStore {
    pool: MySqlPool,
    table: Table,
    statements: Arc<Statements>,
    coalescer: Option<ClaimCoalescer>,
}

impl MysqlRecordStore {
    /// A store on `pool` using the record table `table` (create it with
    /// [`migrate`](crate::mysql::migrate)).
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        MysqlRecordStore {
            statements: Statements::new(&table),
            pool,
            table,
            coalescer: None,
        }
    }

    /// Batches the claims of concurrent deliveries, group-commit style, as
    /// `PgRecordStore::with_coalescing` does: a claim leaves at once, together with every
    /// other claim waiting at that moment (up to `max_rows`), whenever fewer than
    /// `max_batches` batches are on the wire; otherwise it joins the next. A lone claim adds
    /// no delay.
    ///
    /// Starts a background task on the current Tokio runtime, which ends when the last clone
    /// of the store is dropped.
    ///
    /// A batch of one or two claims runs each on its own, side by side (one round trip each,
    /// against the batch's two), on up to two connections: keep `max_batches` at or below
    /// half the pool's size. A takeover is always claimed on its own, after the batch.
    ///
    /// `max_rows` is capped at 1,000: a batch is two statements carrying its keys as
    /// literals, about 4.3 KB per row for keys of the longest kind, and 1,000 rows stay well
    /// under MySQL's and MariaDB's smallest default `max_allowed_packet` (16 MiB).
    pub fn with_coalescing(mut self, max_rows: usize, max_batches: usize) -> Self {
        let claims = MysqlClaims {
            pool: self.pool.clone(),
            statements: self.statements.clone(),
        };
        self.coalescer = Some(coalesce::spawn(claims, max_rows.clamp(1, 1000), max_batches));
        self
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

/// The coalesced claims of a [`MysqlRecordStore`]: a batch's new keys in two round trips, on
/// a pooled connection of its own; a takeover is left to its caller.
struct MysqlClaims {
    pool: MySqlPool,
    statements: Arc<Statements>,
}

/// `request`'s key claimed as `PROCESSING` on its own, on a pooled connection of its own.
async fn claim_alone(
    pool: &MySqlPool,
    statements: &Statements,
    request: &ClaimRequest,
) -> Result<Begin, StoreError> {
    let mut connection = pool.acquire().await?;
    claim(&mut connection, statements, request, RecordStatus::Processing).await
}

/// The fewest claims a batch makes in its two statements: a claim alone costs one round
/// trip, so one or two claims are quicker each alone, side by side on connections of their
/// own (measured: a batch of one cost 0.60× the raw `INSERT`).
const FEWEST_IN_A_BATCH: usize = 3;

impl ClaimMany for MysqlClaims {
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Result<Vec<Option<Begin>>, StoreError> {
        if requests.len() < FEWEST_IN_A_BATCH {
            // Run here, not handed back to the callers: the batch's slot stays taken while
            // they run, so that the claims arriving meanwhile gather into the next batch
            // (handed back at once, every batch stayed this small). A claim that failed is
            // left to its caller, which tries once more on its own.
            let alone = (requests.iter()).map(|request| claim_alone(&self.pool, &self.statements, request));
            let answers = futures_util::future::join_all(alone).await;
            return Ok(answers.into_iter().map(Result::ok).collect());
        }
        let mut connection = self.pool.acquire().await?;
        claim_many(
            &mut connection,
            &self.statements,
            requests,
            RecordStatus::Processing,
        )
        .await
    }
}

impl fmt::Debug for MysqlRecordStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlRecordStore")
            .field("table", &self.table)
            .field("coalescing", &self.coalescer.is_some())
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
        if let Some(coalescer) = &self.coalescer {
            // Checked here: one key the table cannot hold must not fail its whole batch.
            check_key_len(key)?;
            if let Some(answer) = coalescer.ask(request.clone()).await? {
                return Ok(answer);
            }
            // A takeover, a key another consumer inserted during the batch, or a claim of a
            // batch of one or two that failed: alone.
        }
        claim_alone(&self.pool, &self.statements, &request).await
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
}
