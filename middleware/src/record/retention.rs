//! The retention service: deletes old `SUCCESS` records in bounded batches, one runner at a
//! time across every process. The loop is written once here; each store answers
//! [`RetentionStore`] in its own home (PostgreSQL: an advisory lock; MySQL and MariaDB:
//! `GET_LOCK`).

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::StoreError;

/// Rows one purge batch deletes unless configured otherwise: small enough that a batch
/// holds its row locks and undo for milliseconds, large enough that 90 million rows take
/// some 18,000 statements rather than millions.
pub const DEFAULT_BATCH_ROWS: u32 = 5_000;

/// A record store whose old `SUCCESS` rows a [`Retention`] can purge. `PgRecordStore` and
/// `MysqlRecordStore` implement it.
pub trait RetentionStore: Send + Sync + 'static {
    /// The lease on the store's purge while one runner holds it.
    type Runner: RetentionRunner;

    /// Takes the purge lease of the store's table if no other runner (in any process) holds
    /// it: `None` when one does. The lease is held by a session of the database, so a
    /// runner that dies lets it go with its connection.
    fn lead(&self) -> impl Future<Output = Result<Option<Self::Runner>, StoreError>> + Send;

    /// What to name the store in logs and metrics (its table).
    fn name(&self) -> String;
}

/// The purge lease of one runner, from [`RetentionStore::lead`].
pub trait RetentionRunner: Send {
    /// Deletes up to `rows` `SUCCESS` records not updated for `age`, in one statement of its
    /// own transaction; answers how many went.
    fn purge_batch(
        &mut self,
        age: Duration,
        rows: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Gives the lease back. A runner dropped without it closes its session instead,
    /// which gives the lease back as well.
    fn step_down(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// What one [`Retention`] pass did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetentionPass {
    /// This runner held the lease and purged until a batch came back short.
    Purged {
        /// Rows deleted.
        rows: u64,
        /// Batches (statements) it took.
        batches: u64,
        /// How long the pass took.
        elapsed: Duration,
    },
    /// Another runner holds the lease: this pass purged nothing.
    Busy,
}

impl fmt::Display for RetentionPass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetentionPass::Purged {
                rows,
                batches,
                elapsed,
            } => {
                write!(f, "purged {rows} rows in {batches} batches, {elapsed:.1?}")
            }
            RetentionPass::Busy => f.write_str("another runner holds the purge lease"),
        }
    }
}

/// Deletes `SUCCESS` records not updated for longer than the retention, in batches, run by
/// exactly one instance at a time: each pass first takes the store's purge lease
/// ([`RetentionStore::lead`]), and a pass that finds it held does nothing
/// ([`RetentionPass::Busy`]). Start it in every consumer process; whichever gets the lease
/// purges.
///
/// Choosing the retention: a purged key is new again, so a copy that arrives after its
/// record was purged applies its effect a second time. Keep the retention longer than the
/// longest path a copy can take back to the consumer: the broker's retry ladder (with the
/// AMQP runner's default ladder and 16 attempts, about 25 minutes), plus the time a message
/// may wait in the dead-letter destination before someone replays it, plus producer retries
/// and any queue backlog. The README gives the formula beside the flag's TTL ("The record's
/// retention", under Redis).
///
/// Safe while consumers run: a batch deletes only `SUCCESS` rows older than the retention,
/// in its own short transaction, and a claim that races the delete of its key's row answers
/// a retry (it never treats the key as new while the row is going).
///
/// Progress goes to `metrics` (feature `metrics`): `oncely_retention_purged_rows_total`,
/// `oncely_retention_batches_total` and `oncely_retention_passes_total{result}`
/// (`purged`, `busy`, `failed`), labelled with the `table`.
///
/// ```no_run
/// # use std::time::Duration;
/// # use oncely::record::{PgRecordStore, Retention};
/// # async fn run(records: PgRecordStore) -> Result<(), oncely::StoreError> {
/// let retention = Retention::new(records, Duration::from_secs(7 * 24 * 3600)).with_batch_rows(10_000);
/// println!("{}", retention.run_once().await?);
/// # Ok(()) }
/// ```
pub struct Retention<S> {
    store: S,
    age: Duration,
    batch_rows: u32,
}

impl<S: RetentionStore> Retention<S> {
    /// Purges the `SUCCESS` records of `store` not updated for `age`, in batches of
    /// [`DEFAULT_BATCH_ROWS`].
    pub fn new(store: S, age: Duration) -> Self {
        Retention {
            store,
            age,
            batch_rows: DEFAULT_BATCH_ROWS,
        }
    }

    /// Sets the rows one batch deletes at most (at least 1).
    pub fn with_batch_rows(mut self, rows: u32) -> Self {
        self.batch_rows = rows.max(1);
        self
    }

    /// The retention age.
    pub fn age(&self) -> Duration {
        self.age
    }

    /// One pass: takes the lease, purges batch after batch until one comes back short, and
    /// gives the lease back.
    pub async fn run_once(&self) -> Result<RetentionPass, StoreError> {
        self.run_once_with_progress(|_| {}).await
    }

    /// [`run_once`](Self::run_once), calling `on_batch` with the rows of each batch as it
    /// completes (a progress bar, say).
    pub async fn run_once_with_progress(
        &self,
        mut on_batch: impl FnMut(u64) + Send,
    ) -> Result<RetentionPass, StoreError> {
        let name = self.store.name();
        let Some(mut runner) = self.store.lead().await? else {
            crate::telemetry::count_retention_pass(&name, "busy");
            return Ok(RetentionPass::Busy);
        };
        let started = Instant::now();
        let (mut rows, mut batches) = (0, 0);
        loop {
            let deleted = match runner.purge_batch(self.age, self.batch_rows).await {
                Ok(deleted) => deleted,
                Err(error) => {
                    crate::telemetry::count_retention_pass(&name, "failed");
                    // Dropping the runner closes its session, which gives the lease back.
                    return Err(error);
                }
            };
            rows += deleted;
            batches += 1;
            crate::telemetry::count_purged(&name, deleted);
            on_batch(deleted);
            if deleted < u64::from(self.batch_rows) {
                break;
            }
        }
        if let Err(error) = runner.step_down().await {
            crate::telemetry::count_retention_pass(&name, "failed");
            return Err(error);
        }
        crate::telemetry::count_retention_pass(&name, "purged");
        Ok(RetentionPass::Purged {
            rows,
            batches,
            elapsed: started.elapsed(),
        })
    }

    /// Runs a pass every `every` until `shutdown` is cancelled, logging each pass that
    /// purged something at info and each failure at warn; a failed pass is retried at the
    /// next tick.
    pub fn spawn(self, every: Duration, shutdown: CancellationToken) -> JoinHandle<()> {
        tokio::spawn(async move {
            let table = self.store.name();
            loop {
                match shutdown.run_until_cancelled(self.run_once()).await {
                    None => return,
                    Some(Ok(pass @ RetentionPass::Purged { rows: 1.., .. })) => {
                        tracing::info!(table, %pass, "retention pass");
                    }
                    Some(Ok(pass)) => tracing::debug!(table, %pass, "retention pass"),
                    Some(Err(error)) => tracing::warn!(table, %error, "retention pass failed"),
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

impl<S: RetentionStore> fmt::Debug for Retention<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retention")
            .field("store", &self.store.name())
            .field("age", &self.age)
            .field("batch_rows", &self.batch_rows)
            .finish()
    }
}
