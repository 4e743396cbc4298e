//! Creating oncely's tables.

use deadpool_postgres::Pool;

use super::{Checkout, Table};
use crate::error::StoreError;

const CONSUMPTION_RECORD: &str = include_str!("migrations/consumption_record.sql");
const ENTITY_STATE: &str = include_str!("migrations/entity_state.sql");
const ENTITY_LOCK: &str = include_str!("migrations/entity_lock.sql");

/// Creates the consumption record table `table` and its indexes, and the table's schema,
/// if they do not exist (the connecting role needs the right to create them).
///
/// Idempotent, and safe when several consumers start at once: the statements run in one
/// transaction under an advisory lock.
pub async fn migrate(pool: &Pool, table: &Table) -> Result<(), StoreError> {
    run_migration(pool, &table.render(CONSUMPTION_RECORD)).await
}

/// Creates the entity state table `table` for [`PgStateStore`](crate::state_guard::PgStateStore),
/// and its schema, if they do not exist: `entity_id TEXT PRIMARY KEY, status TEXT, version BIGINT,
/// updated_at TIMESTAMPTZ`. Idempotent.
pub async fn migrate_state(pool: &Pool, table: &Table) -> Result<(), StoreError> {
    run_migration(pool, &table.render(ENTITY_STATE)).await
}

/// Creates the lock table `table` for [`PgLockStore`](crate::lock::PgLockStore), and its
/// schema, if they do not exist: `entity TEXT PRIMARY KEY, holder TEXT, fencing_token
/// BIGINT, lease_until TIMESTAMPTZ`. Idempotent.
pub async fn migrate_lock(pool: &Pool, table: &Table) -> Result<(), StoreError> {
    run_migration(pool, &table.render(ENTITY_LOCK)).await
}

/// Runs `sql`, a migration script of a crate built on oncely (`oncely-http`'s stored
/// responses), the way oncely runs its own: in one transaction under oncely's migration
/// advisory lock, so that processes starting at once take turns. Make every statement
/// idempotent (`IF NOT EXISTS`).
pub async fn migrate_script(pool: &Pool, sql: &str) -> Result<(), StoreError> {
    run_migration(pool, sql).await
}

async fn run_migration(pool: &Pool, sql: &str) -> Result<(), StoreError> {
    let checkout = Checkout::get(pool).await?;
    // Concurrent `CREATE ... IF NOT EXISTS` can still collide in the catalog; the advisory
    // lock makes migrating consumers take turns.
    let script = format!("BEGIN; SELECT pg_advisory_xact_lock(hashtext('oncely.migrate')); {sql}; COMMIT;");
    checkout.client().batch_execute(&script).await?;
    // Only now: a failure may have left the transaction open.
    checkout.mark_clean();
    Ok(())
}
