//! The retention service's lease and batches on MySQL and MariaDB: a named lock
//! (`GET_LOCK`) per record table, held by the connection that purges.

use std::sync::Arc;
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use super::MysqlRecordStore;
use crate::error::StoreError;
use crate::record::{RetentionRunner, RetentionStore};
use crate::store::mysql::claims::Statements;
use crate::store::mysql::transaction::Unpooled;
use crate::store::sql::micros;

/// Holds the table's purge lease on its connection until it steps down.
pub struct MysqlRetentionRunner {
    connection: Unpooled,
    statements: Arc<Statements>,
    /// Stored responses live beside the table: a record row goes only with its response,
    /// once that expired.
    answered: bool,
    lease: String,
}

/// The most keys one `DELETE … IN (…)` binds: well under the 65,535 placeholders a
/// statement may have.
const KEYS_PER_DELETE: usize = 10_000;

impl RetentionStore for MysqlRecordStore {
    type Runner = MysqlRetentionRunner;

    async fn lead(&self) -> Result<Option<MysqlRetentionRunner>, StoreError> {
        let mut connection = Unpooled(Some(self.pool.acquire().await?));
        // Named locks are the server's, not a database's: the name holds the database as
        // well as the table, hashed, because names are at most 64 characters.
        let database: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
            .fetch_one(&mut **connection.get())
            .await?;
        let table = format!("{}.{}", database.unwrap_or_default(), self.table);
        let lease = format!("oncely.retention.{:016x}", xxh3_64(table.as_bytes()));
        // GET_LOCK answers 1 when taken, 0 when another session holds it (timeout 0).
        let held: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(&lease)
            .fetch_one(&mut **connection.get())
            .await?;
        if held != Some(1) {
            connection.keep();
            return Ok(None);
        }
        // Stored responses beside the table (oncely-http's): a record row goes only with
        // its response, once that expired, or the key would run again while its first
        // answer can still be replayed.
        let answered = match &self.statements.purge_answered {
            Some(purge) => {
                let found: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM information_schema.TABLES \
                     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
                )
                .bind(purge.responses.as_str())
                .fetch_one(&mut **connection.get())
                .await?;
                found > 0
            }
            None => false,
        };
        Ok(Some(MysqlRetentionRunner {
            connection,
            statements: self.statements.clone(),
            answered,
            lease,
        }))
    }

    fn name(&self) -> String {
        self.table.to_string()
    }
}

/// Each batch is one autocommit `DELETE`. Dropped mid-pass, the connection is closed rather
/// than pooled, and the server lets the named lock go with the session.
impl RetentionRunner for MysqlRetentionRunner {
    async fn purge_batch(&mut self, age: Duration, rows: u32) -> Result<u64, StoreError> {
        let connection = &mut **self.connection.get();
        let answered = self.statements.purge_answered.as_ref().filter(|_| self.answered);
        let Some(answered) = answered else {
            let purged = sqlx::query(&self.statements.purge)
                .bind(micros(age))
                .bind(rows)
                .execute(connection)
                .await?;
            return Ok(purged.rows_affected());
        };
        // Picked and deleted in one transaction: the rows picked stay locked until both
        // deletes are done, so no claim slips between.
        let mut transaction = sqlx::Connection::begin(connection).await?;
        let keys: Vec<Vec<u8>> = sqlx::query_scalar(&answered.pick)
            .bind(micros(age))
            .bind(rows)
            .fetch_all(&mut *transaction)
            .await?;
        let mut purged = 0;
        for keys in keys.chunks(KEYS_PER_DELETE) {
            let marks = vec!["?"; keys.len()].join(", ");
            for (head, counted) in [
                (&answered.delete_records, true),
                (&answered.delete_responses, false),
            ] {
                let statement = format!("{head}({marks})");
                let query = keys
                    .iter()
                    .fold(sqlx::query(&statement), |query, key| query.bind(key));
                let deleted = query.execute(&mut *transaction).await?.rows_affected();
                purged += if counted { deleted } else { 0 };
            }
        }
        transaction.commit().await?;
        Ok(purged)
    }

    async fn step_down(mut self) -> Result<(), StoreError> {
        sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&self.lease)
            .execute(&mut **self.connection.get())
            .await?;
        self.connection.keep();
        Ok(())
    }
}

impl std::fmt::Debug for MysqlRetentionRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlRetentionRunner")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}
