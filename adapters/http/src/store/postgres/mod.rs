//! PostgreSQL: stored responses written in the transactional record's transaction, and
//! one-time tokens.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::{self, NoTls};
use oncely::postgres::{Table, migrate_script};
use oncely::record::{CommitRows, PgTransaction};
use oncely::{BoxFuture, BusinessKey, ConfigError, Envelope, StoreError};

use crate::response::{ResponseStore, SaveFailure, StoredResponse};
use crate::token::{TokenBook, TokenCheck, fresh_token};

const RESPONSES: &str = include_str!("responses.sql");
const TOKENS: &str = include_str!("tokens.sql");

/// `migration` with `table`'s names in it.
fn render(migration: &str, table: &Table) -> String {
    migration
        .replace("{schema}", &table.schema().to_string())
        .replace("{table}", &table.name().to_string())
        .replace("{expiry_index}", &format!("\"{}_expiry\"", table.name().as_str()))
}

/// Stored responses in PostgreSQL, in the table `<records>_responses` beside the record
/// table `records`, written in the record's transaction.
///
/// Stand it behind `oncely::record::PgTransactionalLayer` on the same database: the layer's
/// open transaction is lent to the handler (`Extension<PgTransaction>` in axum) and the
/// response is written in it as it commits ([`PgTransaction::defer`]: with the batched
/// record, a batch's responses in one statement), so the business write, the stored
/// response and the record commit together or not at all. Without that layer in the tiers,
/// or without the table ([`migrate`](Self::migrate)), every request is refused before its
/// handler runs ([`Problem::Misconfigured`](crate::Problem::Misconfigured), logged at error
/// level): a response stored outside the record's transaction could outlive a rolled-back
/// effect, or be lost after a committed one.
///
/// A response is written once: its key's record and it are removed together, and only
/// once it expired ([`purge_expired`](Self::purge_expired), and oncely's record retention,
/// which keeps a record while its response lives). Should a key's response exist all the
/// same when its request commits, the commit fails (500, logged) rather than replace the
/// answer the first request got.
#[derive(Clone)]
pub struct PgResponses {
    pool: Pool,
    table: Table,
    records: Table,
    statements: Arc<Statements>,
    /// Set once the table was seen to exist.
    migrated: Arc<AtomicBool>,
}

struct Statements {
    save: Arc<str>,
    load: String,
    purge: String,
}

impl fmt::Debug for PgResponses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgResponses")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PgResponses {
    /// The stored responses of the record table `records`, on `pool`. [`ConfigError`] when
    /// `<records>_responses` is longer than an identifier may be (63 bytes).
    pub fn new(pool: Pool, records: &Table) -> Result<Self, ConfigError> {
        // Named where oncely's record retention looks for it: a record row goes only with
        // its response, once that expired.
        let table = oncely::postgres::responses_table(records)?;
        let statements = Statements {
            // Every response of a batch in one statement, at the batch's commit. Written
            // once: a key that already has a response is a bug (its record row was removed
            // without it), and the unique violation fails the commit rather than replace
            // the answer its first request got.
            save: format!(
                "INSERT INTO {table} (message_key, status, headers, body, expires_at) \
                 SELECT key, status, headers, body, now() + make_interval(secs => expiry) \
                 FROM unnest($1::text[], $2::int2[], $3::bytea[], $4::bytea[], $5::float8[]) \
                   AS saved(key, status, headers, body, expiry)"
            )
            .into(),
            load: format!(
                "SELECT status::int4, headers, body FROM {table} WHERE message_key = $1 AND expires_at > now()"
            ),
            // The record rows go with their responses, in one statement: a purged key is
            // new again, never "processed, response gone" for ever.
            purge: format!(
                "WITH gone AS (DELETE FROM {table} WHERE message_key IN \
                   (SELECT message_key FROM {table} WHERE expires_at <= now() \
                    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING message_key), \
                 records AS (DELETE FROM {records} WHERE message_key IN (SELECT message_key FROM gone) \
                   AND status = 'SUCCESS') \
                 SELECT count(*) FROM gone"
            ),
        };
        Ok(PgResponses {
            pool,
            table,
            records: records.clone(),
            statements: Arc::new(statements),
            migrated: Arc::default(),
        })
    }

    /// Creates the table (and its schema) if it does not exist. Idempotent. Call it when the
    /// application starts: without the table every request is refused
    /// ([`Problem::Misconfigured`](crate::Problem::Misconfigured), logged at error level).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate_script(&self.pool, &render(RESPONSES, &self.table)).await
    }

    /// The table the responses are kept in.
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Deletes up to `limit` expired responses, oldest first, with their keys' `SUCCESS`
    /// record rows, so that those keys are new again; answers how many responses went.
    /// Safe while requests run (rows in use are skipped); call it until it answers 0.
    ///
    /// oncely's record retention (and `oncely purge`) keeps a key's record row while its
    /// response lives, and removes the two together once it expired, so either may run.
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, StoreError> {
        let client = self.pool.get().await.map_err(StoreError::new)?;
        let row = client
            .query_one(&self.statements.purge, &[&i64::from(limit)])
            .await
            .map_err(StoreError::new)?;
        let purged: i64 = row.try_get(0).map_err(StoreError::new)?;
        tracing::debug!(records = %self.records, purged, "purged expired responses");
        Ok(u64::try_from(purged).unwrap_or(0))
    }
}

impl ResponseStore for PgResponses {
    fn lend(&self, envelope: &Envelope, extensions: &mut http::Extensions) {
        if let Some(transaction) = envelope.extensions().get::<PgTransaction>() {
            extensions.insert(transaction.clone());
        }
    }

    async fn interrupt(&self, envelope: &Envelope) {
        if let Some(transaction) = envelope.extensions().get::<PgTransaction>() {
            let cancelled = transaction.cancel_token().cancel_query(NoTls).await;
            if let Err(error) = cancelled {
                tracing::warn!(%error, "could not cancel the statement of a handler that timed out");
            }
        }
    }

    async fn ready(&self, envelope: &Envelope) -> Result<(), SaveFailure> {
        let Some(transaction) = envelope.extensions().get::<PgTransaction>() else {
            return Err(missing_record());
        };
        if self.migrated.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Asked once, in the request's own transaction: a check on another pooled
        // connection could wait for a pool that the record's waiting copies emptied.
        let row = transaction
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&self.table.to_string()])
            .await
            .map_err(StoreError::new)?;
        if !row.try_get::<_, bool>(0).map_err(StoreError::new)? {
            return Err(ConfigError::MissingTable {
                table: self.table.to_string(),
                fix: "call PgResponses::migrate() when the application starts".to_owned(),
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
        let Some(transaction) = envelope.extensions().get::<PgTransaction>() else {
            return Err(missing_record());
        };
        // Written as the record commits, with the batch's other responses: see `ResponseRows`.
        transaction.defer(ResponseRows {
            insert: self.statements.save.clone(),
            keys: vec![envelope.key().as_str().to_owned()],
            statuses: vec![i16::try_from(response.status.as_u16()).unwrap_or(i16::MAX)],
            headers: vec![response.encode_headers()],
            bodies: vec![response.body.clone()],
            expiries: vec![expiry.as_secs_f64()],
        });
        Ok(())
    }

    async fn load(&self, key: &BusinessKey) -> Result<Option<StoredResponse>, StoreError> {
        let client = self.pool.get().await.map_err(StoreError::new)?;
        let load = client
            .prepare_cached(&self.statements.load)
            .await
            .map_err(StoreError::new)?;
        let row = client
            .query_opt(&load, &[&key.as_str()])
            .await
            .map_err(StoreError::new)?;
        row.map(|row| {
            let body: Vec<u8> = row.try_get(2).map_err(StoreError::new)?;
            let headers: Vec<u8> = row.try_get(1).map_err(StoreError::new)?;
            StoredResponse::decode(
                row.try_get(0).map_err(StoreError::new)?,
                &headers,
                Bytes::from(body),
            )
        })
        .transpose()
    }
}

/// The failure of a stack that lends no record transaction to store the response in.
fn missing_record() -> SaveFailure {
    SaveFailure::Misconfigured(ConfigError::MissingTier {
        layer: "PgResponses".to_owned(),
        needed: "PgTransactionalLayer (or its batched mode) innermost, to store each response \
                 in the record's transaction"
            .to_owned(),
    })
}

/// Responses waiting for their record's commit, one column each: with the batched record,
/// a batch's responses are written by one statement (a multi-row `INSERT` from arrays), not
/// one per request on the batch's connection.
struct ResponseRows {
    /// The statement, which names the table: rows for another table are not gathered here.
    insert: Arc<str>,
    keys: Vec<String>,
    statuses: Vec<i16>,
    headers: Vec<Vec<u8>>,
    bodies: Vec<Bytes>,
    expiries: Vec<f64>,
}

impl CommitRows for ResponseRows {
    fn absorb(&mut self, more: Self) -> Option<Self> {
        if self.insert != more.insert {
            return Some(more);
        }
        self.keys.extend(more.keys);
        self.statuses.extend(more.statuses);
        self.headers.extend(more.headers);
        self.bodies.extend(more.bodies);
        self.expiries.extend(more.expiries);
        None
    }

    async fn write(self, client: &deadpool_postgres::Client) -> Result<(), tokio_postgres::Error> {
        // Prepared once per connection: a statement prepared per batch costs a round trip.
        let insert = client.prepare_cached(&self.insert).await?;
        let bodies: Vec<&[u8]> = self.bodies.iter().map(|body| &body[..]).collect();
        client
            .execute(
                &insert,
                &[&self.keys, &self.statuses, &self.headers, &bodies, &self.expiries],
            )
            .await?;
        Ok(())
    }
}

/// One-time tokens in the PostgreSQL table `table`: issued bound to a client, checked
/// when a submit presents them. The submit's single run is the route's tiers' business
/// (see [`TokenBook`]); this table says only who may present which token until when.
#[derive(Clone)]
pub struct PgTokens {
    pool: Pool,
    table: Table,
    statements: Arc<TokenStatements>,
}

struct TokenStatements {
    issue: String,
    check: String,
    purge: String,
}

impl fmt::Debug for PgTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTokens")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PgTokens {
    /// Tokens in `table` on `pool`.
    pub fn new(pool: Pool, table: Table) -> Self {
        let statements = TokenStatements {
            issue: format!(
                "INSERT INTO {table} (token, client, expires_at) VALUES ($1, $2, now() + make_interval(secs => $3))"
            ),
            check: format!("SELECT client = $2, expires_at > now() FROM {table} WHERE token = $1"),
            purge: format!(
                "DELETE FROM {table} WHERE token IN (SELECT token FROM {table} WHERE expires_at <= now() - \
                 make_interval(secs => $2) LIMIT $1)"
            ),
        };
        PgTokens {
            pool,
            table,
            statements: Arc::new(statements),
        }
    }

    /// Creates the table (and its schema) if it does not exist. Idempotent.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate_script(&self.pool, &render(TOKENS, &self.table)).await
    }

    /// Deletes up to `limit` tokens that expired more than `grace` ago; answers how many.
    /// A purged token is unknown ([`TokenCheck::Unknown`]) rather than expired, so keep
    /// `grace` as long as the route's stored responses are answered again.
    pub async fn purge_expired(&self, limit: u32, grace: Duration) -> Result<u64, StoreError> {
        let client = self.pool.get().await.map_err(StoreError::new)?;
        client
            .execute(&self.statements.purge, &[&i64::from(limit), &grace.as_secs_f64()])
            .await
            .map_err(StoreError::new)
    }
}

impl TokenBook for PgTokens {
    fn issue(&self, client: String, ttl: Duration) -> BoxFuture<Result<String, StoreError>> {
        let tokens = self.clone();
        Box::pin(async move {
            let token = fresh_token();
            let connection = tokens.pool.get().await.map_err(StoreError::new)?;
            connection
                .execute(&tokens.statements.issue, &[&token, &client, &ttl.as_secs_f64()])
                .await
                .map_err(StoreError::new)?;
            Ok(token)
        })
    }

    fn check(&self, token: String, client: String) -> BoxFuture<Result<TokenCheck, StoreError>> {
        let tokens = self.clone();
        Box::pin(async move {
            let connection = tokens.pool.get().await.map_err(StoreError::new)?;
            let row = connection
                .query_opt(&tokens.statements.check, &[&token, &client])
                .await
                .map_err(StoreError::new)?;
            let Some(row) = row else {
                return Ok(TokenCheck::Unknown);
            };
            let (own, live): (bool, bool) = (
                row.try_get(0).map_err(StoreError::new)?,
                row.try_get(1).map_err(StoreError::new)?,
            );
            Ok(TokenCheck::of(own, live))
        })
    }
}
