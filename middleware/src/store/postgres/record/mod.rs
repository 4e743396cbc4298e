//! The PostgreSQL record tier: the `consumption_record` table on `deadpool-postgres`.
//!
//! Two modes:
//! - **Three-step** ([`PgRecordStore`] under a [`RecordLayer`](crate::record::RecordLayer)),
//!   for effects outside the database (SMS, HTTP calls): insert `PROCESSING` with a lease,
//!   run the handler, then mark `SUCCESS` or `FAILURE`. Claims from concurrent deliveries
//!   can be coalesced into one multi-row statement ([`PgRecordStore::with_coalescing`]). A
//!   crash between the effect and `SUCCESS` leaves a `PROCESSING` row: the
//!   [`Reconciler`](crate::record::Reconciler)
//!   asks your checker whether the effect happened and settles it.
//! - **Transactional** ([`PgTransactionalLayer`]), for effects in the same database: the
//!   record insert and the handler's own writes commit in one transaction, so the effect and
//!   "processed" can never disagree. This is the mode that makes effects exactly-once.
//!
//! The table comes from [`migrate`](crate::postgres::migrate); its name is configurable and
//! validated, and every value is a bound parameter.

mod batched;
mod commit_rows;
mod retention;
mod transactional;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

pub use self::batched::{PgBatchHandlerService, PgBatchedLayer, PgBatchedService};
pub use self::commit_rows::CommitRows;
pub use self::retention::PgRetentionRunner;
pub use self::transactional::{PgTransaction, PgTransactionalLayer, PgTransactionalTicket};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus, RecordStore, StuckRecords};
use crate::store::postgres::claims::{ClaimRequest, Statements, claim_batch, read_record, to_i64};
use crate::store::postgres::{Checkout, Table};
use crate::store::sql::coalesce::{self, ClaimCoalescer, ClaimMany};

/// A three-step [`RecordStore`] on PostgreSQL, shared by every consumer process.
///
/// Each call takes a connection from the pool for one statement (two when a claim finds
/// the key taken). With [coalescing](PgRecordStore::with_coalescing), claims that wait at
/// the same moment share one statement and one round trip.
#[derive(Clone)]
pub struct PgRecordStore {
    pool: Pool,
    table: Table,
    statements: Arc<Statements>,
    coalescer: Option<ClaimCoalescer>,
}

impl PgRecordStore {
    /// A store on `pool` using the record table `table` (create it with
    /// [`migrate`](crate::postgres::migrate)). Each claim is its own statement.
    pub fn new(pool: Pool, table: Table) -> Self {
        PgRecordStore {
            statements: Statements::new(&table),
            pool,
            table,
            coalescer: None,
        }
    }

    /// Batches the claims of concurrent deliveries into multi-row statements, group-commit
    /// style: a claim leaves at once, together with every other claim waiting at that
    /// moment (up to `max_rows`), whenever fewer than `max_batches` batches are on the wire;
    /// otherwise it waits for one of them to finish and joins the next. A lone claim adds no
    /// delay; many in flight share round trips. Each batch runs on its own pooled connection,
    /// so keep `max_batches` at or below the pool's size.
    ///
    /// Starts a background task on the current Tokio runtime, which ends when the last clone
    /// of the store is dropped.
    pub fn with_coalescing(mut self, max_rows: usize, max_batches: usize) -> Self {
        let claims = PgClaims {
            pool: self.pool.clone(),
            statements: self.statements.clone(),
        };
        self.coalescer = Some(coalesce::spawn(claims, max_rows.max(1), max_batches));
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
        Checkout::run(&self.pool, async |client| {
            let statement = client.prepare_cached(&self.statements.settle).await?;
            let changed = client
                .execute(
                    &statement,
                    &[&key.as_str(), &retry_count, &status.as_str(), &error],
                )
                .await?;
            Ok(changed == 1)
        })
        .await
    }
}

/// The coalesced claims of a [`PgRecordStore`]: one statement for a batch's keys, on a
/// pooled connection of its own.
struct PgClaims {
    pool: Pool,
    statements: Arc<Statements>,
}

/// Answers every key: the statement claims what it can and reads why it could not claim the
/// rest.
impl ClaimMany for PgClaims {
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Result<Vec<Option<Begin>>, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let claimed = claim_batch(client, &self.statements, requests, RecordStatus::Processing).await?;
            Ok(claimed.answers.into_iter().map(Some).collect())
        })
        .await
    }
}

impl fmt::Debug for PgRecordStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgRecordStore")
            .field("table", &self.table)
            .field("coalescing", &self.coalescer.is_some())
            .finish_non_exhaustive()
    }
}

impl RecordStore for PgRecordStore {
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
            // Every key is answered in the batch.
            return Ok(coalescer.ask(request).await?.unwrap_or(Begin::InProgress));
        }
        Checkout::run(&self.pool, async |client| {
            let claimed = claim_batch(client, &self.statements, &[request], RecordStatus::Processing).await?;
            Ok(claimed.answers.into_iter().next().unwrap_or(Begin::InProgress))
        })
        .await
    }

    async fn succeed(&self, key: &BusinessKey, attempt: u32) -> Result<bool, StoreError> {
        self.settle(key, attempt, RecordStatus::Success, None).await
    }

    async fn fail(&self, key: &BusinessKey, attempt: u32, error: &str) -> Result<bool, StoreError> {
        self.settle(key, attempt, RecordStatus::Failure, Some(error))
            .await
    }

    async fn get(&self, key: &BusinessKey) -> Result<Option<ConsumptionRecord>, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let row = client.query_opt(&self.statements.get, &[&key.as_str()]).await?;
            row.as_ref().map(read_record).transpose()
        })
        .await
    }
}

impl StuckRecords for PgRecordStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<(BusinessKey, u32)>, StoreError> {
        let limit = to_i64(limit as u64);
        Checkout::run(&self.pool, async |client| {
            let rows = client.query(&self.statements.stuck, &[&limit]).await?;
            Ok(rows
                .iter()
                .map(|row| {
                    let retry_count: i32 = row.get(1);
                    let attempt = u32::try_from(retry_count).unwrap_or(0) + 1;
                    (BusinessKey::new(row.get::<_, &str>(0)), attempt)
                })
                .collect())
        })
        .await
    }

    async fn settle_stuck(
        &self,
        key: &BusinessKey,
        attempt: u32,
        status: RecordStatus,
        note: Option<&str>,
    ) -> Result<bool, StoreError> {
        let retry_count = crate::store::sql::retry_count(attempt);
        Checkout::run(&self.pool, async |client| {
            let changed = client
                .execute(
                    &self.statements.reconcile,
                    &[&key.as_str(), &retry_count, &status.as_str(), &note],
                )
                .await?;
            Ok(changed == 1)
        })
        .await
    }
}
