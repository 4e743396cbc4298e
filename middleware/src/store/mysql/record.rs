//! The record tier's three-step store on MySQL and MariaDB.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::mysql::MySqlRow;
use sqlx::{MySqlPool, Row};

use super::Table;
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus, RecordStore};
use crate::store::sql::{FoundRecord, parse_fingerprint, parse_status, refused_claim, to_i64};

/// The longest business key the record table holds (`VARBINARY(1024)`), in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// How much of a failure's text is kept: `TEXT` holds 64 KiB, and 4-byte characters fill
/// it at 16 Ki.
const MAX_ERROR_CHARS: usize = 16 * 1024;

/// Every statement on the record table, with its name filled in.
#[derive(Debug)]
struct Statements {
    /// A new key: `PROCESSING`, attempt 1. `?` key, fingerprint, fencing token, lease (µs).
    insert: String,
    /// Takes over a `FAILURE` row, or a `PROCESSING` one past its lease, with the same payload
    /// and a fencing token no older; `LAST_INSERT_ID(…)` hands the new retry count back in the
    /// statement's own answer, so no second read can see another attempt's. `?` fencing
    /// token, lease (µs), key, fingerprint ×2, fencing token ×2.
    take_over: String,
    /// What stopped a claim: status, fingerprint, lease running, fencing token. `?` key.
    inspect: String,
    /// Settles a three-step attempt. `?` status, error, key, retry count.
    settle: String,
    /// One key's record. `?` key.
    get: String,
}

impl Statements {
    fn new(table: &Table) -> Arc<Self> {
        // UTC_TIMESTAMP, not NOW: DATETIME holds no time zone, and consumers whose sessions
        // had different ones would read each other's leases hours off.
        let lease = "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";
        let micros = |column: &str| format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {column})");
        Arc::new(Statements {
            insert: format!(
                "INSERT INTO {table}
                     (message_key, status, payload_fingerprint, fencing_token, lease_until, created_at, updated_at)
                 VALUES (?, 'PROCESSING', ?, ?, {lease}, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
            ),
            take_over: format!(
                "UPDATE {table}
                 SET status = 'PROCESSING', retry_count = LAST_INSERT_ID(retry_count + 1),
                     fencing_token = COALESCE(?, fencing_token), lease_until = {lease},
                     updated_at = UTC_TIMESTAMP(6)
                 WHERE message_key = ?
                   AND (payload_fingerprint = ? OR '{unchecked}' IN (payload_fingerprint, ?))
                   AND (status = 'FAILURE' OR (status = 'PROCESSING' AND lease_until < UTC_TIMESTAMP(6)))
                   AND (fencing_token IS NULL OR ? IS NULL OR ? >= fencing_token)",
                unchecked = Fingerprint::UNCHECKED
            ),
            inspect: format!(
                "SELECT status, payload_fingerprint,
                        CAST(COALESCE(lease_until > UTC_TIMESTAMP(6), 0) AS SIGNED), fencing_token
                 FROM {table} WHERE message_key = ?"
            ),
            settle: format!(
                "UPDATE {table} SET status = ?, error_details = COALESCE(?, error_details),
                        lease_until = NULL, updated_at = UTC_TIMESTAMP(6)
                 WHERE message_key = ? AND status = 'PROCESSING' AND retry_count = ?"
            ),
            get: format!(
                "SELECT message_key, status, retry_count, error_details, payload_fingerprint, {created}, {updated},
                        fencing_token
                 FROM {table} WHERE message_key = ?",
                created = micros("created_at"),
                updated = micros("updated_at"),
            ),
        })
    }
}

/// A three-step [`RecordStore`] on MySQL 8 or MariaDB, shared by every consumer process.
///
/// A claim of a new key is one `INSERT`; of a key with a row, an `UPDATE` that takes it over
/// when it may, else one read of what stopped it. Each runs in autocommit, so what it locks
/// (the row, or under REPEATABLE READ the index range a duplicate `INSERT` checks) is held
/// for that one statement only. Leases and timestamps run on the server's clock, in UTC
/// whatever the session's time zone.
///
/// Limits: business keys up to [`MAX_KEY_BYTES`] (the route's default limit of 256 bytes
/// fits): a longer one is refused with a [`StoreError`], never cut, since a cut key could
/// be another key. Error texts are kept up to 16 KiB. No claim coalescing and no
/// transactional mode yet (those are PostgreSQL's only).
#[derive(Clone)]
pub struct MysqlRecordStore {
    pool: MySqlPool,
    table: Table,
    statements: Arc<Statements>,
}

impl MysqlRecordStore {
    /// A store on `pool` using the record table `table` (create it with
    /// [`migrate`](crate::mysql::migrate)).
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        MysqlRecordStore {
            statements: Statements::new(&table),
            pool,
            table,
        }
    }

    /// The record table.
    pub fn table(&self) -> &Table {
        &self.table
    }

    async fn take_over(
        &self,
        key: &BusinessKey,
        fingerprint: &str,
        fence: Option<i64>,
        lease: i64,
    ) -> Result<Option<Begin>, StoreError> {
        let taken = sqlx::query(&self.statements.take_over)
            .bind(fence)
            .bind(lease)
            .bind(key.as_str())
            .bind(fingerprint)
            .bind(fingerprint)
            .bind(fence)
            .bind(fence)
            .execute(&self.pool)
            .await?;
        Ok((taken.rows_affected() == 1).then(|| Begin::Started {
            attempt: u32::try_from(taken.last_insert_id()).unwrap_or(u32::MAX - 1) + 1,
        }))
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

impl fmt::Debug for MysqlRecordStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlRecordStore")
            .field("table", &self.table)
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
        if key.as_str().len() > MAX_KEY_BYTES {
            return Err(StoreError::new(format!(
                "a key of {} bytes: the MySQL record keeps keys up to {MAX_KEY_BYTES}",
                key.as_str().len()
            )));
        }
        let (fingerprint_hex, fence) = (fingerprint.to_string(), fencing_token.map(to_i64));
        let lease = to_i64(u64::try_from(lease.as_micros()).unwrap_or(u64::MAX));
        let inserted = sqlx::query(&self.statements.insert)
            .bind(key.as_str())
            .bind(&fingerprint_hex)
            .bind(fence)
            .bind(lease)
            .execute(&self.pool)
            .await;
        match inserted {
            Ok(_) => return Ok(Begin::Started { attempt: 1 }),
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {}
            Err(error) => return Err(error.into()),
        }
        if let Some(started) = self.take_over(key, &fingerprint_hex, fence, lease).await? {
            return Ok(started);
        }
        let row = sqlx::query(&self.statements.inspect)
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await?;
        // No row: deleted in between (a purge); the retry sees where it stands. A row it may
        // take over was changed between the two statements: the same.
        let Some(row) = row else {
            return Ok(Begin::InProgress);
        };
        let found = FoundRecord {
            status: parse_status(row.try_get(0)?)?,
            fingerprint: parse_fingerprint(row.try_get(1)?)?,
            leased: row.try_get::<i64, _>(2)? != 0,
            fencing_token: row.try_get(3)?,
        };
        Ok(refused_claim(&found, fingerprint, fencing_token).unwrap_or(Begin::InProgress))
    }

    async fn succeed(&self, key: &BusinessKey, attempt: u32) -> Result<bool, StoreError> {
        self.settle(key, attempt, RecordStatus::Success, None).await
    }

    async fn fail(&self, key: &BusinessKey, attempt: u32, error: &str) -> Result<bool, StoreError> {
        let error = match error.char_indices().nth(MAX_ERROR_CHARS) {
            Some((end, _)) => &error[..end],
            None => error,
        };
        self.settle(key, attempt, RecordStatus::Failure, Some(error))
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

fn read_record(row: &MySqlRow) -> Result<ConsumptionRecord, StoreError> {
    let key: Vec<u8> = row.try_get(0)?;
    let key = String::from_utf8(key).map_err(|_| StoreError::malformed("a record key that is not UTF-8"))?;
    let retry_count: i32 = row.try_get(2)?;
    let at = |micros: i64| SystemTime::UNIX_EPOCH + Duration::from_micros(u64::try_from(micros).unwrap_or(0));
    let fencing_token: Option<i64> = row.try_get(7)?;
    Ok(ConsumptionRecord {
        key: BusinessKey::new(key),
        status: parse_status(row.try_get(1)?)?,
        attempts: u32::try_from(retry_count).unwrap_or(0) + 1,
        last_error: row.try_get(3)?,
        fingerprint: parse_fingerprint(row.try_get(4)?)?,
        created_at: at(row.try_get(5)?),
        updated_at: at(row.try_get(6)?),
        fencing_token: fencing_token.and_then(|token| u64::try_from(token).ok()),
    })
}
