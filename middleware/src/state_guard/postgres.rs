use std::fmt;
use std::sync::Arc;

use deadpool_postgres::Pool;

use super::store::StateStore;
use crate::error::Error;
use crate::outcome::Tier;
use crate::postgres::{Checkout, Table, store_error};

/// A [`StateStore`] on PostgreSQL: one row per entity in a table made by
/// [`migrate_state`](crate::postgres::migrate_state) (`entity_id`, `status`, `version`,
/// `updated_at`). Compare-and-set is one conditional `INSERT … ON CONFLICT DO NOTHING` or
/// `UPDATE … WHERE status = $expected`, which also bumps the version.
#[derive(Clone)]
pub struct PgStateStore {
    pool: Pool,
    table: Table,
    statements: Arc<[String; 3]>,
}

impl PgStateStore {
    /// A store on `pool` using the entity state table `table`.
    pub fn new(pool: Pool, table: Table) -> Self {
        let statements = Arc::new([
            format!("SELECT status FROM {table} WHERE entity_id = $1"),
            format!(
                "INSERT INTO {table} (entity_id, status) VALUES ($1, $2) ON CONFLICT (entity_id) DO NOTHING"
            ),
            format!(
                "UPDATE {table} SET status = $3, version = version + 1, updated_at = now()
                 WHERE entity_id = $1 AND status = $2"
            ),
        ]);
        PgStateStore {
            pool,
            table,
            statements,
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
    async fn current(&self, entity: &str) -> Result<Option<String>, Error> {
        Checkout::run(&self.pool, Tier::StateGuard, async |client| {
            let row = client
                .query_opt(&self.statements[0], &[&entity])
                .await
                .map_err(store_error(Tier::StateGuard))?;
            Ok(row.map(|row| row.get(0)))
        })
        .await
    }

    async fn compare_and_set(&self, entity: &str, expected: Option<&str>, next: &str) -> Result<bool, Error> {
        Checkout::run(&self.pool, Tier::StateGuard, async |client| {
            let changed = match expected {
                None => client.execute(&self.statements[1], &[&entity, &next]).await,
                Some(expected) => {
                    client
                        .execute(&self.statements[2], &[&entity, &expected, &next])
                        .await
                }
            }
            .map_err(store_error(Tier::StateGuard))?;
            Ok(changed == 1)
        })
        .await
    }
}
