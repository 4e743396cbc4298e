//! MySQL and MariaDB: table names and migrations, and the sqlx version oncely's MySQL
//! backends take their pools from ([`MysqlRecordStore`](crate::record::MysqlRecordStore),
//! [`MysqlStateStore`](crate::state_guard::MysqlStateStore)).
//!
//! Tested on MariaDB 10.11; written for MySQL 8.0.16+ as its documentation describes. See
//! the README's "MySQL and MariaDB" for what differs from PostgreSQL.

pub use sqlx;

pub use crate::store::mysql::{Table, migrate, migrate_lock, migrate_state};
