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
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::BoxFuture;
use futures_util::stream::{BoxStream, StreamExt, TryStreamExt};
use sqlx::mysql::{MySqlQueryResult, MySqlRow, MySqlStatement, MySqlTypeInfo};
use sqlx::pool::PoolConnection;
use sqlx::{Describe, Either, Execute, Executor, MySql, MySqlPool, Row};

use super::claims::{Statements, claim, claim_new_keys};
use super::commit_rows::{DeferredRows, MysqlCommitRows};
use super::killer::{Killer, SERVER, Session};
use super::lost_to_another_transaction;
use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::outcome::{Outcome, RetryReason};
use crate::record::{Begin, RecordStatus};
use crate::store::sql::ClaimRequest;

/// One claim's transaction: the connection (until the tier ends the transaction), the XA
/// id, and what the handler's statements through its handle met.
pub(crate) struct OpenTransaction {
    /// `None` once the tier has taken it to end the transaction: a handle kept past the
    /// answer then has nothing to run on.
    connection: tokio::sync::Mutex<Option<PoolConnection<MySql>>>,
    /// The XA transaction's id: `oncely-` and 32 random hex digits, quoted into SQL.
    xid: String,
    /// The connection's server session, to kill what it runs when the transaction is
    /// abandoned.
    session: Session,
    /// Who kills the session when the transaction is abandoned: the layer's.
    killer: Arc<Killer>,
    /// The first statement of the handler's that failed, or was cut off.
    failure: std::sync::Mutex<Option<String>>,
    /// A statement of the handler's was cut off before it finished (its future dropped by a
    /// timeout or a `select!` inside the handler): the server may still be running it.
    cut_off: AtomicBool,
    /// What the handlers deferred to the commit.
    rows: DeferredRows,
}

/// How the tier ends a transaction.
#[derive(Clone, Copy, Debug)]
enum Ending {
    Commit,
    Rollback,
}

impl OpenTransaction {
    /// Takes a connection from `pool` and starts an XA transaction on it, in one round trip.
    /// The transaction runs at the session's isolation level (the server's default,
    /// REPEATABLE READ, unless the pool's connections set another). The claim's reads need
    /// no more than READ COMMITTED: the `UPDATE` that takes a row over checks it again.
    pub(crate) async fn start(pool: &MySqlPool, killer: &Arc<Killer>) -> Result<Self, StoreError> {
        let mut connection = Unpooled(Some(pool.acquire().await?));
        let xid = format!("oncely-{}", crate::Token::random());
        // `Executor::fetch_all`, not `RawSql::fetch_all`: the latter's future is not `Send` for
        // every lifetime, which the tier's trait methods need. Text protocol: XA statements
        // cannot be prepared.
        let start = format!("XA START '{xid}'; SELECT CAST(CONNECTION_ID() AS UNSIGNED), {SERVER}");
        let alive_at = std::time::Instant::now();
        let rows = connection.get().fetch_all(sqlx::raw_sql(&start)).await?;
        let session = match rows.as_slice() {
            [row] => Session {
                id: row.try_get(0)?,
                server: row.try_get(1)?,
                alive_at,
            },
            _ => return Err(StoreError::malformed("XA START answered no connection id")),
        };
        Ok(OpenTransaction {
            connection: tokio::sync::Mutex::new(connection.keep()),
            xid,
            session,
            killer: killer.clone(),
            failure: std::sync::Mutex::new(None),
            cut_off: AtomicBool::new(false),
            rows: DeferredRows::default(),
        })
    }

    /// Claims the keys of `requests` as `SUCCESS`, inside the transaction: all in one round
    /// trip when every key is new, else one statement (or three, for a key with a row) after
    /// another; answers per request.
    pub(crate) async fn claim(
        &self,
        statements: &Statements,
        requests: &[ClaimRequest],
    ) -> Result<Vec<Begin>, StoreError> {
        let mut slot = self.lock().await.map_err(StoreError::new)?;
        let connection = slot.as_mut().ok_or_else(|| StoreError::new(ended()))?;
        if requests.len() > 1
            && let Some(answers) =
                claim_new_keys(connection, statements, requests, RecordStatus::Success).await?
        {
            return Ok(answers);
        }
        let mut answers = Vec::with_capacity(requests.len());
        for request in requests {
            answers.push(claim(connection, statements, request, RecordStatus::Success).await?);
        }
        Ok(answers)
    }

    /// Takes back the claims of `requests` in the transaction, noted `note`: their
    /// deliveries went away before their handlers ran.
    pub(crate) async fn withdraw(
        &self,
        statements: &Statements,
        requests: &[ClaimRequest],
        note: &str,
    ) -> Result<(), StoreError> {
        let mut slot = self.lock().await.map_err(StoreError::new)?;
        let connection = slot.as_mut().ok_or_else(|| StoreError::new(ended()))?;
        let marks = vec!["?"; requests.len()].join(", ");
        let fresh = format!("{}({marks})", statements.withdraw_fresh_head);
        let taken_over = format!("{}({marks})", statements.withdraw_head);
        for (statement, note) in [(&fresh, None), (&taken_over, Some(note))] {
            let query = note
                .into_iter()
                .fold(sqlx::query(statement), |query, note| query.bind(note));
            let query = requests.iter().fold(query, |query, request| {
                query.bind(request.key.as_str().as_bytes())
            });
            query.execute(&mut **connection).await?;
        }
        Ok(())
    }

    /// Commits: `Ok` only when the server said it committed. A statement of the handler's
    /// that failed — MySQL undoes only that statement and carries on, unlike PostgreSQL,
    /// where it aborts the transaction — or that was cut off makes the tier roll back
    /// instead: the handler's other writes would otherwise commit with the record although
    /// one of its statements did not apply (or did, unseen).
    pub(crate) async fn commit(&self) -> Result<(), Outcome> {
        if let Some(failure) = self.failure() {
            self.roll_back().await;
            return Err(Outcome::retry_later(
                RetryReason::HandlerFailed,
                format!(
                    "the record was not committed: a statement of the handler failed, although it \
                     answered success: {failure}"
                ),
                None,
            ));
        }
        // The deferred rows, written while the connection is still in its slot: should this
        // future be dropped mid-write, the transaction's drop kills the session.
        let written = match self.lock().await {
            Ok(mut slot) => match slot.as_mut() {
                Some(connection) => self.rows.write(connection).await,
                None => Err(ended()),
            },
            Err(cut_off) => Err(cut_off),
        };
        let Some(connection) = self.connection.lock().await.take() else {
            return Err(store_lost("the transaction's connection was already ended"));
        };
        if let Err(error) = written {
            let _ = self.end(connection, Ending::Rollback).await;
            return Err(refused_rows(error));
        }
        self.end(connection, Ending::Commit).await.map_err(refused_commit)
    }

    /// Ends the transaction without waiting for what may still run on its connection (a
    /// statement of a handle kept elsewhere, say): the session is killed first, which fails
    /// that statement at once and rolls the transaction back.
    pub(crate) async fn close(&self) {
        self.cut_off.store(true, Ordering::Release);
        // Killed first: a statement running through a handle holds the connection, which the
        // rollback would wait for. Ending the cut-off transaction then lets its slot go.
        self.killer.kill(&self.session, None);
        self.roll_back().await;
    }

    /// The connection, unless a statement was cut off on it: its answer may still be on the
    /// way, and a next statement would first wait for it — possibly for the lock wait
    /// timeout. Nothing more runs on such a connection; the tier kills its session.
    async fn lock(&self) -> Result<tokio::sync::MutexGuard<'_, Option<PoolConnection<MySql>>>, sqlx::Error> {
        if self.cut_off.load(Ordering::Acquire) {
            return Err(cut_off());
        }
        let slot = self.connection.lock().await;
        match self.cut_off.load(Ordering::Acquire) {
            true => Err(cut_off()),
            false => Ok(slot),
        }
    }

    /// Rolls back; the connection goes back to the pool only if that worked.
    pub(crate) async fn roll_back(&self) {
        if let Some(connection) = self.connection.lock().await.take() {
            let _ = self.end(connection, Ending::Rollback).await;
        }
    }

    /// Ends the transaction. The connection goes back to the pool only if that worked, and
    /// with `autocommit` on: a handler's `SET autocommit = 0` (which XA allows) would
    /// otherwise leave every later statement on it in a transaction nobody commits.
    /// After a cut-off statement, or when the connection failed, the server session is
    /// killed instead: waiting for a statement that may wait for a lock, or leaving a
    /// session the server still thinks alive, would hold the key's claim for the lock wait
    /// timeout, or for hours.
    async fn end(&self, mut connection: PoolConnection<MySql>, ending: Ending) -> Result<(), sqlx::Error> {
        if self.cut_off.load(Ordering::Acquire) {
            self.killer.kill(&self.session, Some(connection));
            return Err(sqlx::Error::Protocol(
                "a statement of the handler was cut off".into(),
            ));
        }
        let xid = &self.xid;
        let statement = match ending {
            Ending::Commit => format!("XA END '{xid}'; XA COMMIT '{xid}' ONE PHASE; SET autocommit = 1"),
            Ending::Rollback => format!("XA END '{xid}'; XA ROLLBACK '{xid}'; SET autocommit = 1"),
        };
        let ended = connection.execute(sqlx::raw_sql(&statement)).await;
        if let Err(error) = &ended {
            tracing::warn!(%error, ?ending, "could not end the record transaction; closing the connection");
            connection.close_on_drop();
            if !matches!(error, sqlx::Error::Database(_)) {
                self.killer.kill(&self.session, Some(connection));
            }
        }
        ended.map(drop)
    }

    /// The first failure the handler's statements met, if any: the transaction can no longer
    /// commit.
    pub(crate) fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .map(|failure| failure.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// Keeps the first failure of the handler's statements.
    fn note(&self, failure: impl FnOnce() -> String) {
        let mut kept = self
            .failure
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        kept.get_or_insert_with(failure);
    }
}

/// Never pooled unended: an `OpenTransaction` dropped with its connection (a `tower` timeout
/// dropped the stack's future, a tier behind panicked) kills the connection's session, which
/// rolls the transaction back at once, even mid-statement — a closed socket alone is noticed
/// only when the running statement ends, which could hold its locks for the lock wait
/// timeout.
impl Drop for OpenTransaction {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.get_mut().take() {
            self.killer.kill(&self.session, Some(connection));
        }
    }
}

/// A connection on its way into an XA transaction: closed, not pooled, if dropped before
/// [`keep`](Unpooled::keep) — a timeout that drops the future while `XA START` is on the wire
/// would otherwise pool it with the transaction open, and the next user's writes would join it.
pub(crate) struct Unpooled(pub(crate) Option<PoolConnection<MySql>>);

impl Unpooled {
    pub(crate) fn get(&mut self) -> &mut PoolConnection<MySql> {
        self.0.as_mut().expect("taken only by keep")
    }

    pub(crate) fn keep(mut self) -> Option<PoolConnection<MySql>> {
        self.0.take()
    }
}

impl Drop for Unpooled {
    fn drop(&mut self) {
        if let Some(connection) = self.0.as_mut() {
            connection.close_on_drop();
        }
    }
}

/// A statement of the handler's on the wire: dropped before it [finished](InFlight::finish),
/// it notes the transaction cut off — the server may still run it, and what it does is
/// unknown, so nothing of the transaction commits and the session is killed.
struct InFlight<'a>(Option<&'a OpenTransaction>);

impl<'a> InFlight<'a> {
    fn start(transaction: &'a OpenTransaction) -> Self {
        InFlight(Some(transaction))
    }

    fn finish(mut self) {
        self.0 = None;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(transaction) = self.0 {
            transaction.cut_off.store(true, Ordering::Release);
            transaction.note(|| "a statement was cut off before it finished".to_owned());
        }
    }
}

/// The outcome of deferred rows the server refused: a constraint they break is the
/// handler's (a row written once that exists already is a bug, said at error level), a lost
/// race another transaction's, anything else the store's.
fn refused_rows(error: sqlx::Error) -> Outcome {
    let constraint = match &error {
        sqlx::Error::Database(database) => database.code().is_some_and(|state| state.starts_with("23")),
        _ => false,
    };
    if constraint {
        tracing::error!(%error, "rows deferred to the commit break a constraint (a row written once exists already?): nothing was committed");
    }
    let reason = match (constraint, lost_to_another_transaction(&error)) {
        (true, _) => RetryReason::HandlerFailed,
        (false, true) => RetryReason::Conflict(crate::Tier::Record),
        (false, false) => RetryReason::StoreUnavailable(crate::Tier::Record),
    };
    Outcome::retry_later(
        reason,
        format!("the rows deferred to the commit were refused, nothing was committed: {error}"),
        None,
    )
}

/// The outcome of a commit the server refused, or whose answer never came.
fn refused_commit(error: sqlx::Error) -> Outcome {
    let sqlx::Error::Database(database) = &error else {
        // The connection failed: the commit may have happened; the redelivery finds out
        // from the record.
        return store_lost(format!("the commit's answer was lost: {error}"));
    };
    // XAER_NOTA: no such XA transaction — ended by someone else, who may have committed it.
    let unknown = database
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some_and(|error| error.number() == 1397);
    if unknown {
        return store_lost(format!("the transaction was ended by someone else: {error}"));
    }
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

/// What a statement finds on a connection where an earlier one was cut off.
fn cut_off() -> sqlx::Error {
    sqlx::Error::Protocol(
        "a statement of the handler was cut off before it finished: nothing more runs in this transaction"
            .into(),
    )
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
///   use `INSERT IGNORE` (its rows affected are 0 when the row was there) or
///   `ON DUPLICATE KEY UPDATE`. A statement cut off before it finished (a timeout or a
///   `select!` inside the handler) fails the delivery the same way: the server may still run
///   it.
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

/// Shows no XA id: with it, a handler could end the transaction itself (`XA END …`).
impl fmt::Debug for MysqlTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MysqlTransaction")
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
    /// Hands `rows` to the tier, to write in this transaction just before it commits,
    /// gathered with the rows the other handlers of the transaction (a batch's) deferred:
    /// see [`MysqlCommitRows`] for what that buys and its limits. Dropped unwritten if the
    /// transaction does not commit.
    pub fn defer<R: MysqlCommitRows>(&self, rows: R) {
        self.0.rows.add(rows);
    }

    /// The first failure of a statement run through this handle (or its clones), if any:
    /// the transaction will not commit, whatever the handler answers.
    pub fn failure(&self) -> Option<String> {
        self.0.failure()
    }

    /// Keeps the failure of a statement run through the handle, if it failed, for the commit
    /// to see.
    fn noted<T>(&self, answer: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        if let Err(error) = &answer {
            self.0.note(|| error.to_string());
        }
        answer
    }
}

/// Runs `$call` (an expression on the connection, bound as `$connection`) through the
/// handle `$handle` as one statement of the handler's: refused once a statement was cut off
/// or the transaction ended, marked cut off if its future is dropped before it finished,
/// noted if it fails. A macro, not a function taking a closure: sqlx's executor on a
/// borrowed connection inside a closure's future is not `Send` for every lifetime.
macro_rules! through_handle {
    ($handle:expr, |$connection:ident| $call:expr) => {{
        let answer = match $handle.0.lock().await {
            Ok(mut slot) => {
                let in_flight = InFlight::start(&$handle.0);
                let answer = match slot.as_mut() {
                    Some($connection) => $call.await,
                    None => Err(ended()),
                };
                in_flight.finish();
                answer
            }
            Err(cut_off) => Err(cut_off),
        };
        $handle.noted(answer)
    }};
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
            // The first error ends the stream; it is the answer to note.
            let answers = through_handle!(self, |connection| connection
                .fetch_many(query)
                .try_collect::<Vec<_>>());
            let answers = match answers {
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
        Box::pin(async move { through_handle!(self, |connection| connection.fetch_optional(query)) })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [MySqlTypeInfo],
    ) -> BoxFuture<'e, Result<MySqlStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        Box::pin(async move { through_handle!(self, |connection| connection.prepare_with(sql, parameters)) })
    }

    fn describe<'e, 'q: 'e>(self, sql: &'q str) -> BoxFuture<'e, Result<Describe<MySql>, sqlx::Error>>
    where
        'c: 'e,
    {
        Box::pin(async move { through_handle!(self, |connection| connection.describe(sql)) })
    }
}
