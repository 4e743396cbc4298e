//! MySQL and MariaDB: table and column names, migrations, [`StatusColumns`] for the user's
//! own tables, and the sqlx version oncely's MySQL backends take their pools from
//! ([`MysqlTransactionalLayer`](crate::record::MysqlTransactionalLayer),
//! [`MysqlRecordStore`](crate::record::MysqlRecordStore),
//! [`MysqlStateStore`](crate::state_guard::MysqlStateStore),
//! [`MysqlLockStore`](crate::lock::MysqlLockStore)).
//!
//! Tested on MariaDB 10.11; written for MySQL 8.0.16+ as its documentation describes. See
//! the README's "MySQL and MariaDB" for what differs from PostgreSQL.

pub use sqlx;

pub use crate::store::mysql::{
    Ident, StatusColumns, Table, migrate, migrate_lock, migrate_state, responses_table,
};
