//! The state guard's store on MySQL and MariaDB.

use std::fmt;
use std::sync::Arc;

use sqlx::MySqlPool;

use super::Table;
use crate::error::StoreError;
use crate::state_guard::StateStore;

/// The entity state table's statements.
#[derive(Debug)]
struct StateStatements {
    /// `?` entity: its status.
    current: String,
    /// `?` entity, status: the first state of an entity that has none.
    insert: String,
    /// `?` next status, entity, expected status; bumps the version.
    update: String,
}

/// A [`StateStore`] on MySQL or MariaDB: one row per entity in a table made by
/// [`migrate_state`](crate::mysql::migrate_state). Compare-and-set is one `INSERT` (a
/// duplicate entity answers false) or `UPDATE … WHERE status = expected`, which also bumps
/// the version; each in autocommit.
#[derive(Clone)]
pub struct MysqlStateStore {
    pool: MySqlPool,
    table: Table,
    statements: Arc<StateStatements>,
}

impl MysqlStateStore {
    /// A store on `pool` using the entity state table `table`.
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        MysqlStateStore {
            statements: Arc::new(StateStatements {
                current: format!("SELECT status FROM {table} WHERE entity_id = ?"),
                insert: format!(
                    "INSERT INTO {table} (entity_id, status, updated_at) VALUES (?, ?, UTC_TIMESTAMP(6))"
                ),
                update: format!(
                    "UPDATE {table} SET status = ?, version = version + 1, updated_at = UTC_TIMESTAMP(6)
                     WHERE entity_id = ? AND status = ?"
                ),
            }),
            pool,
            table,
        }
    }
}

impl fmt::Debug for MysqlStateStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlStateStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl StateStore for MysqlStateStore {
    async fn current(&self, entity: &str) -> Result<Option<String>, StoreError> {
        let status: Option<Vec<u8>> = sqlx::query_scalar(&self.statements.current)
            .bind(entity)
            .fetch_optional(&self.pool)
            .await?;
        status
            .map(|status| {
                String::from_utf8(status).map_err(|_| StoreError::malformed("a state that is not UTF-8"))
            })
            .transpose()
    }

    async fn compare_and_set(&self, entity: &str, from: Option<&str>, to: &str) -> Result<bool, StoreError> {
        let Some(from) = from else {
            let inserted = sqlx::query(&self.statements.insert)
                .bind(entity)
                .bind(to)
                .execute(&self.pool)
                .await;
            return match inserted {
                Ok(_) => Ok(true),
                Err(sqlx::Error::Database(error)) if error.is_unique_violation() => Ok(false),
                Err(error) => Err(error.into()),
            };
        };
        let updated = sqlx::query(&self.statements.update)
            .bind(to)
            .bind(entity)
            .bind(from)
            .execute(&self.pool)
            .await?;
        Ok(updated.rows_affected() == 1)
    }
}
