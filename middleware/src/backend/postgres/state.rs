//! Every statement on the entity state table, rendered once per table.

use std::sync::Arc;

use super::Table;

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
