//! The operator's view of a SQL record table, written once for both SQL stores: what a row,
//! the stuck rows and the table's counts are, and every statement `PgRecordAdmin` and
//! `MysqlRecordAdmin` run, rendered in each store's [`Dialect`]. The guarded settlements
//! (`release`, `mark_done`) are spelled here only, so that both stores change a row under the
//! same conditions. Each store keeps its plumbing (`postgres/admin.rs`, `mysql/admin.rs`):
//! its connections, its dialect, and how its driver reads a row. Whoever changes the record
//! table's meaning (each store's `claims.rs`) changes these too.

use std::fmt::Display;
use std::time::SystemTime;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::RecordStatus;
use crate::store::sql::{parse_fingerprint, parse_status};

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
    /// Of them, rows past their lease (the admins' `stuck`).
    pub stuck: u64,
    /// Rows `SUCCESS`.
    pub success: u64,
    /// Rows `FAILURE`.
    pub failure: u64,
    /// When the oldest `PROCESSING` row was first seen.
    pub oldest_processing_created_at: Option<SystemTime>,
    /// The earliest lease of a `PROCESSING` row.
    pub oldest_processing_lease_until: Option<SystemTime>,
    /// The table's size on disk with its indexes, in bytes: on PostgreSQL exact, with its
    /// TOAST; on MySQL and MariaDB InnoDB's estimate (`information_schema.TABLES`), which
    /// lags behind recent writes and counts pages, not rows (an empty table has one).
    pub table_bytes: u64,
    /// The retention horizon: when the oldest `SUCCESS` row was settled. A duplicate of a
    /// key settled before it is no longer recognised by the record.
    pub oldest_success_updated_at: Option<SystemTime>,
}

/// A key's stored response (oncely-http's, in the table beside the record table), as an
/// operator reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResponseRow {
    /// The HTTP status the key's first request was answered with.
    pub status: u16,
    /// Its `Content-Type`, if it had one.
    pub content_type: Option<String>,
    /// The body's length in bytes.
    pub body_len: u64,
    /// Until when it is answered again; after that the key answers 410 until purged.
    pub expires_at: SystemTime,
}

impl ResponseRow {
    /// A response from its columns as the driver read them: the headers as oncely-http
    /// stores them, one `name: value` line each.
    pub(crate) fn from_columns(status: i16, headers: &[u8], body_len: i64, expires_at: SystemTime) -> Self {
        let content_type = headers
            .split(|&byte| byte == b'\n')
            .filter_map(|line| std::str::from_utf8(line).ok())
            .filter_map(|line| line.trim_end_matches('\r').split_once(": "))
            .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
            .map(|(_, value)| value.to_owned());
        ResponseRow {
            status: u16::try_from(status).unwrap_or(0),
            content_type,
            body_len: u64::try_from(body_len).unwrap_or(0),
            expires_at,
        }
    }
}

impl RecordRow {
    /// A row from its columns as the driver read them, times already converted.
    #[allow(clippy::too_many_arguments)] // the table's columns, in its order
    pub(crate) fn from_columns(
        key: String,
        status: &str,
        retry_count: i32,
        last_error: Option<String>,
        fingerprint: &str,
        fencing_token: Option<i64>,
        lease_until: Option<SystemTime>,
        created_at: SystemTime,
        updated_at: SystemTime,
    ) -> Result<Self, StoreError> {
        Ok(RecordRow {
            key,
            status: parse_status(status)?,
            attempts: u32::try_from(retry_count).unwrap_or(0).saturating_add(1),
            last_error,
            fingerprint: parse_fingerprint(fingerprint)?,
            fencing_token: fencing_token.and_then(|token| u64::try_from(token).ok()),
            lease_until,
            created_at,
            updated_at,
        })
    }
}

/// The note `release` writes in front of a row's error text.
const RELEASED: &str = "released by an operator";
/// The note `mark_done` writes in front of a row's error text.
const MARKED_DONE: &str = "marked done by an operator";

/// How one SQL store spells what the operator's statements need.
pub(crate) trait Dialect {
    /// The server's clock, as the record's time columns compare with it.
    const NOW: &'static str;

    /// The `n`-th bound parameter, from 1. MySQL's `?` are taken in the order they appear,
    /// PostgreSQL's are numbered: every statement here names each of its parameters once, in
    /// their order, so both read the same binding.
    fn parameter(n: usize) -> String;

    /// `expression`, one of the record's times, as the store's driver reads it back.
    fn time(expression: &str) -> String;

    /// The time `parameter` before now, in the unit the store's retention purge binds its
    /// age in: what `purgeable` counts must be what a purge of that age deletes.
    fn ago(parameter: &str) -> String;

    /// `error_details` with the literal `note` in front, as a settlement writes it.
    fn noted(note: &str) -> String;

    /// The table's size on disk in bytes, as a `BIGINT`, the table named by `parameter`.
    fn table_bytes(parameter: &str) -> String;

    /// Whether the table named by `parameter` exists, as a count (0 or 1).
    fn table_exists(parameter: &str) -> String;
}

/// The SQL text of every operator's statement, with the table name filled in, and what each
/// binds, in order.
#[derive(Clone, Debug)]
pub(crate) struct AdminStatements {
    /// One key's whole row ([`columns`](Self::columns)). Binds the key.
    pub(crate) inspect: String,
    /// The stuck rows, oldest lease first. Binds the limit.
    pub(crate) stuck: String,
    /// How many rows are stuck. Binds nothing.
    pub(crate) stuck_count: String,
    /// `PROCESSING` → `FAILURE`. Binds key, status seen, retry count seen, force.
    pub(crate) release: String,
    /// `PROCESSING` or `FAILURE` → `SUCCESS`. Binds key, status seen, retry count seen, force.
    pub(crate) mark_done: String,
    /// Counts by status, oldest times, size. Binds the table as [`Dialect::table_bytes`]
    /// reads it.
    pub(crate) stats: String,
    /// How many `SUCCESS` rows a purge of an age would delete. Binds the age, in the
    /// store's retention unit.
    pub(crate) purgeable: String,
    /// The statements on the stored responses beside the table, when their table's name is
    /// a valid one.
    pub(crate) answered: Option<AnsweredStatements>,
    /// Up to 10 keys scoped by a client (oncely-http's `SCOPE:KEY`) whose key is the one
    /// asked for. Binds the `LIKE` pattern ([`scoped_pattern`]).
    pub(crate) scoped_keys: String,
}

/// The `LIKE` pattern of every key `…:key`, with `key`'s own wildcards escaped.
pub(crate) fn scoped_pattern(key: &str) -> String {
    let mut pattern = String::from("%:");
    for ch in key.chars() {
        if matches!(ch, '%' | '_' | '\\') {
            pattern.push('\\');
        }
        pattern.push(ch);
    }
    pattern
}

/// The operator's statements where stored responses (oncely-http's) live beside the record
/// table: a record row goes only with its response, once that expired.
#[derive(Clone, Debug)]
pub(crate) struct AnsweredStatements {
    /// Whether the responses table exists. Binds its name, as [`Dialect::table_exists`]
    /// reads it.
    pub(crate) exists: String,
    /// [`AdminStatements::purgeable`] less the rows whose response still lives.
    pub(crate) purgeable: String,
    /// How many `SUCCESS` rows older than an age are kept because their response lives.
    /// Binds the age.
    pub(crate) held: String,
    /// One key's response: status, headers, body length, expiry. Binds the key.
    pub(crate) response: String,
}

impl AdminStatements {
    /// The statements on `table` (already validated and quoted) in dialect `D`.
    pub(crate) fn new<D: Dialect>(table: &impl Display, responses: Option<&dyn Display>) -> Self {
        let p = D::parameter;
        let now = D::NOW;
        let columns = format!(
            "message_key, status, retry_count, error_details, payload_fingerprint, fencing_token, {}, {}, {}",
            D::time("lease_until"),
            D::time("created_at"),
            D::time("updated_at"),
        );
        let stuck = format!("status = 'PROCESSING' AND lease_until < {now}");
        // The operator decided on the row as shown: a delivery that took the key over since
        // (a new attempt, or a new lease), or a lease still running unless forced, leaves it
        // unchanged.
        let same_attempt = format!(
            "message_key = {} AND status = {} AND retry_count = {}
                   AND ({} OR lease_until IS NULL OR lease_until < {now})",
            p(1),
            p(2),
            p(3),
            p(4)
        );
        let oldest = |status: &str, column: &str| {
            D::time(&format!("min(CASE WHEN status = '{status}' THEN {column} END)"))
        };
        AdminStatements {
            inspect: format!("SELECT {columns} FROM {table} WHERE message_key = {}", p(1)),
            stuck: format!(
                "SELECT {columns} FROM {table} WHERE {stuck} ORDER BY lease_until LIMIT {}",
                p(1)
            ),
            stuck_count: format!("SELECT count(*) FROM {table} WHERE {stuck}"),
            // FAILURE, as a failed attempt leaves it: the key's next delivery takes it over.
            release: format!(
                "UPDATE {table} SET status = 'FAILURE', lease_until = NULL, updated_at = {now},
                        error_details = {}
                 WHERE {same_attempt} AND status = 'PROCESSING'",
                D::noted(RELEASED)
            ),
            mark_done: format!(
                "UPDATE {table} SET status = 'SUCCESS', lease_until = NULL, updated_at = {now},
                        error_details = {}
                 WHERE {same_attempt} AND status IN ('PROCESSING', 'FAILURE')",
                D::noted(MARKED_DONE)
            ),
            stats: format!(
                "SELECT count(CASE WHEN status = 'PROCESSING' THEN 1 END),
                        count(CASE WHEN {stuck} THEN 1 END),
                        count(CASE WHEN status = 'SUCCESS' THEN 1 END),
                        count(CASE WHEN status = 'FAILURE' THEN 1 END),
                        {}, {}, {}, {}
                 FROM {table}",
                oldest("PROCESSING", "created_at"),
                oldest("PROCESSING", "lease_until"),
                oldest("SUCCESS", "updated_at"),
                D::table_bytes(&p(1)),
            ),
            purgeable: format!(
                "SELECT count(*) FROM {table} WHERE status = 'SUCCESS' AND updated_at < {}",
                D::ago(&p(1))
            ),
            answered: responses.map(|responses| AnsweredStatements::new::<D>(table, responses)),
            scoped_keys: format!(
                "SELECT message_key FROM {table} WHERE message_key LIKE {} ORDER BY message_key LIMIT 10",
                p(1)
            ),
        }
    }
}

impl AnsweredStatements {
    fn new<D: Dialect>(table: &impl Display, responses: &dyn Display) -> Self {
        let p = D::parameter;
        let now = D::NOW;
        let old = format!("r.status = 'SUCCESS' AND r.updated_at < {}", D::ago(&p(1)));
        let lives = format!(
            "EXISTS (SELECT 1 FROM {responses} s WHERE s.message_key = r.message_key AND s.expires_at > {now})"
        );
        AnsweredStatements {
            exists: D::table_exists(&p(1)),
            purgeable: format!("SELECT count(*) FROM {table} r WHERE {old} AND NOT {lives}"),
            held: format!("SELECT count(*) FROM {table} r WHERE {old} AND {lives}"),
            response: format!(
                "SELECT status, headers, length(body), {} FROM {responses} WHERE message_key = {}",
                D::time("expires_at"),
                p(1)
            ),
        }
    }
}

/// A count from SQL, which has no unsigned type.
pub(crate) fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}
