//! Repairs three-step records stuck in `PROCESSING`: the loop is written once here; each
//! store answers [`StuckRecords`] in its own home. Old `SUCCESS` rows are the
//! [`Retention`](super::Retention) service's.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::RecordStatus;
use crate::envelope::BusinessKey;
use crate::error::{BoxError, StoreError};

/// A record store a [`Reconciler`] can repair: it finds three-step records stuck in
/// `PROCESSING` past their lease and settles one only while it is still that stuck attempt.
/// `PgRecordStore` and
/// `MysqlRecordStore` implement it.
pub trait StuckRecords: Send + Sync + 'static {
    /// Up to `limit` records in `PROCESSING` whose lease ran out, oldest lease first: each
    /// key with its attempt.
    fn stuck(&self, limit: usize)
    -> impl Future<Output = Result<Vec<(BusinessKey, u32)>, StoreError>> + Send;

    /// Marks `key`'s record `status` with `note` as its error text, only if it is still
    /// attempt `attempt`, `PROCESSING` and past its lease: a delivery that took it over
    /// meanwhile wins. True when it changed the record.
    fn settle_stuck(
        &self,
        key: &BusinessKey,
        attempt: u32,
        status: RecordStatus,
        note: Option<&str>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// Answers "did the business effect happen for this key?", from the business's own data
/// (an order row, a provider's API).
pub trait EffectCheck: Send + Sync + 'static {
    /// True when the effect of `key` is in place.
    fn effect_applied(&self, key: &BusinessKey) -> impl Future<Output = Result<bool, BoxError>> + Send;
}

impl<F, Fut> EffectCheck for F
where
    F: Fn(BusinessKey) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<bool, BoxError>> + Send,
{
    fn effect_applied(&self, key: &BusinessKey) -> impl Future<Output = Result<bool, BoxError>> + Send {
        self(key.clone())
    }
}

/// What one reconciler pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// `PROCESSING` rows past their lease that the pass looked at.
    pub examined: usize,
    /// Rows whose effect had happened: marked `SUCCESS`.
    pub marked_success: usize,
    /// Rows whose effect had not happened: marked `FAILURE`, so the next delivery of the key
    /// takes it over and runs the handler.
    pub released: usize,
    /// Rows a delivery took over (or settled) while the pass checked them: left alone.
    pub changed_meanwhile: usize,
    /// Rows whose check failed: left `PROCESSING` for the next pass.
    pub check_failed: usize,
}

impl fmt::Display for ReconcileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "examined {}, marked success {}, released {}, changed meanwhile {}, check failed {}",
            self.examined, self.marked_success, self.released, self.changed_meanwhile, self.check_failed
        )
    }
}

/// Finds three-step records stuck in `PROCESSING` past their lease — a consumer crashed
/// mid-handler, or could not mark `SUCCESS` — and settles each from an [`EffectCheck`]:
/// effect in place → `SUCCESS`; not in place → `FAILURE` (released for retry). A row is
/// changed only if it is still the same stuck attempt, so a delivery taking it over at the
/// same moment wins.
///
/// Run it once with [`run_once`](Reconciler::run_once), or every so often with
/// [`spawn`](Reconciler::spawn). Several reconcilers may run at once: each row change is
/// conditional, so they cannot undo each other.
///
/// ```no_run
/// # use oncely::BusinessKey;
/// # use oncely::record::{PgRecordStore, Reconciler};
/// # async fn run(records: PgRecordStore) -> Result<(), oncely::StoreError> {
/// let reconciler = Reconciler::new(records, |key: BusinessKey| async move {
///     // Look the effect up in the business's own data.
///     Ok::<bool, oncely::BoxError>(key.as_str().starts_with("paid-"))
/// });
/// let report = reconciler.run_once().await?;
/// # Ok(()) }
/// ```
pub struct Reconciler<C, S> {
    records: S,
    check: Arc<C>,
    batch_size: usize,
}

impl<C: EffectCheck, S: StuckRecords + fmt::Debug> Reconciler<C, S> {
    /// A reconciler of `records` asking `check`. Defaults: 500 rows a pass.
    pub fn new(records: S, check: C) -> Self {
        Reconciler {
            records,
            check: Arc::new(check),
            batch_size: 500,
        }
    }

    /// How many stuck rows one pass examines at most (oldest lease first).
    pub fn with_batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// One pass: settles up to the batch size of stuck rows.
    pub async fn run_once(&self) -> Result<ReconcileReport, StoreError> {
        let mut report = ReconcileReport::default();
        for (key, attempt) in self.records.stuck(self.batch_size).await? {
            report.examined += 1;
            let (status, note) = match self.check.effect_applied(&key).await {
                Ok(true) => (RecordStatus::Success, None),
                Ok(false) => (
                    RecordStatus::Failure,
                    Some("reconciler: effect not found after the lease; released for retry"),
                ),
                Err(error) => {
                    tracing::warn!(%key, %error, "reconciler check failed; the row stays PROCESSING");
                    report.check_failed += 1;
                    continue;
                }
            };
            match (
                self.records.settle_stuck(&key, attempt, status, note).await?,
                status,
            ) {
                (false, _) => report.changed_meanwhile += 1,
                (true, RecordStatus::Success) => report.marked_success += 1,
                (true, _) => report.released += 1,
            }
        }
        Ok(report)
    }

    /// Runs a pass every `every` until `shutdown` is cancelled, logging each report; a failed
    /// pass is logged and retried at the next tick.
    pub fn spawn(self, every: Duration, shutdown: CancellationToken) -> JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                match self.run_once().await {
                    Ok(report) => tracing::info!(records = ?self.records, %report, "reconciler pass"),
                    Err(error) => tracing::warn!(records = ?self.records, %error, "reconciler pass failed"),
                }
                if shutdown
                    .run_until_cancelled(tokio::time::sleep(every))
                    .await
                    .is_none()
                {
                    return;
                }
            }
        })
    }
}

impl<C, S: fmt::Debug> fmt::Debug for Reconciler<C, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciler")
            .field("records", &self.records)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}
