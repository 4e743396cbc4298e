//! The lock tier's store on PostgreSQL: a lease table, one row per entity ever locked.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use super::{Checkout, Table};
use crate::error::StoreError;
use crate::lock::LockStore;
use crate::store::sql::micros;
use crate::token::Token;

/// The lock table's statements, by what they do. `$1` entity, `$2` holder token, `$3` lease
/// in microseconds.
#[derive(Debug)]
struct LockStatements {
    /// Takes the lock if it is free or its lease ran out, and hands out the next fencing
    /// token, in one statement: concurrent ones on one entity queue on its row (or on the
    /// unique index, for a new entity) and see each other's holder.
    acquire: String,
    /// Extends the holder's lease, if it still runs.
    renew: String,
    /// Frees the holder's lock, if its lease still runs; the row and its counter stay.
    release: String,
}

/// A [`LockStore`] on PostgreSQL, for shops without Redis: one row per entity in a table
/// made by [`migrate_lock`](crate::postgres::migrate_lock) holding the holder's token, its
/// lease (on the server's clock) and the entity's last fencing token.
///
/// The same semantics as [`RedisLockStore`](crate::lock::RedisLockStore): one holder at a
/// time, a lease that ends the hold unless renewed, fencing tokens that only grow per
/// entity. Rows are never deleted (so a counter never starts again); a new entity's first
/// token is the server's clock in microseconds, above the tokens a Redis lock handed out
/// before a switch. Each call is one statement in autocommit: a row lock held for that
/// statement, not for the lease — so, unlike a session advisory lock, a hold survives
/// neither more nor less than its lease, whatever happens to the connection.
///
/// Costs one round trip per acquire, renew and release (statements prepared once per
/// connection), against the record's database. Runs in the session's default isolation:
/// under a database default of REPEATABLE READ or SERIALIZABLE, an acquire that races
/// another fails with a serialization error (a store error, answered with a retry) instead
/// of answering "held".
#[derive(Clone)]
pub struct PgLockStore {
    pool: Pool,
    table: Table,
    statements: Arc<LockStatements>,
}

impl PgLockStore {
    /// A store on `pool` using the lock table `table`.
    pub fn new(pool: Pool, table: Table) -> Self {
        let lease = "now() + $3::bigint * interval '1 microsecond'";
        let statements = LockStatements {
            acquire: format!(
                "INSERT INTO {table} AS l (entity, holder, fencing_token, lease_until)
                 VALUES ($1, $2, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint, {lease})
                 ON CONFLICT (entity) DO UPDATE
                 SET holder = EXCLUDED.holder, fencing_token = l.fencing_token + 1,
                     lease_until = EXCLUDED.lease_until
                 WHERE l.holder IS NULL OR l.lease_until <= now()
                 RETURNING fencing_token"
            ),
            renew: format!(
                "UPDATE {table} SET lease_until = {lease}
                 WHERE entity = $1 AND holder = $2 AND lease_until > now()"
            ),
            release: format!(
                "UPDATE {table} SET holder = NULL, lease_until = NULL
                 WHERE entity = $1 AND holder = $2 AND lease_until > now()"
            ),
        };
        PgLockStore {
            pool,
            table,
            statements: Arc::new(statements),
        }
    }

    /// Runs `statement` for `entity` and `token` (and `lease`, if the statement takes one);
    /// true when it changed the row.
    async fn change(
        &self,
        statement: &str,
        entity: &str,
        token: Token,
        lease: Option<Duration>,
    ) -> Result<bool, StoreError> {
        let token = token.to_string();
        Checkout::run(&self.pool, async |client| {
            let statement = client.prepare_cached(statement).await?;
            let changed = match lease {
                Some(lease) => {
                    client
                        .execute(&statement, &[&entity, &token, &micros(lease)])
                        .await?
                }
                None => client.execute(&statement, &[&entity, &token]).await?,
            };
            Ok(changed == 1)
        })
        .await
    }
}

impl fmt::Debug for PgLockStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLockStore")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl LockStore for PgLockStore {
    async fn acquire(&self, entity: &str, token: Token, lease: Duration) -> Result<Option<u64>, StoreError> {
        let token = token.to_string();
        let fence: Option<i64> = Checkout::run(&self.pool, async |client| {
            let acquire = client.prepare_cached(&self.statements.acquire).await?;
            let row = client
                .query_opt(&acquire, &[&entity, &token, &micros(lease)])
                .await?;
            Ok(row.map(|row| row.get(0)))
        })
        .await?;
        Ok(fence.map(|fence| u64::try_from(fence).unwrap_or(0)))
    }

    async fn renew(&self, entity: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        self.change(&self.statements.renew, entity, token, Some(lease))
            .await
    }

    async fn release(&self, entity: &str, token: Token) -> Result<bool, StoreError> {
        self.change(&self.statements.release, entity, token, None).await
    }
}
