//! The operator's statements on the PostgreSQL record table: what `oncely inspect`, `stuck`,
//! `release`, `mark-done`, `stats` and `purge` read and change. The statements and the row
//! types are both SQL stores' (`store/sql/admin.rs`); here are PostgreSQL's spelling of them
//! and its plumbing.

use std::time::Duration;

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::Row;

use super::{Checkout, Table, responses_table};
use crate::error::StoreError;
use crate::store::sql::admin::{
    AdminStatements, AnsweredStatements, Dialect, RecordRow, RecordStats, ResponseRow, StuckReport, count,
    scoped_pattern,
};
use crate::store::sql::to_i64;

/// An operator's view of a PostgreSQL record table (made by
/// [`migrate`](crate::postgres::migrate)): one key's row, the stuck rows, counts, and the two
/// hand settlements an operator makes after checking a stuck key by hand.
///
/// Each call takes a pooled connection for its statements; none holds a lock beyond its
/// statement, so it is safe while consumers run. It sets no time limit: bound the pool's
/// sessions (`statement_timeout`, `lock_timeout`) and each call, as `oncely` does.
#[derive(Clone, Debug)]
pub struct PgRecordAdmin {
    pool: Pool,
    table: Table,
    /// Where oncely-http keeps the table's stored responses, if that is a valid name.
    responses: Option<Table>,
    statements: AdminStatements,
}

/// PostgreSQL's spelling of the operator's statements.
struct Postgres;

impl Dialect for Postgres {
    const NOW: &'static str = "now()";

    fn parameter(n: usize) -> String {
        format!("${n}")
    }

    fn time(expression: &str) -> String {
        // `timestamptz`, which the driver reads as a `SystemTime`.
        expression.to_owned()
    }

    fn ago(parameter: &str) -> String {
        // Milliseconds, as the retention purge binds its age.
        format!("now() - {parameter}::bigint * interval '1 millisecond'")
    }

    fn noted(note: &str) -> String {
        format!("concat_ws('; ', '{note}'::text, error_details)")
    }

    fn table_bytes(parameter: &str) -> String {
        format!("pg_total_relation_size({parameter}::text::regclass)")
    }

    fn table_exists(parameter: &str) -> String {
        format!("SELECT count(to_regclass({parameter}::text))")
    }
}

impl PgRecordAdmin {
    /// The operator's view of record table `table` on `pool`.
    pub fn new(pool: Pool, table: Table) -> Self {
        let responses = responses_table(&table).ok();
        PgRecordAdmin {
            statements: AdminStatements::new::<Postgres>(&table, responses.as_ref().map(|t| t as _)),
            responses,
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

    /// How many `SUCCESS` rows were settled more than `age` ago and may go: what a
    /// retention pass of that age would purge now. A row whose stored response (oncely-http's,
    /// beside the table) still lives is not counted: it goes with its response, once that
    /// expired.
    pub async fn purgeable(&self, age: Duration) -> Result<u64, StoreError> {
        let age_ms = to_i64(u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        Checkout::run(&self.pool, async |client| {
            let statement = match self.answered(client).await? {
                Some(answered) => &answered.purgeable,
                None => &self.statements.purgeable,
            };
            let purgeable: i64 = client.query_one(statement, &[&age_ms]).await?.get(0);
            Ok(count(purgeable))
        })
        .await
    }

    /// How many `SUCCESS` rows settled more than `age` ago are kept because their stored
    /// response still lives: 0 where no responses are stored beside the table.
    pub async fn held_by_responses(&self, age: Duration) -> Result<u64, StoreError> {
        let age_ms = to_i64(u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        Checkout::run(&self.pool, async |client| {
            let Some(answered) = self.answered(client).await? else {
                return Ok(0);
            };
            let held: i64 = client.query_one(&answered.held, &[&age_ms]).await?.get(0);
            Ok(count(held))
        })
        .await
    }

    /// `key`'s stored response (oncely-http's, beside the table), expired or not, if there
    /// is one.
    pub async fn response(&self, key: &str) -> Result<Option<ResponseRow>, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let Some(answered) = self.answered(client).await? else {
                return Ok(None);
            };
            let row = client.query_opt(&answered.response, &[&key]).await?;
            row.map(|row| {
                let headers: Vec<u8> = row.try_get(1)?;
                let body_len: i32 = row.try_get(2)?;
                Ok(ResponseRow::from_columns(
                    row.try_get(0)?,
                    &headers,
                    body_len.into(),
                    row.try_get(3)?,
                ))
            })
            .transpose()
        })
        .await
    }

    /// Up to 10 keys that client-scoped routes (oncely-http's, `SCOPE:KEY`) recorded for
    /// `key`, in key order: what to look at when `key` itself has no row.
    pub async fn scoped_keys(&self, key: &str) -> Result<Vec<String>, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let rows = client
                .query(&self.statements.scoped_keys, &[&scoped_pattern(key)])
                .await?;
            rows.iter().map(|row| Ok(row.try_get(0)?)).collect()
        })
        .await
    }

    /// The statements on the stored responses, when their table exists.
    async fn answered(
        &self,
        client: &deadpool_postgres::Client,
    ) -> Result<Option<&AnsweredStatements>, StoreError> {
        let (Some(answered), Some(responses)) = (&self.statements.answered, &self.responses) else {
            return Ok(None);
        };
        let found: i64 = client
            .query_one(&answered.exists, &[&responses.to_string()])
            .await?
            .get(0);
        Ok((found > 0).then_some(answered))
    }
}

/// A row of [`AdminStatements`]' whole-row columns.
fn read_row(row: &Row) -> Result<RecordRow, StoreError> {
    RecordRow::from_columns(
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
        row.get(6),
        row.get(7),
        row.get(8),
    )
}
