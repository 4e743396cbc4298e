//! The transactional mode: the record and the handler's writes commit together.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::error::SqlState;
use tower_layer::Layer;

use super::commit_rows::{CommitRows, DeferredRows};
use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::handler::{Handler, InTransaction, TypedHandler, typed};
use crate::outcome::{Outcome, RetryReason};
use crate::record::TransactionSafe;
use crate::record::{Begin, RecordStatus};
use crate::store::postgres::claims::{ClaimRequest, Claimed, Statements, claim_batch, to_i64};
use crate::store::postgres::{Checkout, Table, lost_to_another_transaction};
pub(super) use crate::store::sql::claim_request;
use crate::tier::{Enter, Tier, TierDecision, TierService, store_unavailable};

/// Makes the session read-only outside the tier's transaction until the connection is
/// ended ([`ROLLBACK`], [`commit_checked`]): a handler that ends the transaction itself
/// (`ROLLBACK`) and writes on cannot commit a write without the key's record — with a batch
/// in the transaction, its neighbours' writes neither. A query of its own: a `SET` in the
/// same query as the `BEGIN` would join the transaction and be undone with it.
const READ_ONLY_OUTSIDE: &str = "SET default_transaction_read_only = on";

/// Opens the tier's transaction, marked as the tier's for the guard
/// ([`migrate`](crate::postgres::migrate)'s `oncely_commit_guard`): a `COMMIT` of it that the
/// tier did not send fails.
const BEGIN: &str = "BEGIN READ WRITE; SET LOCAL oncely.transaction = 'open'";

/// Rolls the tier's transaction back and gives the session its default back. After an
/// aborted or already ended transaction the `ROLLBACK` only warns, so the `RESET` runs.
pub(super) const ROLLBACK: &str = "ROLLBACK; RESET default_transaction_read_only";

/// Ends the transaction `xid` (the claim's `txid_current()`: 64 bits with the epoch, so it
/// never wraps), but only if it is still open, not aborted, and still the one that claimed
/// the key: `SAVEPOINT` fails outside a transaction block and in an aborted one,
/// the division fails (22012) in another transaction (the handler ran `ROLLBACK; BEGIN`,
/// which would commit its effect without the key's record), and the rest of a simple query
/// is skipped after a failure. A plain `COMMIT` of an aborted transaction answers with the
/// tag `ROLLBACK` and no error, which the client does not show.
fn commit_checked(xid: i64) -> String {
    format!(
        "SAVEPOINT oncely_commit_check; SELECT 1 / (txid_current() = {xid})::int; \
         SET LOCAL oncely.transaction = 'committing'; COMMIT; RESET default_transaction_read_only"
    )
}

/// Takes a pooled connection, opens the tier's transaction on it and claims `requests`
/// (distinct keys) in it as `SUCCESS`, in one round trip: the `BEGIN` and the claim are
/// pipelined. A failure leaves nothing open: the connection is rolled back, or closed.
pub(super) async fn open(
    pool: &Pool,
    statements: &Statements,
    requests: &[ClaimRequest],
) -> Result<(Arc<RecordTransaction>, Claimed), StoreError> {
    let transaction = Arc::new(RecordTransaction {
        checkout: Checkout::get(pool).await?,
        rows: DeferredRows::default(),
    });
    let client = transaction.client();
    // The three are sent at once, in this order. Had the `BEGIN` failed (it cannot, short of
    // a lost connection, which fails the claim too), the claim would run on its own, in a
    // read-only session.
    let (read_only, begun, claimed) = tokio::join!(
        client.batch_execute(READ_ONLY_OUTSIDE),
        client.batch_execute(BEGIN),
        claim_batch(client, statements, requests, RecordStatus::Success)
    );
    match (read_only.and(begun), claimed) {
        (Ok(()), Ok(claimed)) => Ok((transaction, claimed)),
        (Ok(()), Err(error)) => {
            end(transaction, ROLLBACK).await;
            Err(error)
        }
        // Dropped unmarked, the connection is closed.
        (Err(error), _) => Err(StoreError::new(error)),
    }
}

/// A record transaction: the connection it is open on, and the rows its handlers deferred
/// to its commit ([`PgTransaction::defer`]).
pub(super) struct RecordTransaction {
    checkout: Checkout,
    rows: DeferredRows,
}

impl RecordTransaction {
    /// The connection.
    pub(super) fn client(&self) -> &deadpool_postgres::Client {
        self.checkout.client()
    }

    /// Says the session is clean: on drop the connection goes back to the pool.
    fn mark_clean(&self) {
        self.checkout.mark_clean();
    }
}

/// The open transaction of the delivery being handled: the argument a typed handler built by
/// [`PgTransactionalLayer::handler`] takes to write its effect.
///
/// It dereferences to the pooled connection (`deadpool_postgres::Client`): statements run
/// through it — `tx.execute(..)`, `tx.query(..)`, and anything taking a `GenericClient`,
/// such as [`StatusColumns`](crate::postgres::StatusColumns) with `&*tx` — run inside the
/// transaction that also holds the key's record, and commit only if the stack answers
/// processed. Do not `COMMIT`
/// or `ROLLBACK` it yourself: your `COMMIT` fails (the record table's guard trigger, which
/// [`migrate`](crate::postgres::migrate) creates, lets only the tier commit) and rolls the
/// transaction back, the session is read-only outside the tier's transaction
/// (`default_transaction_read_only`), so a write after your `ROLLBACK` fails instead of
/// committing on its own, and the tier retries the delivery. Do not keep it after the
/// handler returns: a clone kept past the answer commits nothing and can write nothing more,
/// whether the stack answered processed or not. A statement that fails aborts the whole transaction:
/// returning `Ok` after ignoring such an error does not make the delivery processed — the
/// tier sees the aborted transaction at commit and answers
/// [`RetryLater`](crate::Outcome::RetryLater) with [`RetryReason::HandlerFailed`].
///
/// ```no_run
/// use oncely::{BusinessKey, HandlerError};
/// use oncely::record::PgTransaction;
///
/// async fn deduct_stock(tx: PgTransaction, order: BusinessKey) -> Result<(), HandlerError> {
///     tx.execute("UPDATE stock SET quantity = quantity - 1 WHERE sku = $1", &[&"sku-1"])
///         .await?;
///     tx.execute("INSERT INTO stock_moves (order_id) VALUES ($1)", &[&order.as_str()])
///         .await?;
///     Ok(())
/// }
/// # fn stack(pool: oncely::postgres::deadpool_postgres::Pool, table: oncely::postgres::Table) {
/// let service = oncely::record::PgTransactionalLayer::new(pool, table).handler(deduct_stock);
/// # }
/// ```
///
/// An untyped handler ([`handler_fn`](crate::handler_fn)) behind the layer finds it in the
/// envelope's [extensions](crate::Envelope::extensions).
#[derive(Clone)]
pub struct PgTransaction(pub(super) Arc<RecordTransaction>);

impl PgTransaction {
    /// The connection, inside the open transaction.
    pub fn client(&self) -> &deadpool_postgres::Client {
        self.0.client()
    }

    /// Hands `rows` to the tier, to write in this transaction just before it commits,
    /// gathered with the rows the other handlers of the transaction (a batch's) deferred:
    /// see [`CommitRows`] for what that buys and its limits. Dropped unwritten if the
    /// transaction does not commit.
    pub fn defer<R: CommitRows>(&self, rows: R) {
        self.0.rows.add(rows);
    }
}

impl std::ops::Deref for PgTransaction {
    type Target = deadpool_postgres::Client;

    fn deref(&self) -> &Self::Target {
        self.0.client()
    }
}

/// Only a handler built by [`PgTransactionalLayer::handler`] takes the transaction: that
/// layer wraps it directly, so the transaction is always there. Should it be missing all
/// the same, the delivery is retried, never run outside a transaction.
impl crate::handler::Argument<InTransaction> for PgTransaction {
    fn take(envelope: &Envelope) -> Result<Self, Outcome> {
        envelope
            .extensions()
            .get::<PgTransaction>()
            .cloned()
            .ok_or_else(|| {
                let detail = "no transaction: the handler is not behind PgTransactionalLayer";
                Outcome::retry_later(RetryReason::HandlerFailed, detail, None)
            })
    }
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PgTransaction")
    }
}

/// The record tier in transactional mode.
///
/// Per envelope: take a pooled connection, `BEGIN`, claim the key's row as `SUCCESS`
/// (insert, or take over a `FAILURE` row), hand the transaction to the tiers behind as a
/// [`PgTransaction`], then `COMMIT` if they answer processed, duplicate or stale, and
/// `ROLLBACK` otherwise. Commit happens before the adapter acks.
///
/// | the key's row | outcome |
/// |---|---|
/// | none, or `FAILURE` | claimed in the transaction: the tiers behind run |
/// | `SUCCESS` | [`Duplicate`](crate::Outcome::Duplicate) from [`Tier::Record`](crate::Tier::Record) |
/// | another payload's fingerprint | [`DeadLetter`](crate::Outcome::DeadLetter) (`payload_mismatch`) |
/// | being claimed by another open transaction | waits for it (the unique index), then as above |
///
/// Any failure — the handler's, a lost connection, a failed commit — rolls back the record
/// and the business writes together and answers [`RetryLater`](crate::Outcome::RetryLater);
/// the failure is then noted on the row as `FAILURE` with its text and a retry count, in a
/// separate statement. A commit whose answer is lost may have committed: the redelivery then
/// finds `SUCCESS` and is a duplicate, so nothing is applied twice either way.
///
/// The tier checks that its `COMMIT` really committed the transaction that claimed the key:
/// a transaction that a handler's ignored statement error aborted, that the handler ended
/// itself, or that it replaced with another (`ROLLBACK; BEGIN`, whose writes would commit
/// without the key's record), is rolled back and answered
/// [`RetryLater`](crate::Outcome::RetryLater) with [`RetryReason::HandlerFailed`], never
/// processed. A connection goes back to the pool only after an explicit `COMMIT` or
/// `ROLLBACK` succeeded on it: when the stack's future is dropped (a `tower` timeout in
/// front, a shutdown), or a tier behind panics, the connection is closed instead, and the
/// server rolls the transaction back.
///
/// Only services that write nothing outside the transaction may stand behind this tier
/// ([`TransactionSafe`]): a flag or state guard there is a compile error.
///
/// ```
/// # use std::time::Duration;
/// # use oncely::{Envelope, HandlerError, handler_fn};
/// # use oncely::flag::{FlagLayer, MemoryFlagStore};
/// # use oncely::record::PgTransactionalLayer;
/// # fn stack(pool: oncely::postgres::deadpool_postgres::Pool, table: oncely::postgres::Table) {
/// let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
/// let flag_in_front = tower::ServiceBuilder::new()
///     .layer(FlagLayer::new(MemoryFlagStore::new(), Duration::from_secs(600)))
///     .layer(PgTransactionalLayer::new(pool, table))
///     .service(handler);
/// # }
/// ```
///
/// ```compile_fail
/// # use std::time::Duration;
/// # use oncely::{Envelope, HandlerError, handler_fn};
/// # use oncely::flag::{FlagLayer, MemoryFlagStore};
/// # use oncely::record::PgTransactionalLayer;
/// # fn stack(pool: oncely::postgres::deadpool_postgres::Pool, table: oncely::postgres::Table) {
/// let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
/// let flag_inside_the_transaction = tower::ServiceBuilder::new()
///     .layer(PgTransactionalLayer::new(pool, table))
///     .layer(FlagLayer::new(MemoryFlagStore::new(), Duration::from_secs(600)))
///     .service(handler);
/// # }
/// ```
///
/// Nor does a lock, a three-step record or a second transactional record inside it:
///
/// ```compile_fail
/// # use oncely::{Envelope, HandlerError, KeyExtractor, handler_fn};
/// # use oncely::lock::{LockLayer, MemoryLockStore};
/// # use oncely::record::PgTransactionalLayer;
/// # fn stack(pool: oncely::postgres::deadpool_postgres::Pool, table: oncely::postgres::Table) {
/// let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
/// let lock_inside_the_transaction = tower::ServiceBuilder::new()
///     .layer(PgTransactionalLayer::new(pool, table))
///     .layer(LockLayer::new(MemoryLockStore::new(), KeyExtractor::json_pointer("/sku")))
///     .service(handler);
/// # }
/// ```
///
/// ```compile_fail
/// # use oncely::{Envelope, HandlerError, handler_fn};
/// # use oncely::record::{MemoryRecordStore, PgTransactionalLayer, RecordLayer};
/// # fn stack(pool: oncely::postgres::deadpool_postgres::Pool, table: oncely::postgres::Table) {
/// let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
/// let records_inside_the_transaction = tower::ServiceBuilder::new()
///     .layer(PgTransactionalLayer::new(pool.clone(), table.clone()))
///     .layer(RecordLayer::new(MemoryRecordStore::new()))
///     .layer(PgTransactionalLayer::new(pool, table))
///     .service(handler);
/// # }
/// ```
#[derive(Clone)]
pub struct PgTransactionalLayer {
    pub(super) pool: Pool,
    table: Table,
    pub(super) statements: Arc<Statements>,
    pub(super) in_flight_delay: Duration,
}

impl PgTransactionalLayer {
    /// A transactional record tier on `pool` using the record table `table`.
    pub fn new(pool: Pool, table: Table) -> Self {
        PgTransactionalLayer {
            statements: Statements::new(&table),
            pool,
            table,
            in_flight_delay: Duration::from_secs(1),
        }
    }

    /// The typed handler `f` behind this tier: an `async fn` whose arguments are taken from
    /// the envelope as for [`handler`](crate::handler()) — [`Json<T>`](crate::Json),
    /// [`BusinessKey`](crate::BusinessKey), [`Delivery`](crate::Delivery) — and which may also
    /// take the open transaction, [`PgTransaction`], to write its effect in it. Put the
    /// result where the handler goes: `ServiceBuilder::new().layer(flag).service(records.handler(f))`.
    ///
    /// Only a handler built here can take the transaction, so a handler that needs it
    /// cannot end up without it: taking `PgTransaction` in [`handler`](crate::handler()) is a
    /// compile error.
    pub fn handler<F, Args>(&self, f: F) -> TierService<TypedHandler<F, InTransaction, Args>, Self>
    where
        F: Handler<InTransaction, Args>,
    {
        TierService::new(typed(f), self.clone())
    }

    setters! {
        /// The delay suggested to the broker when the key's row is `PROCESSING` under a
        /// three-step record's lease (a table shared by both modes; default 1 s).
        with_in_flight_delay(in_flight_delay: Duration);
    }
}

impl fmt::Debug for PgTransactionalLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionalLayer")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl<S: TransactionSafe> Layer<S> for PgTransactionalLayer {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}

/// What the transactional record holds for one envelope: the open transaction in which the
/// key is claimed. Dropped without being settled (the stack's future was dropped, a tier
/// behind panicked), its connection is closed and the server rolls the transaction back.
pub struct PgTransactionalTicket {
    transaction: Arc<RecordTransaction>,
    /// The transaction's id (`txid_current()`), as the claim returned it.
    xid: i64,
    request: ClaimRequest,
}

impl fmt::Debug for PgTransactionalTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionalTicket")
            .field("key", &self.request.key)
            .finish_non_exhaustive()
    }
}

impl TierDecision for PgTransactionalLayer {
    type Ticket = PgTransactionalTicket;
    const TIER: Tier = Tier::Record;

    /// Opens the transaction and claims the key in it; the transaction goes to the tiers
    /// behind as a [`PgTransaction`].
    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<PgTransactionalTicket>, StoreError> {
        let request = claim_request(envelope);
        let opened = open(&self.pool, &self.statements, std::slice::from_ref(&request)).await;
        let (transaction, claimed) = match opened {
            Ok(opened) => opened,
            // A copy that waited for its key's first request until the server gave up on it
            // (a lock timeout, a deadlock) conflicts with a request in progress: in flight,
            // not a store failure.
            Err(error) if lost_to_another_transaction(&error) => {
                return Ok(Enter::Stop(Outcome::retry_later(
                    RetryReason::InFlight(Tier::Record),
                    format!(
                        "the claim of key {} waited on another transaction: {error}",
                        request.key
                    ),
                    Some(self.in_flight_delay),
                )));
            }
            Err(error) => return Err(error),
        };
        let xid = claimed.transaction_id;
        let begin = claimed.answers.into_iter().next().unwrap_or(Begin::InProgress);
        match (
            begin.into_attempt(&request.key, request.fingerprint, self.in_flight_delay),
            xid,
        ) {
            (Ok(_), Some(xid)) => {
                let handle = PgTransaction(transaction.clone());
                envelope.extensions_mut().insert(handle);
                Ok(Enter::Proceed(PgTransactionalTicket {
                    transaction,
                    xid,
                    request,
                }))
            }
            (Ok(_), None) => {
                end(transaction, ROLLBACK).await;
                Err(StoreError::malformed(
                    "a claim without the claiming transaction's id",
                ))
            }
            (Err(stop), _) => {
                end(transaction, ROLLBACK).await;
                Ok(Enter::Stop(stop))
            }
        }
    }

    /// Commits when the tiers behind settled the key, and proves it; rolls back otherwise,
    /// and notes the failure on the key's row.
    async fn exit(&self, ticket: PgTransactionalTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let PgTransactionalTicket {
            transaction,
            xid,
            request,
        } = ticket;
        let failure = if outcome.is_settled() {
            match commit(transaction, xid).await {
                Ok(()) => return Ok(outcome),
                Err(failed) => failed,
            }
        } else {
            end(transaction, ROLLBACK).await;
            outcome
        };
        self.note_failed_attempt(&request, &failure.to_string()).await;
        Ok(failure)
    }
}

impl PgTransactionalLayer {
    /// Records a failed attempt after the rollback, outside the transaction: best effort,
    /// for operators; the outcome does not depend on it.
    pub(super) async fn note_failed_attempt(&self, request: &ClaimRequest, error: &str) {
        let fence = request.fencing_token.map(to_i64);
        let fingerprint = request.fingerprint.to_string();
        let noted = Checkout::run(&self.pool, async |client| {
            client
                .execute(
                    &self.statements.note_failure,
                    &[&request.key.as_str(), &fingerprint, &fence, &error],
                )
                .await?;
            Ok(())
        });
        if let Err(failure) = noted.await {
            tracing::warn!(key = %request.key, %failure, "could not note the failed attempt");
        }
    }
}

/// Commits, and proves it: `Err` is the outcome when nothing was committed (or, with the
/// connection lost, when nobody knows; the redelivery then finds out from the record).
pub(super) async fn commit(transaction: Arc<RecordTransaction>, xid: i64) -> Result<(), Outcome> {
    // The envelope, and every handle to the transaction in it, is gone once the stack has
    // answered; a handle still alive (kept in a spawned task, say) could write after the
    // commit, outside the record.
    if Arc::strong_count(&transaction) > 1 {
        abandon(transaction).await;
        return Err(Outcome::retry_later(
            RetryReason::HandlerFailed,
            "nothing was committed: the handler kept its PgTransaction after answering",
            None,
        ));
    }
    // The deferred rows go first, in the transaction, and the commit only once they are
    // written (pipelined, a write that failed in the client would let the commit through
    // without them). Their failure is classified below like the commit's: the handler's
    // (an aborted or ended transaction) or the store's.
    let client = transaction.client();
    let committed = async {
        if let Err(error) = transaction.rows.write(client).await {
            if error.code().is_some_and(|code| code.code().starts_with("23")) {
                tracing::error!(%error, "rows deferred to the commit break a constraint (a row written once exists already?): nothing was committed");
            }
            return Err(error);
        }
        client.batch_execute(&commit_checked(xid)).await
    };
    let error = match committed.await {
        Ok(()) => {
            transaction.mark_clean();
            return Ok(());
        }
        Err(error) => error,
    };
    let Some(code) = error.code() else {
        // Dropping the connection unmarked closes it: the commit's fate is unknown.
        return Err(store_unavailable(Tier::Record, &StoreError::new(error)));
    };
    let ended_by_the_handler = [
        SqlState::IN_FAILED_SQL_TRANSACTION,
        SqlState::NO_ACTIVE_SQL_TRANSACTION,
        SqlState::DIVISION_BY_ZERO,
        // A deferred write after the handler ended the transaction: the session is
        // read-only outside the tier's `BEGIN READ WRITE`.
        SqlState::READ_ONLY_SQL_TRANSACTION,
    ];
    if ended_by_the_handler.contains(code) {
        end(transaction, ROLLBACK).await;
        return Err(Outcome::retry_later(
            RetryReason::HandlerFailed,
            format!(
                "the record was not committed: a statement of the handler failed and aborted the \
                 transaction, or the handler ended it itself, although it answered success: {error}"
            ),
            None,
        ));
    }
    // The server refused the COMMIT itself and rolled the transaction back — or the check
    // before it failed (a statement timeout, a cancel) and the transaction is still open,
    // aborted: the ROLLBACK ends it (after a refused COMMIT it only warns), and the
    // connection goes back to the pool only if that worked.
    end(transaction, ROLLBACK).await;
    let reason = match code.code().get(..2) {
        // Serialization failure, deadlock: another transaction won; trying again may pass.
        Some("40") => RetryReason::Conflict(Tier::Record),
        // A deferred constraint of the handler's writes.
        Some("23") => RetryReason::HandlerFailed,
        _ => RetryReason::StoreUnavailable(Tier::Record),
    };
    Err(Outcome::retry_later(
        reason,
        format!("the commit was refused, nothing was committed: {error}"),
        None,
    ))
}

/// Rolls back a transaction that someone else still holds a handle to (a handler kept its
/// [`PgTransaction`]): the session stays read-only, so the handle can write nothing more,
/// and the connection is closed when the last handle is dropped, never pooled again.
pub(super) async fn abandon(transaction: Arc<RecordTransaction>) {
    let client = transaction.client();
    // A statement of the handle's may still be running, holding locks: cancel it first.
    let _ = client
        .cancel_token()
        .cancel_query(deadpool_postgres::tokio_postgres::NoTls)
        .await;
    if let Err(error) = client.batch_execute("ROLLBACK").await {
        tracing::warn!(%error, "could not roll back an abandoned record transaction");
    }
}

/// Ends the transaction with `statement`; the connection goes back to the pool only if that
/// worked. A transaction someone else still holds a handle to (a task the handler spawned, a
/// handler cut off by a timeout) is abandoned instead: after the rollback gave the session
/// its default back, that handle could write in autocommit, outside the record.
pub(super) async fn end(transaction: Arc<RecordTransaction>, statement: &str) {
    if Arc::strong_count(&transaction) > 1 {
        abandon(transaction).await;
        return;
    }
    match transaction.client().batch_execute(statement).await {
        Ok(()) => transaction.mark_clean(),
        Err(error) => {
            tracing::warn!(%error, statement, "could not end the record transaction; dropping the connection");
        }
    }
}
