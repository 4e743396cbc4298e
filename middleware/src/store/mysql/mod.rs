//! The MySQL and MariaDB store, on sqlx's driver: the record tier (three-step store,
//! transactional tier on an XA transaction, its half of the batched mode, the reconciler's
//! statements, the operator's view in `admin.rs`), the state guard's store, the lock store, the pre-filter's rebuild, the
//! status helpers, their names and migrations. What it shares with PostgreSQL (how a claim that finds a row answers, the
//! batched lanes) is in `store/sql/`.
//!
//! Every value goes to the server as a bound parameter; the table name cannot be one, so it
//! is validated ([`Table`]) and quoted before it is put into SQL.

pub(crate) mod admin;
pub(crate) mod claims;
pub(crate) mod commit_rows;
pub(crate) mod killer;
pub(crate) mod lock;
#[cfg(feature = "prefilter")]
pub(crate) mod prefilter;
pub(crate) mod record;
pub(crate) mod state;
mod status_columns;
pub(crate) mod transaction;

use std::fmt;

use sqlx::MySqlPool;

use crate::error::{ConfigError, StoreError};
pub use status_columns::StatusColumns;

const CONSUMPTION_RECORD: &str = include_str!("migrations/consumption_record.sql");
const ENTITY_STATE: &str = include_str!("migrations/entity_state.sql");
const ENTITY_LOCK: &str = include_str!("migrations/entity_lock.sql");

/// True when `error` is the server ending a transaction, or a statement, to let another
/// one through: a deadlock victim (1213), a lock wait timeout (1205), and an XA branch
/// rolled back for either (XA_RBDEADLOCK 1614, XA_RBTIMEOUT 1613, XA_RBROLLBACK 1402), and
/// MariaDB's "record has changed since last read" (1020, under `innodb_snapshot_isolation`).
/// Nothing is wrong with the store, and the same work a moment later passes.
pub(crate) fn lost_to_another_transaction(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(error) = error else {
        return false;
    };
    error
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some_and(|error| matches!(error.number(), 1213 | 1205 | 1614 | 1613 | 1402 | 1020))
}

/// A table or column name in the connection's database: 1 to 64 lowercase ASCII letters,
/// digits and underscores, not starting with a digit. Shown back-quoted, ready for SQL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ident(String);

/// A table in the connection's database; see [`Ident`].
pub type Table = Ident;

impl Ident {
    /// Validates `name`; [`ConfigError::InvalidIdentifier`] if it is not a plain name.
    pub fn new(name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        match crate::store::sql::is_plain_name(&name, 64) {
            true => Ok(Ident(name)),
            false => Err(ConfigError::InvalidIdentifier { identifier: name }),
        }
    }

    /// The name, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`", self.0)
    }
}

/// Where oncely-http keeps the stored responses of the record table `records`:
/// `<records>_responses`, in the same database. The record's retention and the operator's
/// `purge` keep a record row while its response there still lives, and remove the two
/// together once it expired: a record row gone before its response would let the key run
/// again. [`ConfigError::InvalidIdentifier`] when the name is longer than 64 bytes.
pub fn responses_table(records: &Table) -> Result<Table, ConfigError> {
    Table::new(format!("{}_responses", records.as_str()))
}

/// Creates the consumption record table `table` in the pool's database if it does not
/// exist: one `CREATE TABLE IF NOT EXISTS` (InnoDB, with its indexes), so it is idempotent
/// and safe when several consumers start at once. For MySQL 8 and MariaDB 10.6+ (tested on
/// MariaDB 10.11). It never alters an existing table.
pub async fn migrate(pool: &MySqlPool, table: &Table) -> Result<(), StoreError> {
    run_migration(pool, CONSUMPTION_RECORD, table).await
}

/// Creates the entity state table `table` for
/// [`MysqlStateStore`](crate::state_guard::MysqlStateStore) if it does not exist:
/// `entity_id VARBINARY(1024) PRIMARY KEY, status VARBINARY(255), version BIGINT,
/// updated_at DATETIME(6)`. Idempotent, like [`migrate`].
pub async fn migrate_state(pool: &MySqlPool, table: &Table) -> Result<(), StoreError> {
    run_migration(pool, ENTITY_STATE, table).await
}

/// Creates the lock table `table` for [`MysqlLockStore`](crate::lock::MysqlLockStore) if it
/// does not exist: `entity VARBINARY(1024) PRIMARY KEY, holder CHAR(32), fencing_token
/// BIGINT, lease_until DATETIME(6)`. Idempotent, like [`migrate`].
pub async fn migrate_lock(pool: &MySqlPool, table: &Table) -> Result<(), StoreError> {
    run_migration(pool, ENTITY_LOCK, table).await
}

async fn run_migration(pool: &MySqlPool, template: &str, table: &Table) -> Result<(), StoreError> {
    let statement = template.replace("{table}", &table.to_string());
    sqlx::raw_sql(&statement).execute(pool).await?;
    Ok(())
}
