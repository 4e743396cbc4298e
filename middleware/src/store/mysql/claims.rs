//! Every statement on the MySQL record table, rendered once per table, and the claim both
//! record modes run: the three-step store in autocommit, the transactional tier inside its
//! transaction. Whoever changes the table's meaning changes it here.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sqlx::mysql::MySqlRow;
use sqlx::{Executor, MySqlConnection, Row};

use super::{Table, lost_to_another_transaction, responses_table};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus};
use crate::store::sql::{
    ClaimRequest, FoundRecord, micros, parse_fingerprint, parse_status, refused_claim, to_i64,
};

/// The longest business key the record table holds (`VARBINARY(1024)`), in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// How much of a failure's text is kept: `TEXT` holds 65,535 bytes, so 16 Ki characters of
/// 4 bytes (65,536) would be one byte too many under strict mode; one character fewer fits.
pub(crate) const MAX_ERROR_CHARS: usize = 16 * 1024 - 1;

/// Every statement on the record table, with its name filled in.
#[derive(Debug)]
pub(crate) struct Statements {
    /// A new key: attempt 1. `?` key, status, fingerprint, fencing token, lease (µs, NULL:
    /// none).
    insert: String,
    /// Takes over a `FAILURE` row, or a `PROCESSING` one past its lease, with the same payload
    /// and a fencing token no older; `LAST_INSERT_ID(…)` hands the new retry count back in the
    /// statement's own answer, so no second read can see another attempt's. `?` status,
    /// fencing token, lease (µs), key, fingerprint ×2, fencing token ×2.
    take_over: String,
    /// What stopped a claim: status, fingerprint, lease running, fencing token. `?` key.
    inspect: String,
    /// The same for many keys, with the key first: `SELECT message_key, … WHERE message_key
    /// IN (`, the keys follow as literals ([`claim_many`]).
    inspect_many_head: String,
    /// Settles a three-step attempt. `?` status, error, key, retry count.
    pub(crate) settle: String,
    /// Notes a rolled-back transactional attempt: a `FAILURE` row with the error text and one
    /// more retry; never touches a row in another status or with another fingerprint. `?`
    /// key, fingerprint, fencing token, error, then the fingerprint ×2 and the error again
    /// for the row that exists.
    pub(crate) note_failure: String,
    /// One key's record. `?` key.
    pub(crate) get: String,
    /// The reconciler's batch of `PROCESSING` rows past their lease, oldest lease first:
    /// key, retry count. `?` limit.
    pub(crate) stuck: String,
    /// The reconciler's verdict on one stuck row, only if it is still that stuck attempt.
    /// `?` status, error, key, retry count.
    pub(crate) settle_stuck: String,
    /// The head of a multi-row claim of new keys: `INSERT IGNORE INTO {table} (columns)
    /// VALUES `, the rows follow as literals ([`claim_new_keys`]).
    insert_new_head: String,
    /// The same without `IGNORE`, which a key taken in between fails whole ([`claim_many`]).
    insert_rows_head: String,
    /// Deletes up to `?` (the second) `SUCCESS` rows not updated for `?` (the first) µs, oldest first (an ordered
    /// `LIMIT` is deterministic, so statement-based replication may log it).
    pub(crate) purge: String,
    /// The heads of the statements that take back a batch's claims of keys whose
    /// deliveries went away before their handlers ran, the keys' placeholders following in
    /// `IN (…)`: a key first claimed by the batch goes as if never claimed, one it took over
    /// is left as a failed attempt leaves it (`?` the note first).
    pub(crate) withdraw_fresh_head: String,
    pub(crate) withdraw_head: String,
    /// The purge where stored responses may live beside the table, if their table's name is
    /// a valid one.
    pub(crate) purge_answered: Option<AnsweredPurge>,
}

/// The retention's purge where stored responses may live beside the record table: in one
/// transaction, the old `SUCCESS` rows whose response expired (or that have none) are
/// picked (`?` age in µs, `?` limit), then deleted with their responses, by key.
#[derive(Debug)]
pub(crate) struct AnsweredPurge {
    /// Their table, which the purge uses only when it exists.
    pub(crate) responses: Table,
    pub(crate) pick: String,
    /// The heads of the two deletes; the keys' placeholders follow in `IN (…)`.
    pub(crate) delete_records: String,
    pub(crate) delete_responses: String,
}

impl Statements {
    pub(crate) fn new(table: &Table) -> Arc<Self> {
        // UTC_TIMESTAMP, not NOW: DATETIME holds no time zone, and consumers whose sessions
        // had different ones would read each other's leases hours off.
        let lease = "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";
        let micros = |column: &str| format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01', {column})");
        // A fingerprint of a route whose check is off matches any other (`Fingerprint::matches`).
        let same_payload = format!(
            "(payload_fingerprint = ? OR '{unchecked}' IN (payload_fingerprint, ?))",
            unchecked = Fingerprint::UNCHECKED
        );
        let found = "status, payload_fingerprint, CAST(COALESCE(lease_until > UTC_TIMESTAMP(6), 0) AS SIGNED), fencing_token";
        let columns =
            "(message_key, status, payload_fingerprint, fencing_token, lease_until, created_at, updated_at)";
        Arc::new(Statements {
            insert: format!(
                "INSERT INTO {table} {columns} VALUES (?, ?, ?, ?, {lease}, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))"
            ),
            take_over: format!(
                "UPDATE {table}
                 SET status = ?, retry_count = LAST_INSERT_ID(retry_count + 1),
                     fencing_token = COALESCE(?, fencing_token), lease_until = {lease},
                     updated_at = UTC_TIMESTAMP(6)
                 WHERE message_key = ? AND {same_payload}
                   AND (status = 'FAILURE' OR (status = 'PROCESSING' AND lease_until < UTC_TIMESTAMP(6)))
                   AND (fencing_token IS NULL OR ? IS NULL OR ? >= fencing_token)"
            ),
            inspect: format!("SELECT {found} FROM {table} WHERE message_key = ?"),
            inspect_many_head: format!("SELECT message_key, {found} FROM {table} WHERE message_key IN ("),
            settle: format!(
                "UPDATE {table} SET status = ?, error_details = COALESCE(?, error_details),
                        lease_until = NULL, updated_at = UTC_TIMESTAMP(6)
                 WHERE message_key = ? AND status = 'PROCESSING' AND retry_count = ?"
            ),
            // The assignments only touch columns the condition does not read: MySQL applies
            // them left to right, each seeing the ones before.
            note_failure: format!(
                "INSERT INTO {table}
                     (message_key, status, payload_fingerprint, fencing_token, error_details, created_at, updated_at)
                 VALUES (?, 'FAILURE', ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
                 ON DUPLICATE KEY UPDATE
                     retry_count = IF(status = 'FAILURE' AND {same_payload}, retry_count + 1, retry_count),
                     error_details = IF(status = 'FAILURE' AND {same_payload}, ?, error_details),
                     updated_at = IF(status = 'FAILURE' AND {same_payload}, UTC_TIMESTAMP(6), updated_at)"
            ),
            get: format!(
                "SELECT message_key, status, retry_count, error_details, payload_fingerprint, {created}, {updated},
                        fencing_token
                 FROM {table} WHERE message_key = ?",
                created = micros("created_at"),
                updated = micros("updated_at"),
            ),
            stuck: format!(
                "SELECT message_key, retry_count FROM {table}
                 WHERE status = 'PROCESSING' AND lease_until < UTC_TIMESTAMP(6)
                 ORDER BY lease_until LIMIT ?"
            ),
            settle_stuck: format!(
                "UPDATE {table} SET status = ?, error_details = ?, lease_until = NULL, updated_at = UTC_TIMESTAMP(6)
                 WHERE message_key = ? AND retry_count = ? AND status = 'PROCESSING'
                   AND lease_until < UTC_TIMESTAMP(6)"
            ),
            insert_new_head: format!("INSERT IGNORE INTO {table} {columns} VALUES "),
            insert_rows_head: format!("INSERT INTO {table} {columns} VALUES "),
            purge: format!(
                "DELETE FROM {table}
                 WHERE status = 'SUCCESS' AND updated_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                 ORDER BY updated_at LIMIT ?"
            ),
            withdraw_fresh_head: format!(
                "DELETE FROM {table} WHERE status = 'SUCCESS' AND retry_count = 0 AND message_key IN "
            ),
            withdraw_head: format!(
                "UPDATE {table} SET status = 'FAILURE', lease_until = NULL, updated_at = UTC_TIMESTAMP(6),
                 error_details = ? WHERE status = 'SUCCESS' AND message_key IN "
            ),
            purge_answered: responses_table(table).ok().map(|responses| AnsweredPurge {
                pick: format!(
                    "SELECT r.message_key FROM {table} r
                     WHERE r.status = 'SUCCESS' AND r.updated_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                       AND NOT EXISTS (SELECT 1 FROM {responses} s
                                       WHERE s.message_key = r.message_key AND s.expires_at > UTC_TIMESTAMP(6))
                     ORDER BY r.updated_at LIMIT ? FOR UPDATE SKIP LOCKED"
                ),
                delete_records: format!("DELETE FROM {table} WHERE status = 'SUCCESS' AND message_key IN "),
                delete_responses: format!("DELETE FROM {responses} WHERE message_key IN "),
                responses,
            }),
        })
    }
}

/// Refuses a key the table cannot hold: a cut key could be another key.
pub(crate) fn check_key_len(key: &BusinessKey) -> Result<(), StoreError> {
    match key.as_str().len() {
        ..=MAX_KEY_BYTES => Ok(()),
        len => Err(StoreError::new(format!(
            "a key of {len} bytes: the MySQL record keeps keys up to {MAX_KEY_BYTES}"
        ))),
    }
}

/// `error` cut to what the table keeps.
pub(crate) fn kept_error(error: &str) -> &str {
    match error.char_indices().nth(MAX_ERROR_CHARS) {
        Some((end, _)) => &error[..end],
        None => error,
    }
}

/// Claims `request`'s key with `status` on `connection`: one `INSERT` for a new key; for a
/// key with a row, one read of it, and an `UPDATE` that takes it over when it may. Each statement locks what it touches for as long as the connection's transaction
/// runs — one statement in autocommit; in the transactional tier, until it ends. An
/// `INSERT` that finds the key taken by an open transaction waits for it (the unique index),
/// as on PostgreSQL.
pub(crate) async fn claim(
    connection: &mut MySqlConnection,
    statements: &Statements,
    request: &ClaimRequest,
    status: RecordStatus,
) -> Result<Begin, StoreError> {
    check_key_len(&request.key)?;
    let inserted = sqlx::query(&statements.insert)
        .bind(request.key.as_str())
        .bind(status.as_str())
        .bind(request.fingerprint.to_string())
        .bind(request.fencing_token.map(to_i64))
        .bind(request.lease.map(micros))
        .execute(&mut *connection)
        .await;
    match inserted {
        Ok(_) => return Ok(Begin::Started { attempt: 1 }),
        Err(sqlx::Error::Database(error)) if error.is_unique_violation() => {}
        Err(error) => return Err(error.into()),
    }
    // Read before taking over: the failed INSERT holds a shared lock on the key's index
    // record until the transaction ends, and copies that all hold it and all ask for the
    // exclusive one (the UPDATE) deadlock. A key already done, leased, fenced or another
    // payload's needs no exclusive lock to be answered; only a takeover asks for it.
    match inspect(connection, statements, request).await? {
        Some(refused) => Ok(refused),
        None => take_over(connection, statements, request, status).await,
    }
}

/// What stops a claim of the key's row, or `None` when the claim may take it over. A row
/// gone (a purge deleted it in between) answers [`Begin::InProgress`]: the retry sees
/// where it stands.
async fn inspect(
    connection: &mut MySqlConnection,
    statements: &Statements,
    request: &ClaimRequest,
) -> Result<Option<Begin>, StoreError> {
    let row = sqlx::query(&statements.inspect)
        .bind(request.key.as_str())
        .fetch_optional(&mut *connection)
        .await?;
    let Some(row) = row else {
        return Ok(Some(Begin::InProgress));
    };
    let found = found_record(&row, 0)?;
    Ok(refused_claim(&found, request.fingerprint, request.fencing_token))
}

/// The row as [`Statements::inspect`] reads it, from column `first` on.
fn found_record(row: &MySqlRow, first: usize) -> Result<FoundRecord, StoreError> {
    Ok(FoundRecord {
        status: parse_status(row.try_get(first)?)?,
        fingerprint: parse_fingerprint(row.try_get(first + 1)?)?,
        leased: row.try_get::<i64, _>(first + 2)? != 0,
        fencing_token: row.try_get(first + 3)?,
    })
}

/// Takes the key's row over with `status`, if it still may be: another claim may have
/// taken it since it was read, and then this one waits (answers
/// [`Begin::InProgress`]).
async fn take_over(
    connection: &mut MySqlConnection,
    statements: &Statements,
    request: &ClaimRequest,
    status: RecordStatus,
) -> Result<Begin, StoreError> {
    let fingerprint = request.fingerprint.to_string();
    let fence = request.fencing_token.map(to_i64);
    let taken = sqlx::query(&statements.take_over)
        .bind(status.as_str())
        .bind(fence)
        .bind(request.lease.map(micros))
        .bind(request.key.as_str())
        .bind(&fingerprint)
        .bind(&fingerprint)
        .bind(fence)
        .bind(fence)
        .execute(&mut *connection)
        .await?;
    if taken.rows_affected() != 1 {
        return Ok(Begin::InProgress);
    }
    let retry_count = u32::try_from(taken.last_insert_id()).unwrap_or(u32::MAX - 1);
    Ok(Begin::Started {
        attempt: retry_count + 1,
    })
}

/// Claims every key of `requests` with `status` in one round trip when all are new — the
/// common case for a batch — inside the caller's transaction: a savepoint, then one
/// multi-row `INSERT IGNORE`. `None` when some key already has a row: the insert is undone to
/// the savepoint, and the caller claims each key on its own ([`claim`]).
///
/// Sent as text with the values as literals (keys in hex, fingerprints in hex digits,
/// numbers, a status from the enum): a savepoint cannot be prepared, and one text query
/// carries both statements. `IGNORE` turns a duplicate key into "not inserted"; it would also
/// turn a value the column cannot hold into a warning, which none of these can be (keys are
/// checked against the column's length first).
pub(crate) async fn claim_new_keys(
    connection: &mut MySqlConnection,
    statements: &Statements,
    requests: &[ClaimRequest],
    status: RecordStatus,
) -> Result<Option<Vec<Begin>>, StoreError> {
    for request in requests {
        check_key_len(&request.key)?;
    }
    let mut sql = format!("SAVEPOINT oncely_claims; {}", statements.insert_new_head);
    push_rows(&mut sql, requests.iter(), status);
    let inserted = connection.execute(sqlx::raw_sql(&sql)).await?;
    if inserted.rows_affected() == requests.len() as u64 {
        return Ok(Some(vec![Begin::Started { attempt: 1 }; requests.len()]));
    }
    connection.execute("ROLLBACK TO SAVEPOINT oncely_claims").await?;
    Ok(None)
}

/// Claims `requests` with `status` in autocommit, for the coalesced three-step store: one
/// read of the rows the keys already have, then one multi-row `INSERT` of the keys that had
/// none — two round trips for the whole batch, and nothing else runs after the `INSERT`, so
/// a new row's lease starts when its answer leaves. A key whose row refuses the claim is
/// answered from the read. `None` for what the caller claims on its own ([`claim`]): a key
/// whose row may be taken over (a takeover's lease must not run down while a batch's
/// `INSERT` waits), and every new key when another claim inserted one of them between the
/// read and the `INSERT`, which then fails whole (a statement in autocommit is atomic) and
/// claims none. An error claims none either.
///
/// The keys must be distinct and each checked with [`check_key_len`]. Sent as text with the
/// values as literals, as [`claim_new_keys`] does, so no statement is prepared per batch
/// size; the new rows go in key order, so that two batches lock their keys in one order and
/// cannot deadlock each other.
pub(crate) async fn claim_many(
    connection: &mut MySqlConnection,
    statements: &Statements,
    requests: &[ClaimRequest],
    status: RecordStatus,
) -> Result<Vec<Option<Begin>>, StoreError> {
    let mut sql = statements.inspect_many_head.clone();
    for (i, request) in requests.iter().enumerate() {
        let separator = if i == 0 { "" } else { ", " };
        let _ = write!(sql, "{separator}X'{}'", hex(request.key.as_str().as_bytes()));
    }
    sql.push(')');
    let mut found = HashMap::new();
    for row in connection.fetch_all(sqlx::raw_sql(&sql)).await? {
        found.insert(row.try_get::<Vec<u8>, _>(0)?, found_record(&row, 1)?);
    }
    let is_new = |request: &ClaimRequest| !found.contains_key(request.key.as_str().as_bytes());
    let mut new: Vec<&ClaimRequest> = requests.iter().filter(|request| is_new(request)).collect();
    let mut inserted = true;
    if !new.is_empty() {
        new.sort_by(|a, b| a.key.as_str().cmp(b.key.as_str()));
        let mut sql = statements.insert_rows_head.clone();
        push_rows(&mut sql, new.iter().copied(), status);
        inserted = match connection.execute(sqlx::raw_sql(&sql)).await {
            Ok(_) => true,
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => false,
            Err(error) if lost_to_another_transaction(&error) => false,
            Err(error) => return Err(error.into()),
        };
    }
    let answer = |request: &ClaimRequest| match found.get(request.key.as_str().as_bytes()) {
        None => inserted.then_some(Begin::Started { attempt: 1 }),
        Some(row) => refused_claim(row, request.fingerprint, request.fencing_token),
    };
    Ok(requests.iter().map(answer).collect())
}

/// Appends the record rows of `requests` with `status` to `sql`, as literals: keys in hex,
/// fingerprints in hex digits, numbers, a status from the enum.
fn push_rows<'a>(sql: &mut String, requests: impl Iterator<Item = &'a ClaimRequest>, status: RecordStatus) {
    let literal = |value: Option<i64>| value.map_or_else(|| "NULL".to_owned(), |value| value.to_string());
    for (i, request) in requests.enumerate() {
        let _ = write!(
            sql,
            "{separator}(X'{key}', '{status}', '{fingerprint}', {fence}, UTC_TIMESTAMP(6) + INTERVAL {lease} MICROSECOND, \
             UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
            separator = if i == 0 { "" } else { ", " },
            key = hex(request.key.as_str().as_bytes()),
            status = status.as_str(),
            fingerprint = request.fingerprint,
            fence = literal(request.fencing_token.map(to_i64)),
            lease = literal(request.lease.map(micros)),
        );
    }
}

/// `bytes` as hex digits, for an `X'…'` literal.
fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, byte| {
            let _ = write!(out, "{byte:02x}");
            out
        })
}

/// A `message_key` column's bytes as a key.
pub(crate) fn key_of(bytes: Vec<u8>) -> Result<BusinessKey, StoreError> {
    key_text(bytes).map(BusinessKey::new)
}

/// A `message_key` column's bytes as text.
pub(crate) fn key_text(bytes: Vec<u8>) -> Result<String, StoreError> {
    String::from_utf8(bytes).map_err(|_| StoreError::malformed("a record key that is not UTF-8"))
}

/// A time the statements read as microseconds since the epoch
/// (`TIMESTAMPDIFF(MICROSECOND, '1970-01-01', column)`): sqlx reads `DATETIME` only with a
/// time crate.
pub(crate) fn time_of(micros: i64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// One key's record as the table holds it.
pub(crate) fn read_record(row: &MySqlRow) -> Result<ConsumptionRecord, StoreError> {
    let key = key_of(row.try_get(0)?)?;
    let retry_count: i32 = row.try_get(2)?;
    let fencing_token: Option<i64> = row.try_get(7)?;
    Ok(ConsumptionRecord {
        key,
        status: parse_status(row.try_get(1)?)?,
        attempts: u32::try_from(retry_count).unwrap_or(0) + 1,
        last_error: row.try_get(3)?,
        fingerprint: parse_fingerprint(row.try_get(4)?)?,
        created_at: time_of(row.try_get(5)?),
        updated_at: time_of(row.try_get(6)?),
        fencing_token: fencing_token.and_then(|token| u64::try_from(token).ok()),
    })
}
