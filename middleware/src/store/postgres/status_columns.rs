//! A helper for idempotent state changes in the user's own tables.

use deadpool_postgres::GenericClient;
use deadpool_postgres::tokio_postgres::types::ToSql;

use super::{Ident, Table};
use crate::error::{ConfigError, StoreError};

/// A business table whose rows carry a status and a version, for idempotent state changes
/// inside a handler (typically in the transaction the record tier hands it).
///
/// ```no_run
/// use oncely::postgres::{StatusColumns, Table};
/// use oncely::record::PgTransaction;
/// use oncely::{BusinessKey, HandlerError};
///
/// // A payment callback, in the transactional record's transaction.
/// async fn pay(tx: PgTransaction, order: BusinessKey) -> Result<(), HandlerError> {
///     let orders = StatusColumns::new(Table::new("shop", "orders")?, "id", "status", "version")?;
///     // Pays an order only if it is still unpaid: a retried callback changes nothing (false).
///     orders.transition(&*tx, &order.as_str(), &["UNPAID"], "PAID").await?;
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
    /// The columns `id`, `status` (text) and `version` (bigint) of `table`.
    pub fn new(table: Table, id: &str, status: &str, version: &str) -> Result<Self, ConfigError> {
        Ok(StatusColumns {
            table,
            id: Ident::new(id)?,
            status: Ident::new(status)?,
            version: Ident::new(version)?,
        })
    }

    /// Sets row `id` to status `to` (and bumps its version) only if its status is one of
    /// `from`: `UPDATE … SET status = $to WHERE id = $id AND status = ANY($from)`. True when
    /// the row changed; false when it was in another status (already moved) or is absent.
    pub async fn transition(
        &self,
        client: &impl GenericClient,
        id: &(dyn ToSql + Sync),
        from: &[&str],
        to: &str,
    ) -> Result<bool, StoreError> {
        let sql = self.update_where(&format!("{} = ANY($2)", self.status));
        changed_one(client, &sql, &[id, &from, &to]).await
    }

    /// Sets row `id` to status `to` only if its version is still `expected_version`, and bumps
    /// the version: compare-and-swap for read-modify-write. True when the row changed.
    pub async fn compare_and_set(
        &self,
        client: &impl GenericClient,
        id: &(dyn ToSql + Sync),
        expected_version: i64,
        to: &str,
    ) -> Result<bool, StoreError> {
        let sql = self.update_where(&format!("{} = $2", self.version));
        changed_one(client, &sql, &[id, &expected_version, &to]).await
    }

    /// `UPDATE … SET status = $3, version = version + 1 WHERE id = $1 AND {condition}`.
    fn update_where(&self, condition: &str) -> String {
        format!(
            "UPDATE {table} SET {status} = $3, {version} = {version} + 1 WHERE {id} = $1 AND {condition}",
            table = self.table,
            status = self.status,
            version = self.version,
            id = self.id,
        )
    }
}

async fn changed_one(
    client: &impl GenericClient,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<bool, StoreError> {
    Ok(client.execute(sql, params).await? == 1)
}
