//! The batched mode on MySQL and MariaDB: the lanes are shared with every SQL store
//! (`store/sql/batched/`); this is how they open, claim in, hand out and end an XA
//! transaction.

use std::sync::Arc;
use std::time::Duration;

use super::transactional::{MysqlTransactionalLayer, commit, lost_to_another_claim};
use crate::error::StoreError;
use crate::outcome::Outcome;
use crate::record::{BatchHandlerService, BatchedLayer, BatchedService, Begin};
use crate::store::mysql::transaction::{MysqlTransaction, OpenTransaction};
use crate::store::sql::ClaimRequest;
use crate::store::sql::batched::{TransactionalRecord, WITHDRAWN};

/// The batched transactional record on MySQL or MariaDB: see [`BatchedLayer`].
pub type MysqlBatchedLayer = BatchedLayer<MysqlTransactionalLayer>;

/// The batched transactional record on MySQL or MariaDB with per-delivery handlers: see
/// [`BatchedService`].
pub type MysqlBatchedService<S> = BatchedService<S, MysqlTransactionalLayer>;

/// The batched transactional record on MySQL or MariaDB with a set handler: see
/// [`BatchHandlerService`].
pub type MysqlBatchHandlerService<H> = BatchHandlerService<H, MysqlTransactionalLayer>;

impl MysqlTransactionalLayer {
    /// The batched mode of this tier (same pool, table and in-flight delay): see
    /// [`BatchedLayer`], which gives its defaults (lanes, batch size, linger). Each lane
    /// holds a pooled connection.
    pub fn batched(&self) -> MysqlBatchedLayer {
        BatchedLayer::new(self.clone())
    }
}

impl TransactionalRecord for MysqlTransactionalLayer {
    type Open = Arc<OpenTransaction>;
    type Handle = MysqlTransaction;

    async fn open(&self, requests: &[ClaimRequest]) -> Result<(Self::Open, Vec<Begin>), StoreError> {
        let transaction = OpenTransaction::start(&self.pool, &self.killer).await?;
        match transaction.claim(&self.statements, requests).await {
            Ok(answers) => Ok((Arc::new(transaction), answers)),
            Err(error) => {
                transaction.roll_back().await;
                Err(error)
            }
        }
    }

    async fn claim_more(
        &self,
        open: &mut Self::Open,
        requests: &[ClaimRequest],
    ) -> Result<Vec<Begin>, StoreError> {
        open.claim(&self.statements, requests).await
    }

    async fn withdraw(&self, open: &Self::Open, requests: &[ClaimRequest]) -> Result<(), StoreError> {
        open.withdraw(&self.statements, requests, WITHDRAWN).await
    }

    fn handle(open: &Self::Open) -> MysqlTransaction {
        MysqlTransaction(open.clone())
    }

    async fn commit(&self, open: Self::Open) -> Result<(), Outcome> {
        commit(MysqlTransaction(open)).await
    }

    async fn roll_back(&self, open: Self::Open) {
        open.roll_back().await;
    }

    async fn close(&self, open: Self::Open) {
        open.close().await;
    }

    fn lost_to_another_transaction(error: &StoreError) -> bool {
        lost_to_another_claim(error)
    }

    async fn note_failure(&self, request: &ClaimRequest, error: &str) {
        self.note_failed_attempt(request, error).await;
    }

    fn in_flight_delay(&self) -> Duration {
        self.in_flight_delay
    }

    fn doomed(open: &Self::Open) -> Option<String> {
        open.failure()
    }
}
