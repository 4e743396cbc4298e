//! PostgreSQL for the user: the tables oncely creates, validated table names, and a helper
//! for idempotent state changes in the user's own tables. The backends themselves are in
//! [`record`](crate::record) and [`state_guard`](crate::state_guard).

pub use deadpool_postgres;

pub use crate::store::postgres::{
    Ident, StatusColumns, Table, migrate, migrate_lock, migrate_script, migrate_state, responses_table,
};
