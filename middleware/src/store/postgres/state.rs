//! The state guard's store on PostgreSQL, and every statement on the entity state table.

use std::fmt;
use std::sync::Arc;

use deadpool_postgres::Pool;

use super::{Checkout, Table};
use crate::error::StoreError;
use crate::state_guard::StateStore;

/// A [`StateStore`] on PostgreSQL: one row per entity in a table made by
/// [`migrate_state`](crate::postgres::migrate_state) (`entity_id`, `status`, `version`,
/// `updated_at`). Compare-and-set is one conditional `INSERT … ON CONFLICT DO NOTHING` or
/// `UPDATE … WHERE status = $expected`, which also bumps the version.
#[derive(Clone)]
pub struct PgStateStore {
    pool: Pool,
    table: Table,
    statements: Arc<StateStatements>,
}

impl PgStateStore {
    /// A store on `pool` using the entity state table `table`.
    pub fn new(pool: Pool, table: Table) -> Self {
        PgStateStore {
            statements: StateStatements::new(&table),
            pool,
            table,
        }
    }
}

impl fmt::Debug for PgStateStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStateStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl StateStore for PgStateStore {
    async fn current(&self, entity: &str) -> Result<Option<String>, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let row = client.query_opt(&self.statements.current, &[&entity]).await?;
            Ok(row.map(|row| row.get(0)))
        })
        .await
    }

    async fn compare_and_set(&self, entity: &str, from: Option<&str>, to: &str) -> Result<bool, StoreError> {
        Checkout::run(&self.pool, async |client| {
            let changed = match from {
                None => client.execute(&self.statements.insert, &[&entity, &to]).await?,
                Some(from) => {
                    client
                        .execute(&self.statements.update, &[&entity, &from, &to])
                        .await?
                }
            };
            Ok(changed == 1)
        })
        .await
    }
}

/// The entity state table's statements, by what they do.
#[derive(Debug)]
pub(crate) struct StateStatements {
    /// `$1` entity: its status.
    pub(crate) current: String,
    /// `$1` entity, `$2` status: the first state of an entity that has none.
    pub(crate) insert: String,
    /// `$1` entity, `$2` expected status, `$3` next status; bumps the version.
    pub(crate) update: String,
}

impl StateStatements {
    pub(crate) fn new(table: &Table) -> Arc<Self> {
        Arc::new(StateStatements {
            current: format!("SELECT status FROM {table} WHERE entity_id = $1"),
            insert: format!(
                "INSERT INTO {table} (entity_id, status) VALUES ($1, $2) ON CONFLICT (entity_id) DO NOTHING"
            ),
            update: format!(
                "UPDATE {table} SET status = $3, version = version + 1, updated_at = now()
                 WHERE entity_id = $1 AND status = $2"
            ),
        })
    }
}
