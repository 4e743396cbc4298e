//! Repairs three-step records stuck in `PROCESSING`, and purges old `SUCCESS` rows.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::envelope::BusinessKey;
use crate::error::{BoxError, StoreError};
use crate::store::postgres::Table;
use crate::store::postgres::claims::{Statements, to_i64};

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
    /// `SUCCESS` rows deleted by the retention purge.
    pub purged: u64,
}

impl fmt::Display for ReconcileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "examined {}, marked success {}, released {}, changed meanwhile {}, check failed {}, purged {}",
            self.examined,
            self.marked_success,
            self.released,
            self.changed_meanwhile,
            self.check_failed,
            self.purged
        )
    }
}

/// Finds three-step records stuck in `PROCESSING` past their lease — a consumer crashed
/// mid-handler, or could not mark `SUCCESS` — and settles each from an [`EffectCheck`]:
/// effect in place → `SUCCESS`; not in place → `FAILURE` (released for retry). A row is
/// changed only if it is still the same stuck attempt, so a delivery taking it over at the
/// same moment wins. Optionally purges `SUCCESS` rows older than a retention age.
///
/// Run it once with [`run_once`](Reconciler::run_once), or every so often with
/// [`spawn`](Reconciler::spawn). Several reconcilers may run at once: each row change is
/// conditional, so they cannot undo each other.
pub struct Reconciler<C> {
    pool: Pool,
    table: Table,
    statements: Arc<Statements>,
    check: Arc<C>,
    batch_size: i64,
    retention: Option<Duration>,
}

impl<C: EffectCheck> Reconciler<C> {
    /// A reconciler of the record table `table` asking `check`. Defaults: 500 rows a pass,
    /// no purge.
    pub fn new(pool: Pool, table: Table, check: C) -> Self {
        Reconciler {
            pool,
            statements: Statements::new(&table),
            table,
            check: Arc::new(check),
            batch_size: 500,
            retention: None,
        }
    }

    /// How many stuck rows one pass examines at most (oldest lease first).
    pub fn with_batch_size(mut self, rows: usize) -> Self {
        self.batch_size = to_i64(rows as u64).max(1);
        self
    }

    /// Deletes `SUCCESS` rows not updated for `age` at each pass. Keep `age` longer than any
    /// redelivery can come late: a purged key is new again.
    pub fn with_retention(mut self, age: Duration) -> Self {
        self.retention = Some(age);
        self
    }

    /// One pass: settles up to the batch size of stuck rows, then purges.
    pub async fn run_once(&self) -> Result<ReconcileReport, StoreError> {
        let mut report = ReconcileReport::default();
        let client = self.pool.get().await?;
        let stuck = client.query(&self.statements.stuck, &[&self.batch_size]).await?;
        for row in stuck {
            report.examined += 1;
            let key = BusinessKey::new(row.get::<_, &str>(0));
            let retry_count: i32 = row.get(1);
            let (status, note) = match self.check.effect_applied(&key).await {
                Ok(true) => ("SUCCESS", None),
                Ok(false) => (
                    "FAILURE",
                    Some("reconciler: effect not found after the lease; released for retry"),
                ),
                Err(error) => {
                    tracing::warn!(%key, %error, "reconciler check failed; the row stays PROCESSING");
                    report.check_failed += 1;
                    continue;
                }
            };
            let changed = client
                .execute(
                    &self.statements.reconcile,
                    &[&key.as_str(), &retry_count, &status, &note],
                )
                .await?;
            match (changed, status) {
                (0, _) => report.changed_meanwhile += 1,
                (_, "SUCCESS") => report.marked_success += 1,
                _ => report.released += 1,
            }
        }
        if let Some(age) = self.retention {
            report.purged = self.purge(&client, age).await?;
        }
        Ok(report)
    }

    /// Deletes old `SUCCESS` rows in slices, so one pass never holds a long lock or builds a
    /// huge transaction.
    async fn purge(&self, client: &deadpool_postgres::Client, age: Duration) -> Result<u64, StoreError> {
        let age_ms = to_i64(age.as_millis() as u64);
        let mut purged = 0;
        loop {
            let deleted = client.execute(&self.statements.purge, &[&age_ms]).await?;
            purged += deleted;
            if deleted == 0 {
                return Ok(purged);
            }
        }
    }

    /// Runs a pass every `every` until `shutdown` is cancelled, logging each report; a failed
    /// pass is logged and retried at the next tick.
    pub fn spawn(self, every: Duration, shutdown: CancellationToken) -> JoinHandle<()>
    where
        C: EffectCheck,
    {
        tokio::spawn(async move {
            loop {
                match self.run_once().await {
                    Ok(report) => tracing::info!(table = %self.table, %report, "reconciler pass"),
                    Err(error) => tracing::warn!(table = %self.table, %error, "reconciler pass failed"),
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

impl<C> fmt::Debug for Reconciler<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciler")
            .field("table", &self.table)
            .field("batch_size", &self.batch_size)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}
