//! What the PostgreSQL backends share: validated table names, the migrations, and helpers
//! for idempotent state changes in a handler's own tables.
//!
//! Every value goes to the server as a bound parameter. Schema, table and column names
//! cannot be parameters, so they are validated as plain identifiers ([`Ident`]) and quoted
//! before they are put into SQL.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

pub use deadpool_postgres;
use deadpool_postgres::tokio_postgres::NoTls;
use deadpool_postgres::tokio_postgres::types::ToSql;
use deadpool_postgres::{GenericClient, Object, Pool};

use crate::error::Error;
use crate::outcome::Tier;

/// A plain SQL identifier: 1 to 63 lowercase ASCII letters, digits and underscores, not
/// starting with a digit. Shown double-quoted, ready for SQL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`; [`Error::InvalidIdentifier`] if it is not a plain identifier.
    pub fn new(name: impl Into<String>) -> Result<Self, Error> {
        let name = name.into();
        let plain = (1..=63).contains(&name.len())
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if plain {
            Ok(Ident(name))
        } else {
            Err(Error::InvalidIdentifier { identifier: name })
        }
    }

    /// The name, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0)
    }
}

/// A table in a schema, e.g. `oncely.consumption_record`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Table {
    schema: Ident,
    name: Ident,
}

impl Table {
    /// `schema.name`, both validated with [`Ident::new`].
    pub fn new(schema: &str, name: &str) -> Result<Self, Error> {
        Ok(Table {
            schema: Ident::new(schema)?,
            name: Ident::new(name)?,
        })
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The table's own name.
    pub fn name(&self) -> &Ident {
        &self.name
    }

    fn render(&self, migration: &str) -> String {
        migration
            .replace("{schema}", &self.schema.to_string())
            .replace("{table}", &self.name.to_string())
            .replace(
                "{processing_lease_index}",
                &format!("\"{}_processing_lease\"", self.name.as_str()),
            )
            .replace(
                "{success_updated_index}",
                &format!("\"{}_success_updated\"", self.name.as_str()),
            )
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

const CONSUMPTION_RECORD: &str = include_str!("../migrations/consumption_record.sql");
const ENTITY_STATE: &str = include_str!("../migrations/entity_state.sql");

/// Creates the consumption record table `table` and its indexes if they do not exist.
///
/// Idempotent, and safe when several consumers start at once: the statements run in one
/// transaction under an advisory lock.
pub async fn migrate(pool: &Pool, table: &Table) -> Result<(), Error> {
    run_migration(pool, &table.render(CONSUMPTION_RECORD), Tier::Record).await
}

/// Creates the entity state table `table` for [`PgStateStore`](crate::state_guard::PgStateStore)
/// if it does not exist: `entity_id TEXT PRIMARY KEY, status TEXT, version BIGINT,
/// updated_at TIMESTAMPTZ`. Idempotent.
pub async fn migrate_state(pool: &Pool, table: &Table) -> Result<(), Error> {
    run_migration(pool, &table.render(ENTITY_STATE), Tier::StateGuard).await
}

async fn run_migration(pool: &Pool, sql: &str, tier: Tier) -> Result<(), Error> {
    let checkout = Checkout::get(pool, tier).await?;
    // Concurrent `CREATE ... IF NOT EXISTS` can still collide in the catalog; the advisory
    // lock makes migrating consumers take turns.
    let script = format!("BEGIN; SELECT pg_advisory_xact_lock(hashtext('oncely.migrate')); {sql}; COMMIT;");
    checkout
        .client()
        .batch_execute(&script)
        .await
        .map_err(store_error(tier))?;
    // Only now: a failure may have left the transaction open.
    checkout.mark_clean();
    Ok(())
}

/// A business table whose rows carry a status and a version, for idempotent state changes
/// inside a handler (typically in the transaction the record tier hands it).
///
/// ```no_run
/// # async fn f(tx: &oncely::postgres::deadpool_postgres::Transaction<'_>) -> Result<(), oncely::Error> {
/// use oncely::postgres::{StatusColumns, Table};
/// let orders = StatusColumns::new(Table::new("shop", "orders")?, "id", "status", "version")?;
/// // Pays an order only if it is still unpaid: a retried callback changes nothing.
/// let paid = orders.transition(tx, &"order_123", &["UNPAID"], "PAID").await?;
/// # Ok(()) }
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
    pub fn new(table: Table, id: &str, status: &str, version: &str) -> Result<Self, Error> {
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
    ) -> Result<bool, Error> {
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
    ) -> Result<bool, Error> {
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
) -> Result<bool, Error> {
    let changed = client
        .execute(sql, params)
        .await
        .map_err(|error| Error::store(Tier::Handler, error))?;
    Ok(changed == 1)
}

/// A pooled connection that goes back to the pool only once its user has said the session
/// is clean: no transaction open, no statement still running.
///
/// Dropped without [`mark_clean`](Checkout::mark_clean) — a future dropped by a timeout or
/// a shutdown, a panic, an error that left the transaction's state unknown — the connection
/// is taken out of the pool and closed, which makes the server roll back whatever it had
/// open, and the statement it may still be running is cancelled: the server would otherwise
/// finish it, holding its row and index locks, before it noticed the closed connection. deadpool's default recycling only checks that a connection is not closed, so
/// returning such a connection would let the next user's `BEGIN` run inside the abandoned
/// transaction and its `COMMIT` commit the abandoned writes.
pub(crate) struct Checkout {
    object: Option<Object>,
    clean: AtomicBool,
}

impl Checkout {
    /// Takes a connection from `pool`, reporting a failure as `tier`'s store error.
    pub(crate) async fn get(pool: &Pool, tier: Tier) -> Result<Self, Error> {
        let object = pool.get().await.map_err(store_error(tier))?;
        Ok(Checkout {
            object: Some(object),
            clean: AtomicBool::new(false),
        })
    }

    /// The connection.
    pub(crate) fn client(&self) -> &deadpool_postgres::Client {
        self.object.as_ref().expect("taken only on drop")
    }

    /// Says the session is clean: on drop the connection goes back to the pool.
    pub(crate) fn mark_clean(&self) {
        self.clean.store(true, Ordering::Release);
    }

    /// Runs `run` on the connection and marks it clean once `run` finished, whatever it
    /// answered: for statements outside a transaction, whose failure leaves nothing open.
    pub(crate) async fn run<T>(
        pool: &Pool,
        tier: Tier,
        run: impl AsyncFnOnce(&deadpool_postgres::Client) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let checkout = Checkout::get(pool, tier).await?;
        let answer = run(checkout.client()).await;
        checkout.mark_clean();
        answer
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(object) = self.object.take()
            && !self.clean.load(Ordering::Acquire)
        {
            let cancel = object.cancel_token();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    // Over TLS-only servers this fails; closing the connection still ends the
                    // transaction once the statement is done.
                    let _ = cancel.cancel_query(NoTls).await;
                });
            }
            // Detached from the pool, the client is dropped here and its connection closed.
            drop(Object::take(object));
        }
    }
}

pub(crate) fn store_error<E: std::error::Error + Send + Sync + 'static>(tier: Tier) -> impl Fn(E) -> Error {
    move |error| Error::store(tier, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated_and_quoted() {
        assert_eq!(
            Ident::new("consumption_record").unwrap().to_string(),
            "\"consumption_record\""
        );
        for bad in [
            "",
            "1abc",
            "Orders",
            "a-b",
            "a\"b",
            "x; DROP TABLE y",
            &"a".repeat(64),
        ] {
            assert!(Ident::new(bad).unwrap_err().is_config(), "{bad}");
        }
        let table = Table::new("shop", "orders").unwrap();
        assert_eq!(table.to_string(), "\"shop\".\"orders\"");
    }
}
