//! The operator's statements on the MySQL and MariaDB record table: what `oncely inspect`,
//! `stuck`, `release`, `mark-done`, `stats` and `purge` read and change. The statements and
//! the row types are both SQL stores' (`store/sql/admin.rs`); here are MySQL's spelling of
//! them and its plumbing.

use std::time::Duration;

use sqlx::mysql::MySqlRow;
use sqlx::{MySqlConnection, MySqlPool, Row};

use super::claims::{MAX_ERROR_CHARS, key_text, time_of};
use super::transaction::Unpooled;
use super::{Table, responses_table};
use crate::error::StoreError;
use crate::store::sql::admin::{
    AdminStatements, AnsweredStatements, Dialect, RecordRow, RecordStats, ResponseRow, StuckReport, count,
    scoped_pattern,
};
use crate::store::sql::{micros, to_i64};

/// An operator's view of a MySQL or MariaDB record table (made by
/// [`migrate`](crate::mysql::migrate)), with the same operations and meaning as
/// `PgRecordAdmin`'s: one key's row, the stuck rows, counts, and the two hand settlements an
/// operator makes after checking a stuck key by hand.
///
/// Each call runs its statements in autocommit on a pooled connection; none holds a lock
/// beyond its statement, so it is safe while consumers run. A call dropped before it
/// finished (a timeout) closes its connection rather than pooling it. Closing does not stop
/// a statement the server is running, and this type sets no time limit: bound the pool's
/// sessions (`max_statement_time` on MariaDB, `max_execution_time` and
/// `innodb_lock_wait_timeout` on MySQL) and each call, as `oncely` does.
///
/// Times are the server's UTC clock, as the record tier writes them.
#[derive(Clone, Debug)]
pub struct MysqlRecordAdmin {
    pool: MySqlPool,
    table: Table,
    /// Where oncely-http keeps the table's stored responses, if that is a valid name.
    responses: Option<Table>,
    statements: AdminStatements,
}

/// MySQL's and MariaDB's spelling of the operator's statements.
struct Mysql;

impl Dialect for Mysql {
    // UTC_TIMESTAMP, as the record tier writes the table: DATETIME holds no time zone.
    const NOW: &'static str = "UTC_TIMESTAMP(6)";

    fn parameter(_n: usize) -> String {
        "?".to_owned()
    }

    fn time(expression: &str) -> String {
        // Read with `time_of`.
        format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {expression})")
    }

    fn ago(parameter: &str) -> String {
        // Microseconds, as the retention purge binds its age.
        format!("UTC_TIMESTAMP(6) - INTERVAL {parameter} MICROSECOND")
    }

    fn noted(note: &str) -> String {
        // Cut to what the record tier keeps, so a long error text still fits its TEXT column
        // once noted (strict mode would refuse the update).
        format!("LEFT(CONCAT_WS('; ', '{note}', error_details), {MAX_ERROR_CHARS})")
    }

    fn table_bytes(parameter: &str) -> String {
        format!(
            "(SELECT CAST(DATA_LENGTH + INDEX_LENGTH AS SIGNED) FROM information_schema.TABLES
              WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = {parameter})"
        )
    }

    fn table_exists(parameter: &str) -> String {
        format!(
            "SELECT count(*) FROM information_schema.TABLES
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = {parameter}"
        )
    }
}

impl MysqlRecordAdmin {
    /// The operator's view of record table `table` in the database of `pool`'s connections.
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        let responses = responses_table(&table).ok();
        MysqlRecordAdmin {
            statements: AdminStatements::new::<Mysql>(&table, responses.as_ref().map(|t| t as _)),
            responses,
            pool,
            table,
        }
    }

    /// The record table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Runs `run` on a connection of the pool, which goes back to the pool only if `run`
    /// finished: a statement cut off may still be running on it.
    async fn on_connection<T>(
        &self,
        run: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut connection = Unpooled(Some(self.pool.acquire().await?));
        let answer = run(&mut **connection.get()).await;
        connection.keep();
        answer
    }

    /// `key`'s row, if the table has one.
    pub async fn inspect(&self, key: &str) -> Result<Option<RecordRow>, StoreError> {
        self.on_connection(async |connection| {
            let row = sqlx::query(&self.statements.inspect)
                .bind(key)
                .fetch_optional(connection)
                .await?;
            row.as_ref().map(read_row).transpose()
        })
        .await
    }

    /// The `PROCESSING` rows past their lease, oldest lease first, at most `limit` of them,
    /// with how many there are in all.
    pub async fn stuck(&self, limit: usize) -> Result<StuckReport, StoreError> {
        self.on_connection(async |connection| {
            let total: i64 = sqlx::query_scalar(&self.statements.stuck_count)
                .fetch_one(&mut *connection)
                .await?;
            let rows = sqlx::query(&self.statements.stuck)
                .bind(to_i64(limit as u64))
                .fetch_all(&mut *connection)
                .await?;
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
    /// transactional mode a `FAILURE` row's effect was rolled back with its attempt: mark it
    /// done only if the effect was applied by other means.
    pub async fn mark_done(&self, seen: &RecordRow, force: bool) -> Result<bool, StoreError> {
        self.change(&self.statements.mark_done, seen, force).await
    }

    /// Runs `statement` on the row `seen` only while it is still that row: the same status
    /// and attempt, and, unless `force`, no lease running.
    async fn change(&self, statement: &str, seen: &RecordRow, force: bool) -> Result<bool, StoreError> {
        let retry_count = crate::store::sql::retry_count(seen.attempts);
        self.on_connection(async |connection| {
            let changed = sqlx::query(statement)
                .bind(seen.key.as_str())
                .bind(seen.status.as_str())
                .bind(retry_count)
                .bind(force)
                .execute(connection)
                .await?;
            Ok(changed.rows_affected() == 1)
        })
        .await
    }

    /// Counts by status, the oldest `PROCESSING` row, the table's size (InnoDB's estimate)
    /// and the retention horizon. Counting reads the whole table: on a large one this takes a
    /// while.
    pub async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.on_connection(async |connection| {
            let row = sqlx::query(&self.statements.stats)
                .bind(self.table.as_str())
                .fetch_one(connection)
                .await?;
            let time = |index: usize| {
                row.try_get::<Option<i64>, _>(index)
                    .map(|micros| micros.map(time_of))
            };
            Ok(RecordStats {
                processing: count(row.try_get(0)?),
                stuck: count(row.try_get(1)?),
                success: count(row.try_get(2)?),
                failure: count(row.try_get(3)?),
                oldest_processing_created_at: time(4)?,
                oldest_processing_lease_until: time(5)?,
                oldest_success_updated_at: time(6)?,
                table_bytes: count(row.try_get::<Option<i64>, _>(7)?.unwrap_or(0)),
            })
        })
        .await
    }

    /// How many `SUCCESS` rows were settled more than `age` ago and may go, as
    /// `PgRecordAdmin::purgeable`: a row whose stored response still lives is not counted.
    pub async fn purgeable(&self, age: Duration) -> Result<u64, StoreError> {
        self.on_connection(async |connection| {
            let statement = match self.answered(connection).await? {
                Some(answered) => &answered.purgeable,
                None => &self.statements.purgeable,
            };
            let purgeable: i64 = sqlx::query_scalar(statement)
                .bind(micros(age))
                .fetch_one(connection)
                .await?;
            Ok(count(purgeable))
        })
        .await
    }

    /// How many `SUCCESS` rows settled more than `age` ago are kept because their stored
    /// response still lives: 0 where no responses are stored beside the table.
    pub async fn held_by_responses(&self, age: Duration) -> Result<u64, StoreError> {
        self.on_connection(async |connection| {
            let Some(answered) = self.answered(connection).await? else {
                return Ok(0);
            };
            let held: i64 = sqlx::query_scalar(&answered.held)
                .bind(micros(age))
                .fetch_one(connection)
                .await?;
            Ok(count(held))
        })
        .await
    }

    /// `key`'s stored response (oncely-http's, beside the table), expired or not, if there
    /// is one.
    pub async fn response(&self, key: &str) -> Result<Option<ResponseRow>, StoreError> {
        self.on_connection(async |connection| {
            let Some(answered) = self.answered(connection).await? else {
                return Ok(None);
            };
            let row = sqlx::query(&answered.response)
                .bind(key.as_bytes())
                .fetch_optional(connection)
                .await?;
            row.map(|row| {
                let headers: Vec<u8> = row.try_get(1)?;
                let expires_at: i64 = row.try_get(3)?;
                Ok(ResponseRow::from_columns(
                    row.try_get(0)?,
                    &headers,
                    row.try_get(2)?,
                    time_of(expires_at),
                ))
            })
            .transpose()
        })
        .await
    }

    /// Up to 10 keys that client-scoped routes (oncely-http's, `SCOPE:KEY`) recorded for
    /// `key`, in key order, as `PgRecordAdmin::scoped_keys`.
    pub async fn scoped_keys(&self, key: &str) -> Result<Vec<String>, StoreError> {
        self.on_connection(async |connection| {
            let keys: Vec<Vec<u8>> = sqlx::query_scalar(&self.statements.scoped_keys)
                .bind(scoped_pattern(key).into_bytes())
                .fetch_all(connection)
                .await?;
            Ok(keys
                .into_iter()
                .map(|key| String::from_utf8_lossy(&key).into_owned())
                .collect())
        })
        .await
    }

    /// The statements on the stored responses, when their table exists.
    async fn answered(
        &self,
        connection: &mut MySqlConnection,
    ) -> Result<Option<&AnsweredStatements>, StoreError> {
        let (Some(answered), Some(responses)) = (&self.statements.answered, &self.responses) else {
            return Ok(None);
        };
        let found: i64 = sqlx::query_scalar(&answered.exists)
            .bind(responses.as_str())
            .fetch_one(connection)
            .await?;
        Ok((found > 0).then_some(answered))
    }
}

/// A row of [`AdminStatements`]' whole-row columns.
fn read_row(row: &MySqlRow) -> Result<RecordRow, StoreError> {
    let lease_until: Option<i64> = row.try_get(6)?;
    RecordRow::from_columns(
        key_text(row.try_get(0)?)?,
        row.try_get(1)?,
        row.try_get(2)?,
        row.try_get(3)?,
        row.try_get(4)?,
        row.try_get(5)?,
        lease_until.map(time_of),
        time_of(row.try_get(7)?),
        time_of(row.try_get(8)?),
    )
}
