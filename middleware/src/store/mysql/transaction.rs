//! The transactional record's transaction on MySQL: an XA transaction on one pooled
//! connection, shared by the tier and the handler's [`MysqlTransaction`] handle.
//!
//! Why XA: PostgreSQL lets the tier prove at commit that the transaction committing is the
//! one that claimed (a deferred trigger, `txid_current()`). MySQL has neither, and there a
//! handler's `COMMIT`, `ROLLBACK`, `BEGIN`, DDL or `LOCK TABLES` would end the transaction
//! silently (an implicit commit). Inside an XA transaction the server refuses every one of
//! them (`XAER_RMFAIL`), so only the tier's `XA END …; XA COMMIT … ONE PHASE` can end it; an
//! XA transaction that was never prepared is rolled back when its connection closes, as a
//! plain one is. One-phase XA commits like a plain transaction: no prepare, no extra log.

use std::fmt;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use sqlx::mysql::{MySqlQueryResult, MySqlRow, MySqlStatement, MySqlTypeInfo};
use sqlx::pool::PoolConnection;
use sqlx::{Describe, Either, Execute, Executor, MySql, MySqlPool, Row};

use super::claims::{Statements, claim};
use super::lost_to_another_transaction;
use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::outcome::{Outcome, RetryReason};
use crate::record::{Begin, RecordStatus};
use crate::store::sql::ClaimRequest;

/// One claim's transaction: the connection (until the tier ends the transaction), the XA
/// id, and the first failure of a statement the handler ran through its handle.
pub(crate) struct OpenTransaction {
    /// `None` once the tier has taken it to end the transaction: a handle kept past the
    /// answer then has nothing to run on.
    connection: tokio::sync::Mutex<Option<PoolConnection<MySql>>>,
    /// The XA transaction's id: `oncely-` and 32 random hex digits, quoted into SQL.
    xid: String,
    /// The server's id of the connection (`CONNECTION_ID()`), to kill what it runs when the
    /// transaction is abandoned.
    connection_id: u64,
    /// What `KILL` runs on.
    pool: MySqlPool,
    /// The first statement of the handler's that failed.
    failure: std::sync::Mutex<Option<String>>,
}

impl OpenTransaction {
    /// Takes a connection from `pool` and starts an XA transaction on it, in one round trip.
    /// The transaction runs at the session's isolation level (the server's default,
    /// REPEATABLE READ, unless the pool sets another): the tier's claim locks what it reads,
    /// so it needs none above READ COMMITTED, and the handler's reads keep the level its
    /// author expects.
    pub(crate) async fn start(pool: &MySqlPool) -> Result<Self, StoreError> {
        let mut connection = pool.acquire().await?;
        let xid = format!("oncely-{}", crate::Token::random());
        // `Executor::fetch_all`, not `RawSql::fetch_all`: the latter's future is not `Send` for
        // every lifetime, which the tier's trait methods need. Text protocol: XA statements
        // cannot be prepared.
        let start = format!("XA START '{xid}'; SELECT CAST(CONNECTION_ID() AS UNSIGNED)");
        let started = connection.fetch_all(sqlx::raw_sql(&start)).await;
        let connection_id = started
            .map_err(StoreError::new)
            .and_then(|rows| match rows.as_slice() {
                [row] => row.try_get::<u64, _>(0).map_err(StoreError::new),
                _ => Err(StoreError::malformed("XA START answered no connection id")),
            });
        let connection_id = match connection_id {
            Ok(id) => id,
            Err(error) => {
                // Closed, not pooled: the XA transaction may have started.
                connection.close_on_drop();
                return Err(error);
            }
        };
        Ok(OpenTransaction {
            connection: tokio::sync::Mutex::new(Some(connection)),
            xid,
            connection_id,
            pool: pool.clone(),
            failure: std::sync::Mutex::new(None),
        })
    }

    /// Claims `request`'s key as `SUCCESS`, inside the transaction.
    pub(crate) async fn claim(
        &self,
        statements: &Statements,
        request: &ClaimRequest,
    ) -> Result<Begin, StoreError> {
        let mut slot = self.connection.lock().await;
        let connection = slot.as_mut().ok_or_else(|| StoreError::new(ended()))?;
        claim(connection, statements, request, RecordStatus::Success).await
    }

    /// Commits: `Ok` only when the server said it committed. A statement of the handler's
    /// that failed — MySQL undoes only that statement and carries on, unlike PostgreSQL,
    /// where it aborts the transaction — makes the tier roll back instead: the handler's
    /// other writes would otherwise commit with the record although one of its statements
    /// did not apply.
    pub(crate) async fn commit(&self) -> Result<(), Outcome> {
        let Some(mut connection) = self.connection.lock().await.take() else {
            return Err(store_lost("the transaction's connection was already ended"));
        };
        if let Some(failure) = self.failure() {
            end(connection, &self.rollback()).await;
            return Err(Outcome::retry_later(
                RetryReason::HandlerFailed,
                format!(
                    "the record was not committed: a statement of the handler failed, although it \
                     answered success: {failure}"
                ),
                None,
            ));
        }
        let xid = &self.xid;
        let commit = format!("XA END '{xid}'; XA COMMIT '{xid}' ONE PHASE");
        match connection.execute(sqlx::raw_sql(&commit)).await {
            Ok(_) => Ok(()),
            Err(error) => {
                // Whatever state the branch is in now, the connection is not reused.
                connection.close_on_drop();
                Err(refused_commit(error))
            }
        }
    }

    /// Rolls back; the connection goes back to the pool only if that worked.
    pub(crate) async fn roll_back(&self) {
        if let Some(connection) = self.connection.lock().await.take() {
            end(connection, &self.rollback()).await;
        }
    }

    fn rollback(&self) -> String {
        format!("XA END '{xid}'; XA ROLLBACK '{xid}'", xid = self.xid)
    }

    /// The first failure the handler's statements met, if any.
    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .map(|failure| failure.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// Keeps the first failure of the handler's statements.
    fn note(&self, error: &sqlx::Error) {
        let mut failure = self
            .failure
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        failure.get_or_insert_with(|| error.to_string());
    }
}

/// Never pooled unended: an `OpenTransaction` dropped with its connection (a `tower` timeout
/// dropped the stack's future, a tier behind panicked) kills the connection on the server,
/// which rolls the transaction back at once, even mid-statement — a closed socket alone is
/// noticed only when the running statement ends, which could hold its locks for the lock
/// wait timeout.
impl Drop for OpenTransaction {
    fn drop(&mut self) {
        let Some(mut connection) = self.connection.get_mut().take() else {
            return;
        };
        connection.close_on_drop();
        let (pool, id) = (self.pool.clone(), self.connection_id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                // Fails harmlessly when the connection has already gone.
                let _ = pool.execute(sqlx::raw_sql(&format!("KILL {id}"))).await;
            });
        }
    }
}

/// Ends the transaction with `statement`; the connection goes back to the pool only if that
/// worked.
async fn end(mut connection: PoolConnection<MySql>, statement: &str) {
    if let Err(error) = connection.execute(sqlx::raw_sql(statement)).await {
        tracing::warn!(%error, statement, "could not end the record transaction; closing the connection");
        connection.close_on_drop();
    }
}

/// The outcome of a commit the server refused, or whose answer never came.
fn refused_commit(error: sqlx::Error) -> Outcome {
    let sqlx::Error::Database(_) = &error else {
        // The connection failed: the commit may have happened; the redelivery finds out
        // from the record.
        return store_lost(format!("the commit's answer was lost: {error}"));
    };
    // Another transaction won; trying again may pass.
    let reason = match lost_to_another_transaction(&error) {
        true => RetryReason::Conflict(crate::Tier::Record),
        false => RetryReason::StoreUnavailable(crate::Tier::Record),
    };
    Outcome::retry_later(
        reason,
        format!("the commit was refused, nothing was committed: {error}"),
        None,
    )
}

fn store_lost(detail: impl Into<String>) -> Outcome {
    Outcome::retry_later(RetryReason::StoreUnavailable(crate::Tier::Record), detail, None)
}

/// What a statement through a handle finds once the tier has ended the transaction.
fn ended() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        "the record's transaction has ended: a MysqlTransaction cannot be used after the handler answered",
    ))
}

/// The open transaction of the delivery being handled: the argument a typed handler built by
/// [`MysqlTransactionalLayer::handler`](crate::record::MysqlTransactionalLayer::handler)
/// takes to write its effect, on MySQL or MariaDB.
///
/// `&MysqlTransaction` is a sqlx [`Executor`]: `sqlx::query(..).bind(..).execute(&tx)`,
/// `.fetch_one(&tx)`, `query_as`, and anything else taking an executor runs inside the
/// transaction that also holds the key's record, and commits only if the stack answers
/// processed. Statements run one at a time (the handle holds one connection); the rows of a
/// query are read in full before they are handed over.
///
/// What differs from a plain sqlx transaction, and why:
/// - **A failed statement fails the delivery.** MySQL undoes only the failed statement and
///   carries on; the tier rolls back the whole transaction instead and answers
///   [`RetryLater`](crate::Outcome::RetryLater) with [`RetryReason::HandlerFailed`], even if
///   the handler ignored the error and returned `Ok` — as on PostgreSQL, where the failed
///   statement aborts the transaction. For a write that may find its row already there,
///   use `INSERT IGNORE` or `ON DUPLICATE KEY UPDATE` and read the rows affected.
/// - **It cannot be ended by the handler.** It is an XA transaction: `COMMIT`, `ROLLBACK`,
///   `START TRANSACTION`, DDL and `LOCK TABLES` fail inside it (`XAER_RMFAIL`, error 1399),
///   which fails the delivery as above, instead of committing part of the effect with the
///   record or writing after the record in autocommit.
/// - **It is gone once the handler answered.** A clone kept past the answer (handed to a
///   spawned task, say) makes the tier roll back and answer `RetryLater`; its later
///   statements fail.
///
/// ```no_run
/// use oncely::{BusinessKey, HandlerError};
/// use oncely::record::MysqlTransaction;
///
/// async fn deduct_stock(tx: MysqlTransaction, order: BusinessKey) -> Result<(), HandlerError> {
///     sqlx::query("UPDATE stock SET quantity = quantity - 1 WHERE sku = ?")
///         .bind("sku-1")
///         .execute(&tx)
///         .await?;
///     sqlx::query("INSERT INTO stock_moves (order_id) VALUES (?)")
///         .bind(order.as_str())
///         .execute(&tx)
///         .await?;
///     Ok(())
/// }
/// # use oncely::mysql::sqlx;
/// # fn stack(pool: sqlx::MySqlPool, table: oncely::mysql::Table) {
/// let service = oncely::record::MysqlTransactionalLayer::new(pool, table).handler(deduct_stock);
/// # }
/// ```
///
/// An untyped handler ([`handler_fn`](crate::handler_fn)) behind the layer finds it in the
/// envelope's [extensions](crate::Envelope::extensions).
#[derive(Clone)]
pub struct MysqlTransaction(pub(crate) Arc<OpenTransaction>);

impl fmt::Debug for MysqlTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlTransaction")
            .field("xid", &self.0.xid)
            .finish_non_exhaustive()
    }
}

/// Only a handler built by
/// [`MysqlTransactionalLayer::handler`](crate::record::MysqlTransactionalLayer::handler)
/// takes the transaction: that layer wraps it directly, so the transaction is always there.
/// Should it be missing all the same, the delivery is retried, never run outside a
/// transaction.
impl crate::handler::Argument<crate::handler::InTransaction> for MysqlTransaction {
    fn take(envelope: &Envelope) -> Result<Self, Outcome> {
        envelope
            .extensions()
            .get::<MysqlTransaction>()
            .cloned()
            .ok_or_else(|| {
                let detail = "no transaction: the handler is not behind MysqlTransactionalLayer";
                Outcome::retry_later(RetryReason::HandlerFailed, detail, None)
            })
    }
}

impl MysqlTransaction {
    /// Keeps the failure of a statement run through the handle, if it failed, for the commit
    /// to see.
    fn noted<T>(&self, answer: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        if let Err(error) = &answer {
            self.0.note(error);
        }
        answer
    }
}

impl<'c> Executor<'c> for &'c MysqlTransaction {
    type Database = MySql;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<MySqlQueryResult, MySqlRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, MySql>,
    {
        let answers = async move {
            let mut slot = self.0.connection.lock().await;
            let answers: Result<Vec<_>, sqlx::Error> = match slot.as_mut() {
                // The first error ends the stream; it is the answer to note.
                Some(connection) => connection.fetch_many(query).try_collect().await,
                None => Err(ended()),
            };
            drop(slot);
            let answers = match self.noted(answers) {
                Ok(answers) => answers.into_iter().map(Ok).collect(),
                Err(error) => vec![Err(error)],
            };
            futures_util::stream::iter(answers)
        };
        futures_util::stream::once(answers).flatten().boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<MySqlRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, MySql>,
    {
        Box::pin(async move {
            let mut slot = self.0.connection.lock().await;
            let answer = match slot.as_mut() {
                Some(connection) => connection.fetch_optional(query).await,
                None => Err(ended()),
            };
            self.noted(answer)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [MySqlTypeInfo],
    ) -> BoxFuture<'e, Result<MySqlStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        Box::pin(async move {
            let mut slot = self.0.connection.lock().await;
            let answer = match slot.as_mut() {
                Some(connection) => connection.prepare_with(sql, parameters).await,
                None => Err(ended()),
            };
            self.noted(answer)
        })
    }

    fn describe<'e, 'q: 'e>(self, sql: &'q str) -> BoxFuture<'e, Result<Describe<MySql>, sqlx::Error>>
    where
        'c: 'e,
    {
        Box::pin(async move {
            let mut slot = self.0.connection.lock().await;
            let answer = match slot.as_mut() {
                Some(connection) => connection.describe(sql).await,
                None => Err(ended()),
            };
            self.noted(answer)
        })
    }
}
