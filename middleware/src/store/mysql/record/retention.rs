//! The retention service's lease and batches on MySQL and MariaDB: a named lock
//! (`GET_LOCK`) per record table, held by the connection that purges.

use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use super::MysqlRecordStore;
use crate::error::StoreError;
use crate::record::{RetentionRunner, RetentionStore};
use crate::store::mysql::transaction::Unpooled;
use crate::store::sql::micros;

/// Holds the table's purge lease on its connection until it steps down.
pub struct MysqlRetentionRunner {
    connection: Unpooled,
    purge: String,
    lease: String,
}

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
        Ok(Some(MysqlRetentionRunner {
            connection,
            purge: self.statements.purge.clone(),
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
        let purged = sqlx::query(&self.purge)
            .bind(micros(age))
            .bind(rows)
            .execute(&mut **self.connection.get())
            .await?;
        Ok(purged.rows_affected())
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
