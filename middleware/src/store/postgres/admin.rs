//! The operator's statements on the record table: what `oncely inspect`, `stuck`, `release`,
//! `mark-done` and `stats` read and change. They live beside the record tier's own
//! statements so that whoever changes the table's meaning sees them too.

use std::time::{Duration, SystemTime};

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::Row;

use super::{Checkout, Table};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::RecordStatus;
use crate::store::sql::{parse_fingerprint, parse_status, to_i64};

/// The columns every statement that reads whole rows returns, in [`read_row`]'s order.
const COLUMNS: &str = "message_key, status, retry_count, error_details, payload_fingerprint, fencing_token,
                       lease_until, created_at, updated_at";

/// The note `release` writes in front of a row's error text.
const RELEASED: &str = "released by an operator";
/// The note `mark_done` writes in front of a row's error text.
const MARKED_DONE: &str = "marked done by an operator";

/// An operator's view of a PostgreSQL record table (made by
/// [`migrate`](crate::postgres::migrate)): one key's row, the stuck rows, counts, and the two
/// hand settlements an operator makes after checking a stuck key by hand.
///
/// Each call takes a pooled connection for its statements; none holds a lock beyond its
/// statement, so it is safe while consumers run.
#[derive(Clone, Debug)]
pub struct PgRecordAdmin {
    pool: Pool,
    table: Table,
    statements: Statements,
}

/// One row of the record table, as an operator reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordRow {
    /// The business key.
    pub key: String,
    /// Its status.
    pub status: RecordStatus,
    /// Attempts begun: the first plus each takeover (`retry_count + 1`).
    pub attempts: u32,
    /// The last error text (`error_details`), with the operator's notes.
    pub last_error: Option<String>,
    /// The fingerprint of the payload the key was first seen with.
    pub fingerprint: Fingerprint,
    /// The lock's fencing token of the attempt that last wrote the row, if a lock ran.
    pub fencing_token: Option<u64>,
    /// Until when a `PROCESSING` attempt holds the key (three-step mode); `None` otherwise.
    pub lease_until: Option<SystemTime>,
    /// When the key was first seen.
    pub created_at: SystemTime,
    /// When the row last changed.
    pub updated_at: SystemTime,
}

/// The `PROCESSING` rows past their lease, oldest lease first: attempts that crashed, or
/// that run longer than their lease.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckReport {
    /// How many rows are stuck in all.
    pub total: u64,
    /// The first of them, up to the limit asked for.
    pub rows: Vec<RecordRow>,
}

/// The record table at a glance.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordStats {
    /// Rows `PROCESSING`.
    pub processing: u64,
    /// Of them, rows past their lease ([`PgRecordAdmin::stuck`]).
    pub stuck: u64,
    /// Rows `SUCCESS`.
    pub success: u64,
    /// Rows `FAILURE`.
    pub failure: u64,
    /// When the oldest `PROCESSING` row was first seen.
    pub oldest_processing_created_at: Option<SystemTime>,
    /// The earliest lease of a `PROCESSING` row.
    pub oldest_processing_lease_until: Option<SystemTime>,
    /// The table's size on disk with its indexes and TOAST, in bytes.
    pub table_bytes: u64,
    /// The retention horizon: when the oldest `SUCCESS` row was settled. A duplicate of a
    /// key settled before it is no longer recognised by the record.
    pub oldest_success_updated_at: Option<SystemTime>,
}

/// The SQL text of every statement, with the table name filled in.
#[derive(Clone, Debug)]
struct Statements {
    inspect: String,
    stuck: String,
    stuck_count: String,
    release: String,
    mark_done: String,
    stats: String,
    purgeable: String,
}

impl Statements {
    fn new(table: &Table) -> Self {
        // The operator decided on the row as shown: a delivery that took the key over since
        // (a new attempt, or a new lease), or a lease still running unless forced ($4),
        // leaves it unchanged.
        let same_attempt = "status = $2 AND retry_count = $3
                 AND ($4 OR lease_until IS NULL OR lease_until < now())";
        Statements {
            inspect: format!("SELECT {COLUMNS} FROM {table} WHERE message_key = $1"),
            stuck: format!(
                "SELECT {COLUMNS} FROM {table} WHERE status = 'PROCESSING' AND lease_until < now()
                 ORDER BY lease_until LIMIT $1"
            ),
            stuck_count: format!(
                "SELECT count(*) FROM {table} WHERE status = 'PROCESSING' AND lease_until < now()"
            ),
            // FAILURE, as a failed attempt leaves it: the key's next delivery takes it over.
            release: format!(
                "UPDATE {table} SET status = 'FAILURE', lease_until = NULL, updated_at = now(),
                        error_details = concat_ws('; ', '{RELEASED}'::text, error_details)
                 WHERE message_key = $1 AND status = 'PROCESSING' AND {same_attempt}"
            ),
            mark_done: format!(
                "UPDATE {table} SET status = 'SUCCESS', lease_until = NULL, updated_at = now(),
                        error_details = concat_ws('; ', '{MARKED_DONE}'::text, error_details)
                 WHERE message_key = $1 AND status IN ('PROCESSING', 'FAILURE') AND {same_attempt}"
            ),
            stats: format!(
                "SELECT count(*) FILTER (WHERE status = 'PROCESSING'),
                        count(*) FILTER (WHERE status = 'PROCESSING' AND lease_until < now()),
                        count(*) FILTER (WHERE status = 'SUCCESS'),
                        count(*) FILTER (WHERE status = 'FAILURE'),
                        min(created_at) FILTER (WHERE status = 'PROCESSING'),
                        min(lease_until) FILTER (WHERE status = 'PROCESSING'),
                        min(updated_at) FILTER (WHERE status = 'SUCCESS'),
                        pg_total_relation_size($1::text::regclass)
                 FROM {table}"
            ),
            purgeable: format!(
                "SELECT count(*) FROM {table}
                 WHERE status = 'SUCCESS' AND updated_at < now() - $1::bigint * interval '1 millisecond'"
            ),
        }
    }
}

impl PgRecordAdmin {
    /// The operator's view of record table `table` on `pool`.
    pub fn new(pool: Pool, table: Table) -> Self {
        PgRecordAdmin {
            statements: Statements::new(&table),
            pool,
            table,
        }
    }

    /// The record table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// `key`'s row, if the table has one.
    pub async fn inspect(&self, key: &str) -> Result<Option<RecordRow>, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let row = client.query_opt(&self.statements.inspect, &[&key]).await?;
            row.as_ref().map(read_row).transpose()
        })
        .await
    }

    /// The `PROCESSING` rows past their lease, oldest lease first, at most `limit` of them,
    /// with how many there are in all.
    pub async fn stuck(&self, limit: usize) -> Result<StuckReport, StoreError> {
        let limit = to_i64(limit as u64);
        Checkout::run(&self.pool, async |client| {
            let total: i64 = client.query_one(&self.statements.stuck_count, &[]).await?.get(0);
            let rows = client.query(&self.statements.stuck, &[&limit]).await?;
            Ok(StuckReport {
                total: count(total),
                rows: rows.iter().map(read_row).collect::<Result<_, _>>()?,
            })
        })
        .await
    }

    /// Releases the `PROCESSING` row `seen` (as [`inspect`](Self::inspect) or
    /// [`stuck`](Self::stuck) read it), for an operator who checked that its effect did not
    /// happen: the row becomes `FAILURE` (noted "released by an operator"), which the key's
    /// next delivery takes over and runs again, as after a failed attempt. Changes nothing
    /// and answers false unless the row is still `seen`'s status and attempt — a delivery
    /// that took the key over meanwhile wins — and, unless `force`, its lease is over.
    ///
    /// With `force`, an attempt still running finds its row gone from under it and settles
    /// nothing; its effect may happen beside the next delivery's.
    pub async fn release(&self, seen: &RecordRow, force: bool) -> Result<bool, StoreError> {
        self.change(&self.statements.release, seen, force).await
    }

    /// Marks the `PROCESSING` or `FAILURE` row `seen` `SUCCESS` (noted "marked done by an
    /// operator"), for an operator who checked that its effect happened: later deliveries of
    /// the key are duplicates. Changes nothing and answers false unless the row is still
    /// `seen`'s status and attempt and, unless `force`, its lease is over. In the
    /// transactional modes a `FAILURE` row's effect was rolled back with its attempt: mark it
    /// done only if the effect was applied by other means.
    pub async fn mark_done(&self, seen: &RecordRow, force: bool) -> Result<bool, StoreError> {
        self.change(&self.statements.mark_done, seen, force).await
    }

    /// Runs `statement` on the row `seen` only while it is still that row: the same status
    /// and attempt, and, unless `force`, no lease running.
    async fn change(&self, statement: &str, seen: &RecordRow, force: bool) -> Result<bool, StoreError> {
        let retry_count = crate::store::sql::retry_count(seen.attempts);
        Checkout::run(&self.pool, async |client| {
            let arguments: [&(dyn deadpool_postgres::tokio_postgres::types::ToSql + Sync); 4] =
                [&seen.key, &seen.status.as_str(), &retry_count, &force];
            Ok(client.execute(statement, &arguments).await? == 1)
        })
        .await
    }

    /// Counts by status, the oldest `PROCESSING` row, the table's size and the retention
    /// horizon. Counting reads the whole table: on a large one this takes a while.
    pub async fn stats(&self) -> Result<RecordStats, StoreError> {
        let table = self.table.to_string();
        Checkout::run(&self.pool, async |client| {
            let row = client.query_one(&self.statements.stats, &[&table]).await?;
            Ok(RecordStats {
                processing: count(row.get(0)),
                stuck: count(row.get(1)),
                success: count(row.get(2)),
                failure: count(row.get(3)),
                oldest_processing_created_at: row.get(4),
                oldest_processing_lease_until: row.get(5),
                oldest_success_updated_at: row.get(6),
                table_bytes: count(row.get(7)),
            })
        })
        .await
    }

    /// How many `SUCCESS` rows were settled more than `age` ago: what a retention pass of
    /// that age would purge now.
    pub async fn purgeable(&self, age: Duration) -> Result<u64, StoreError> {
        let age_ms = to_i64(u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        Checkout::run(&self.pool, async |client| {
            let purgeable: i64 = client
                .query_one(&self.statements.purgeable, &[&age_ms])
                .await?
                .get(0);
            Ok(count(purgeable))
        })
        .await
    }
}

/// A count from SQL, which has no unsigned type.
fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// A row of [`COLUMNS`].
fn read_row(row: &Row) -> Result<RecordRow, StoreError> {
    let retry_count: i32 = row.get(2);
    let fencing_token: Option<i64> = row.get(5);
    Ok(RecordRow {
        key: row.get(0),
        status: parse_status(row.get(1))?,
        attempts: u32::try_from(retry_count).unwrap_or(0).saturating_add(1),
        last_error: row.get(3),
        fingerprint: parse_fingerprint(row.get(4))?,
        fencing_token: fencing_token.and_then(|token| u64::try_from(token).ok()),
        lease_until: row.get(6),
        created_at: row.get(7),
        updated_at: row.get(8),
    })
}
