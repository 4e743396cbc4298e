//! MySQL and MariaDB: stored responses written in the transactional record's XA
//! transaction.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use oncely::mysql::Table;
use oncely::mysql::sqlx::{self, MySqlPool, Row};
use oncely::record::MysqlTransaction;
use oncely::{BusinessKey, ConfigError, Envelope, StoreError};

use crate::response::{ResponseStore, SaveFailure, StoredResponse};

const RESPONSES: &str = include_str!("responses.sql");

/// Stored responses in MySQL or MariaDB, in the table `<records>_responses` beside the
/// record table `records`, written in the record's transaction.
///
/// Stand it behind `oncely::record::MysqlTransactionalLayer` on the same database: the
/// layer's transaction is lent to the handler (`Extension<MysqlTransaction>` in axum) and
/// the response is written in it, so the business write, the stored response and the record
/// commit together or not at all; without that layer every request fails, as with
/// [`PgResponses`](crate::PgResponses).
#[derive(Clone)]
pub struct MysqlResponses {
    pool: MySqlPool,
    table: Table,
    records: Table,
    statements: Arc<Statements>,
}

struct Statements {
    save: String,
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
        let table = Table::new(format!("{}_responses", records.as_str()))?;
        let statements = Statements {
            save: format!(
                "INSERT INTO {table} (message_key, status, headers, body, expires_at) \
                 VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND) \
                 ON DUPLICATE KEY UPDATE status = VALUES(status), headers = VALUES(headers), \
                 body = VALUES(body), expires_at = VALUES(expires_at)"
            ),
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
        })
    }

    /// Creates the table if it does not exist. Idempotent.
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

    async fn save(
        &self,
        envelope: &Envelope,
        response: &StoredResponse,
        expiry: Duration,
    ) -> Result<(), SaveFailure> {
        let Some(transaction) = envelope.extensions().get::<MysqlTransaction>() else {
            return Err(StoreError::malformed(
                "no record transaction to store the response in: put MysqlTransactionalLayer in the tiers",
            )
            .into());
        };
        let micros = u64::try_from(expiry.as_micros()).unwrap_or(u64::MAX);
        sqlx::query(&self.statements.save)
            .bind(envelope.key().as_str().as_bytes())
            .bind(response.status.as_u16())
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(micros)
            .execute(transaction)
            .await
            .map_err(StoreError::from)?;
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
