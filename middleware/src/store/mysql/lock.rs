//! The lock tier's store on MySQL and MariaDB: a lease table, one row per entity ever locked.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::MySqlPool;

use super::Table;
use super::claims::MAX_KEY_BYTES;
use crate::error::StoreError;
use crate::lock::LockStore;
use crate::store::sql::micros;
use crate::token::Token;

/// The lock table's statements, by what they do.
#[derive(Debug)]
struct LockStatements {
    /// Takes an entity's existing row if it is free or its lease ran out, handing the next
    /// fencing token back in the statement's own answer (`LAST_INSERT_ID(…)`). `?` holder,
    /// lease (µs), entity.
    take: String,
    /// A new entity's row, its first token the server's clock in microseconds. `?` entity,
    /// holder, lease (µs).
    insert: String,
    /// Extends the holder's lease, if it still runs. `?` lease (µs), entity, holder.
    renew: String,
    /// Frees the holder's lock, if its lease still runs; the row and its counter stay. `?`
    /// entity, holder.
    release: String,
}

/// A [`LockStore`] on MySQL 8 or MariaDB, for shops without Redis: one row per entity in a
/// table made by [`migrate_lock`](crate::mysql::migrate_lock) holding the holder's token,
/// its lease (on the server's clock, in UTC) and the entity's last fencing token.
///
/// The same semantics as [`RedisLockStore`](crate::lock::RedisLockStore) and
/// [`PgLockStore`](crate::lock::PgLockStore): one holder at a time, a lease that ends the
/// hold unless renewed, fencing tokens that only grow per entity (rows are never deleted;
/// a new entity's first token is the server's clock in microseconds). Each statement runs
/// in autocommit, so a row lock is held for one statement, never for the lease — unlike
/// `GET_LOCK`, whose hold ends with its connection rather than with a lease, and which
/// hands out no fencing token.
///
/// Acquiring an entity locked before is one `UPDATE`; a new entity costs an `INSERT` after
/// it. Two acquirers of a new entity at once: one inserts, the other is told the lock is
/// taken. Entities up to [`MYSQL_MAX_KEY_BYTES`](crate::record::MYSQL_MAX_KEY_BYTES) bytes;
/// a longer one is refused with a [`StoreError`].
#[derive(Clone)]
pub struct MysqlLockStore {
    pool: MySqlPool,
    table: Table,
    statements: Arc<LockStatements>,
}

impl MysqlLockStore {
    /// A store on `pool` using the lock table `table`.
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        let lease = "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND";
        let statements = LockStatements {
            take: format!(
                "UPDATE {table}
                 SET holder = ?, fencing_token = LAST_INSERT_ID(fencing_token + 1), lease_until = {lease}
                 WHERE entity = ? AND (holder IS NULL OR lease_until <= UTC_TIMESTAMP(6))"
            ),
            insert: format!(
                "INSERT INTO {table} (entity, holder, fencing_token, lease_until)
                 VALUES (?, ?, LAST_INSERT_ID(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))), {lease})"
            ),
            renew: format!(
                "UPDATE {table} SET lease_until = {lease}
                 WHERE entity = ? AND holder = ? AND lease_until > UTC_TIMESTAMP(6)"
            ),
            release: format!(
                "UPDATE {table} SET holder = NULL, lease_until = NULL
                 WHERE entity = ? AND holder = ? AND lease_until > UTC_TIMESTAMP(6)"
            ),
        };
        MysqlLockStore {
            pool,
            table,
            statements: Arc::new(statements),
        }
    }
}

impl fmt::Debug for MysqlLockStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlLockStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl LockStore for MysqlLockStore {
    async fn acquire(&self, entity: &str, token: Token, lease: Duration) -> Result<Option<u64>, StoreError> {
        if entity.len() > MAX_KEY_BYTES {
            return Err(StoreError::new(format!(
                "an entity of {} bytes: the MySQL lock keeps entities up to {MAX_KEY_BYTES}",
                entity.len()
            )));
        }
        let (token, lease) = (token.to_string(), micros(lease));
        let mut connection = self.pool.acquire().await?;
        let taken = sqlx::query(&self.statements.take)
            .bind(&token)
            .bind(lease)
            .bind(entity)
            .execute(&mut *connection)
            .await?;
        if taken.rows_affected() == 1 {
            return Ok(Some(taken.last_insert_id()));
        }
        let inserted = sqlx::query(&self.statements.insert)
            .bind(entity)
            .bind(&token)
            .bind(lease)
            .execute(&mut *connection)
            .await;
        match inserted {
            Ok(inserted) => Ok(Some(inserted.last_insert_id())),
            // The row exists: held by another (or freed just now, which looks the same as
            // arriving a moment earlier).
            Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    async fn renew(&self, entity: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let renewed = sqlx::query(&self.statements.renew)
            .bind(micros(lease))
            .bind(entity)
            .bind(token.to_string())
            .execute(&self.pool)
            .await?;
        Ok(renewed.rows_affected() == 1)
    }

    async fn release(&self, entity: &str, token: Token) -> Result<bool, StoreError> {
        let released = sqlx::query(&self.statements.release)
            .bind(entity)
            .bind(token.to_string())
            .execute(&self.pool)
            .await?;
        Ok(released.rows_affected() == 1)
    }
}
