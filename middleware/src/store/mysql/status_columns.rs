//! A helper for idempotent state changes in the user's own MySQL tables.

use sqlx::{Encode, Executor, MySql, Type};

use super::{Ident, Table};
use crate::error::{ConfigError, StoreError};

/// A business table whose rows carry a status and a version, for idempotent state changes
/// inside a handler (typically in the transaction the record tier hands it) — the MySQL twin
/// of [`postgres::StatusColumns`](crate::postgres::StatusColumns).
///
/// ```no_run
/// use oncely::mysql::{StatusColumns, Table};
/// use oncely::record::MysqlTransaction;
/// use oncely::{BusinessKey, HandlerError};
///
/// // A payment callback, in the transactional record's transaction.
/// async fn pay(tx: MysqlTransaction, order: BusinessKey) -> Result<(), HandlerError> {
///     let orders = StatusColumns::new(Table::new("orders")?, "id", "status", "version")?;
///     // Pays an order only if it is still unpaid: a retried callback changes nothing (false).
///     orders.transition(&tx, order.as_str(), &["UNPAID"], "PAID").await?;
///     Ok(())
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusColumns {
    table: Table,
    id: Ident,
    status: Ident,
    version: Ident,
}

impl StatusColumns {
    /// The columns `id`, `status` (a string type) and `version` (an integer) of `table`.
    pub fn new(table: Table, id: &str, status: &str, version: &str) -> Result<Self, ConfigError> {
        Ok(StatusColumns {
            table,
            id: Ident::new(id)?,
            status: Ident::new(status)?,
            version: Ident::new(version)?,
        })
    }

    /// Sets row `id` to status `to` (and bumps its version) only if its status is one of
    /// `from`: `UPDATE … SET status = ?, version = version + 1 WHERE id = ? AND status IN (…)`.
    /// True when the row changed; false when it was in another status (already moved) or is
    /// absent. An empty `from` changes nothing.
    pub async fn transition<'e, I>(
        &self,
        executor: impl Executor<'e, Database = MySql>,
        id: I,
        from: &[&str],
        to: &str,
    ) -> Result<bool, StoreError>
    where
        I: for<'q> Encode<'q, MySql> + Type<MySql> + Send,
    {
        if from.is_empty() {
            return Ok(false);
        }
        let marks = vec!["?"; from.len()].join(", ");
        let sql = self.update_where(&format!("{} IN ({marks})", self.status));
        let mut update = sqlx::query(&sql).bind(to).bind(id);
        for status in from {
            update = update.bind(*status);
        }
        Ok(update.execute(executor).await?.rows_affected() == 1)
    }

    /// Sets row `id` to status `to` only if its version is still `expected_version`, and bumps
    /// the version: compare-and-swap for read-modify-write. True when the row changed.
    pub async fn compare_and_set<'e, I>(
        &self,
        executor: impl Executor<'e, Database = MySql>,
        id: I,
        expected_version: i64,
        to: &str,
    ) -> Result<bool, StoreError>
    where
        I: for<'q> Encode<'q, MySql> + Type<MySql> + Send,
    {
        let sql = self.update_where(&format!("{} = ?", self.version));
        let update = sqlx::query(&sql).bind(to).bind(id).bind(expected_version);
        Ok(update.execute(executor).await?.rows_affected() == 1)
    }

    /// `UPDATE … SET status = ?, version = version + 1 WHERE id = ? AND {condition}`. MySQL
    /// applies the assignments left to right; the condition reads the row as it was.
    fn update_where(&self, condition: &str) -> String {
        format!(
            "UPDATE {table} SET {status} = ?, {version} = {version} + 1 WHERE {id} = ? AND {condition}",
            table = self.table,
            status = self.status,
            version = self.version,
            id = self.id,
        )
    }
}
