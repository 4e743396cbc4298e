//! MySQL and MariaDB: stored responses written in the transactional record's XA
//! transaction, and one-time tokens.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use oncely::mysql::Table;
use oncely::mysql::sqlx::{self, MySqlPool, Row};
use oncely::record::{MysqlCommitRows, MysqlTransaction};
use oncely::{BoxFuture, BusinessKey, ConfigError, Envelope, StoreError};

use crate::response::{ResponseStore, SaveFailure, StoredResponse};
use crate::token::{TokenBook, TokenCheck, fresh_token};

const RESPONSES: &str = include_str!("responses.sql");

/// Stored responses in MySQL or MariaDB, in the table `<records>_responses` beside the
/// record table `records`, written in the record's transaction.
///
/// Stand it behind `oncely::record::MysqlTransactionalLayer` on the same database: the
/// layer's transaction is lent to the handler (`Extension<MysqlTransaction>` in axum) and
/// the response is written in it as it commits (`MysqlTransaction::defer`: with the batched
/// record, a batch's responses in one statement), so the business write, the stored
/// response and the record commit together or not at all. Without that layer, or without
/// the table ([`migrate`](Self::migrate)), every request is refused before its handler runs
/// ([`Problem::Misconfigured`](crate::Problem::Misconfigured), logged at error level), as
/// with `PgResponses`. A response is written once, as with `PgResponses`.
#[derive(Clone)]
pub struct MysqlResponses {
    pool: MySqlPool,
    table: Table,
    records: Table,
    statements: Arc<Statements>,
    /// Set once the table was seen to exist.
    migrated: Arc<AtomicBool>,
}

struct Statements {
    /// The start of a multi-row `INSERT`; each row's values follow.
    save: Arc<str>,
    load: String,
    expired: String,
}

impl fmt::Debug for MysqlResponses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlResponses")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl MysqlResponses {
    /// The stored responses of the record table `records`, on `pool`. [`ConfigError`] when
    /// `<records>_responses` is longer than a table name may be (64 bytes).
    pub fn new(pool: MySqlPool, records: &Table) -> Result<Self, ConfigError> {
        // Named where oncely's record retention looks for it: a record row goes only with
        // its response, once that expired.
        let table = oncely::mysql::responses_table(records)?;
        let statements = Statements {
            // Written once, at the commit: a key that already has a response is a bug (its
            // record row was removed without it), and the duplicate key fails the commit
            // rather than replace the answer its first request got.
            save: format!("INSERT INTO {table} (message_key, status, headers, body, expires_at) ").into(),
            load: format!(
                "SELECT status, headers, body FROM {table} \
                 WHERE message_key = ? AND expires_at > UTC_TIMESTAMP(6)"
            ),
            expired: format!(
                "SELECT message_key FROM {table} WHERE expires_at <= UTC_TIMESTAMP(6) \
                 ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
        };
        Ok(MysqlResponses {
            pool,
            table,
            records: records.clone(),
            statements: Arc::new(statements),
            migrated: Arc::default(),
        })
    }

    /// Creates the table if it does not exist. Idempotent. Call it when the application
    /// starts: without the table every request is refused
    /// ([`Problem::Misconfigured`](crate::Problem::Misconfigured), logged at error level).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let statement = RESPONSES.replace("{table}", &self.table.to_string());
        sqlx::raw_sql(&statement).execute(&self.pool).await?;
        Ok(())
    }

    /// The table the responses are kept in.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Deletes up to `limit` (at most 10,000) expired responses, oldest first, with their
    /// keys' `SUCCESS` record rows, in one transaction, so that those keys are new again;
    /// answers how many responses went. As `PgResponses::purge_expired` (feature
    /// `postgres`).
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, StoreError> {
        let mut transaction = self.pool.begin().await?;
        // Each key is a placeholder of the statements below, which allow 65,535.
        let keys: Vec<Vec<u8>> = sqlx::query_scalar(&self.statements.expired)
            .bind(limit.min(10_000))
            .fetch_all(&mut *transaction)
            .await?;
        if keys.is_empty() {
            return Ok(0);
        }
        let marks = vec!["?"; keys.len()].join(", ");
        let records = format!(
            "DELETE FROM {} WHERE status = 'SUCCESS' AND message_key IN ({marks})",
            self.records
        );
        let responses = format!("DELETE FROM {} WHERE message_key IN ({marks})", self.table);
        for statement in [records, responses] {
            let query = keys
                .iter()
                .fold(sqlx::query(&statement), |query, key| query.bind(key));
            query.execute(&mut *transaction).await?;
        }
        transaction.commit().await?;
        Ok(keys.len() as u64)
    }
}

impl ResponseStore for MysqlResponses {
    fn lend(&self, envelope: &Envelope, extensions: &mut http::Extensions) {
        if let Some(transaction) = envelope.extensions().get::<MysqlTransaction>() {
            extensions.insert(transaction.clone());
        }
    }

    /// Nothing to do: a statement cut off through the transaction's handle marks the
    /// transaction cut off, and its rollback ends the session rather than wait for it.
    async fn interrupt(&self, _: &Envelope) {}

    async fn ready(&self, envelope: &Envelope) -> Result<(), SaveFailure> {
        let Some(transaction) = envelope.extensions().get::<MysqlTransaction>() else {
            return Err(missing_record());
        };
        if self.migrated.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Asked once, in the request's own transaction: a check on another pooled
        // connection could wait for a pool that the record's waiting copies emptied.
        let found: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(self.table.as_str())
        .fetch_one(transaction)
        .await
        .map_err(StoreError::from)?;
        if found == 0 {
            return Err(ConfigError::MissingTable {
                table: self.table.to_string(),
                fix: "call MysqlResponses::migrate() when the application starts".to_owned(),
            }
            .into());
        }
        self.migrated.store(true, Ordering::Relaxed);
        Ok(())
    }

    async fn save(
        &self,
        envelope: &Envelope,
        response: &StoredResponse,
        expiry: Duration,
    ) -> Result<(), SaveFailure> {
        let Some(transaction) = envelope.extensions().get::<MysqlTransaction>() else {
            return Err(missing_record());
        };
        // A statement of the handler's failed: the transaction will not commit, and the
        // handler is told so (500), not the client that a store failed.
        if let Some(failure) = transaction.failure() {
            return Err(SaveFailure::HandlerAborted(StoreError::malformed(failure)));
        }
        let micros = u64::try_from(expiry.as_micros()).unwrap_or(u64::MAX);
        let headers = response.encode_headers();
        transaction.defer(ResponseRows {
            insert: self.statements.save.clone(),
            bytes: response.body.len() + headers.len() + envelope.key().as_str().len(),
            rows: vec![ResponseRow {
                key: envelope.key().as_str().as_bytes().to_vec(),
                status: response.status.as_u16(),
                headers,
                body: response.body.clone(),
                expiry_micros: micros,
            }],
        });
        Ok(())
    }

    async fn load(&self, key: &BusinessKey) -> Result<Option<StoredResponse>, StoreError> {
        let row = sqlx::query(&self.statements.load)
            .bind(key.as_str().as_bytes())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| {
            let status: i16 = row.try_get(0)?;
            let headers: Vec<u8> = row.try_get(1)?;
            let body: Vec<u8> = row.try_get(2)?;
            StoredResponse::decode(status.into(), &headers, Bytes::from(body))
        })
        .transpose()
    }
}

/// The failure of a stack that lends no record transaction to store the response in.
fn missing_record() -> SaveFailure {
    SaveFailure::Misconfigured(ConfigError::MissingTier {
        layer: "MysqlResponses".to_owned(),
        needed: "MysqlTransactionalLayer (or its batched mode) innermost, to store each response \
                 in the record's transaction"
            .to_owned(),
    })
}

/// The most bytes of rows one statement gathers: well under MariaDB's default
/// `max_allowed_packet` (16 MiB) with the rest of the statement. One response alone may be
/// larger (up to the layer's `with_max_response_len`, 1 MiB by default): a response larger
/// than `max_allowed_packet` fails its commit (503) every time, so keep the maximum under it.
const MAX_GATHERED_BYTES: usize = 4 * 1024 * 1024;

/// The most rows one statement gathers: five placeholders each, under the 65,535 a
/// statement may have.
const MAX_GATHERED_ROWS: usize = 1000;

/// Responses waiting for their record's commit: with the batched record, a batch's
/// responses are written by one multi-row `INSERT`, not one per request on the batch's
/// connection.
struct ResponseRows {
    /// The statement's start, which names the table: rows for another table are not
    /// gathered here.
    insert: Arc<str>,
    /// The rows' bytes (keys, headers, bodies), gathered.
    bytes: usize,
    rows: Vec<ResponseRow>,
}

struct ResponseRow {
    key: Vec<u8>,
    status: u16,
    headers: Vec<u8>,
    body: Bytes,
    expiry_micros: u64,
}

impl MysqlCommitRows for ResponseRows {
    fn absorb(&mut self, more: Self) -> Option<Self> {
        let fits = self.bytes + more.bytes <= MAX_GATHERED_BYTES
            && self.rows.len() + more.rows.len() <= MAX_GATHERED_ROWS;
        if self.insert != more.insert || !fits {
            return Some(more);
        }
        self.bytes += more.bytes;
        self.rows.extend(more.rows);
        None
    }

    async fn write(self, connection: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        let mut insert = sqlx::QueryBuilder::new(&*self.insert);
        insert.push_values(&self.rows, |mut values, row| {
            values
                .push_bind(&row.key[..])
                .push_bind(row.status)
                .push_bind(&row.headers[..])
                .push_bind(&row.body[..])
                .push("UTC_TIMESTAMP(6) + INTERVAL ")
                .push_bind_unseparated(row.expiry_micros)
                .push_unseparated(" MICROSECOND");
        });
        insert.build().execute(&mut *connection).await?;
        Ok(())
    }
}

const TOKENS: &str = include_str!("tokens.sql");

/// One-time tokens in the MySQL or MariaDB table `table`: issued bound to a client's scope,
/// checked when a submit presents them; `PgTokens` (feature `postgres`) on MySQL. The
/// submit's single run is the route's tiers' business (see [`TokenBook`]); this table says
/// only who may present which token until when.
#[derive(Clone)]
pub struct MysqlTokens {
    pool: MySqlPool,
    table: Table,
    statements: Arc<TokenStatements>,
}

struct TokenStatements {
    issue: String,
    check: String,
    purge: String,
}

impl fmt::Debug for MysqlTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlTokens")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl MysqlTokens {
    /// Tokens in `table` on `pool`.
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        let statements = TokenStatements {
            issue: format!(
                "INSERT INTO {table} (token, client, issued_at, expires_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
            ),
            check: format!("SELECT client = ?, expires_at > UTC_TIMESTAMP(6) FROM {table} WHERE token = ?"),
            // MySQL takes no LIMIT inside an IN subquery: the DELETE orders and limits itself.
            purge: format!(
                "DELETE FROM {table} WHERE expires_at <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                 ORDER BY expires_at LIMIT ?"
            ),
        };
        MysqlTokens {
            pool,
            table,
            statements: Arc::new(statements),
        }
    }

    /// Creates the table if it does not exist. Idempotent.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let statement = TOKENS.replace("{table}", &self.table.to_string());
        sqlx::raw_sql(&statement).execute(&self.pool).await?;
        Ok(())
    }

    /// Deletes up to `limit` tokens that expired more than `grace` ago; answers how many.
    /// A purged token is unknown ([`TokenCheck::Unknown`]) rather than expired, so keep
    /// `grace` as long as the route's stored responses are answered again.
    pub async fn purge_expired(&self, limit: u32, grace: Duration) -> Result<u64, StoreError> {
        let micros = u64::try_from(grace.as_micros()).unwrap_or(u64::MAX);
        let purged = sqlx::query(&self.statements.purge)
            .bind(micros)
            .bind(limit)
            .execute(&self.pool)
            .await?;
        Ok(purged.rows_affected())
    }
}

impl TokenBook for MysqlTokens {
    fn issue(&self, client: String, ttl: Duration) -> BoxFuture<Result<String, StoreError>> {
        let tokens = self.clone();
        Box::pin(async move {
            let token = fresh_token();
            let micros = u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX);
            sqlx::query(&tokens.statements.issue)
                .bind(token.as_bytes())
                .bind(client.as_bytes())
                .bind(micros)
                .execute(&tokens.pool)
                .await?;
            Ok(token)
        })
    }

    fn check(&self, token: String, client: String) -> BoxFuture<Result<TokenCheck, StoreError>> {
        let tokens = self.clone();
        Box::pin(async move {
            let row = sqlx::query(&tokens.statements.check)
                .bind(client.as_bytes())
                .bind(token.as_bytes())
                .fetch_optional(&tokens.pool)
                .await?;
            let Some(row) = row else {
                return Ok(TokenCheck::Unknown);
            };
            let (own, live): (bool, bool) = (row.try_get(0)?, row.try_get(1)?);
            Ok(TokenCheck::of(own, live))
        })
    }
}
