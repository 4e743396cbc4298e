//! The batched mode on PostgreSQL: the lanes are shared with every SQL store
//! (`store/sql/batched/`); this is how they open, claim in, hand out and end a PostgreSQL
//! transaction.

use std::sync::Arc;
use std::time::Duration;

use super::transactional::{
    PgTransaction, PgTransactionalLayer, ROLLBACK, RecordTransaction, abandon, commit, end, open,
};
use crate::error::StoreError;
use crate::outcome::{Outcome, RetryReason};
use crate::record::{BatchHandlerService, BatchedLayer, BatchedService, Begin, RecordStatus};
use crate::store::postgres::claims::claim_batch;
use crate::store::postgres::lost_to_another_transaction;
use crate::store::sql::ClaimRequest;
use crate::store::sql::batched::{TransactionalRecord, WITHDRAWN};
use crate::tier::Tier;

/// The batched transactional record on PostgreSQL: see [`BatchedLayer`].
pub type PgBatchedLayer = BatchedLayer<PgTransactionalLayer>;

/// The batched transactional record on PostgreSQL with per-delivery handlers: see
/// [`BatchedService`].
pub type PgBatchedService<S> = BatchedService<S, PgTransactionalLayer>;

/// The batched transactional record on PostgreSQL with a set handler: see
/// [`BatchHandlerService`].
pub type PgBatchHandlerService<H> = BatchHandlerService<H, PgTransactionalLayer>;

impl PgTransactionalLayer {
    /// The batched mode of this tier (same pool, table and in-flight delay): see
    /// [`BatchedLayer`], which gives its defaults (lanes, batch size, linger).
    pub fn batched(&self) -> PgBatchedLayer {
        BatchedLayer::new(self.clone())
    }
}

/// A batch's open transaction: the connection, and the id of the transaction that claimed
/// (`txid_current()`), once a claim returned it.
pub(crate) struct PgBatch {
    transaction: Arc<RecordTransaction>,
    xid: Option<i64>,
}

impl TransactionalRecord for PgTransactionalLayer {
    type Open = PgBatch;
    type Handle = PgTransaction;

    async fn open(&self, requests: &[ClaimRequest]) -> Result<(PgBatch, Vec<Begin>), StoreError> {
        let (transaction, claimed) = open(&self.pool, &self.statements, requests).await?;
        let batch = PgBatch {
            transaction,
            xid: claimed.transaction_id,
        };
        Ok((batch, claimed.answers))
    }

    async fn claim_more(
        &self,
        open: &mut PgBatch,
        requests: &[ClaimRequest],
    ) -> Result<Vec<Begin>, StoreError> {
        let client = open.transaction.client();
        let claimed = claim_batch(client, &self.statements, requests, RecordStatus::Success).await?;
        open.xid = open.xid.or(claimed.transaction_id);
        Ok(claimed.answers)
    }

    async fn withdraw(&self, open: &PgBatch, requests: &[ClaimRequest]) -> Result<(), StoreError> {
        let keys: Vec<&str> = requests.iter().map(|request| request.key.as_str()).collect();
        let client = open.transaction.client();
        client
            .execute(&self.statements.withdraw, &[&keys, &WITHDRAWN])
            .await?;
        Ok(())
    }

    fn handle(open: &PgBatch) -> PgTransaction {
        PgTransaction(open.transaction.clone())
    }

    async fn commit(&self, open: PgBatch) -> Result<(), Outcome> {
        match open.xid {
            Some(xid) => commit(open.transaction, xid).await,
            // No claim returned the transaction's id: nothing was claimed, nothing to commit.
            None => {
                end(open.transaction, ROLLBACK).await;
                Err(Outcome::retry_later(
                    RetryReason::StoreUnavailable(Tier::Record),
                    "a batch without the claiming transaction's id",
                    None,
                ))
            }
        }
    }

    async fn roll_back(&self, open: PgBatch) {
        end(open.transaction, ROLLBACK).await;
    }

    async fn close(&self, open: PgBatch) {
        match Arc::try_unwrap(open.transaction) {
            // Dropped unmarked, the connection is closed.
            Ok(transaction) => drop(transaction),
            Err(held) => abandon(held).await,
        }
    }

    fn lost_to_another_transaction(error: &StoreError) -> bool {
        lost_to_another_transaction(error)
    }

    async fn note_failure(&self, request: &ClaimRequest, error: &str) {
        self.note_failed_attempt(request, error).await;
    }

    fn in_flight_delay(&self) -> Duration {
        self.in_flight_delay
    }

    /// Never: a failed statement aborts a PostgreSQL transaction, so the next handler's
    /// statement fails and answers for it, and the commit check sees it.
    fn doomed(_: &PgBatch) -> Option<String> {
        None
    }
}
