//! The transactional mode on MySQL and MariaDB: the record and the handler's writes commit
//! together, in one XA transaction (`store/mysql/transaction.rs` says why XA).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::MySqlPool;
use tower_layer::Layer;

use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::handler::{Handler, InTransaction, TypedHandler, typed};
use crate::outcome::{Outcome, RetryReason};
use crate::record::{Begin, TransactionSafe};
use crate::store::mysql::claims::{Statements, kept_error};
use crate::store::mysql::killer::Killer;
use crate::store::mysql::transaction::{MysqlTransaction, OpenTransaction};
use crate::store::mysql::{Table, lost_to_another_transaction};
use crate::store::sql::{ClaimRequest, claim_request, to_i64};
use crate::tier::{Enter, Tier, TierDecision, TierService};

/// The record tier in transactional mode on MySQL 8 or MariaDB.
///
/// Per envelope: take a pooled connection, start an XA transaction, claim the key's row as
/// `SUCCESS` (insert, or take over a `FAILURE` row), hand the transaction to the tiers
/// behind as a [`MysqlTransaction`], then commit if they answer processed, duplicate or
/// stale, and roll back otherwise. Commit happens before the adapter acks.
///
/// | the key's row | outcome |
/// |---|---|
/// | none, or `FAILURE` | claimed in the transaction: the tiers behind run |
/// | `SUCCESS` | [`Duplicate`](crate::Outcome::Duplicate) from [`Tier::Record`](crate::Tier::Record) |
/// | another payload's fingerprint | [`DeadLetter`](crate::Outcome::DeadLetter) (`payload_mismatch`) |
/// | being claimed by another open transaction | waits for it (the unique index, up to `innodb_lock_wait_timeout`), then as above |
///
/// Any failure — the handler's, a failed statement the handler ignored, a lost connection,
/// a refused commit — rolls back the record and the business writes together and answers
/// [`RetryLater`](crate::Outcome::RetryLater); the failure is then noted on the row as
/// `FAILURE` with its text and a retry count, in a separate statement. A commit whose answer
/// is lost may have committed: the redelivery then finds `SUCCESS` and is a duplicate, so
/// nothing is applied twice either way. A deadlock that picks this transaction's claim or
/// commit as its victim answers `RetryLater` with [`RetryReason::Conflict`]; one that picks
/// a statement of the handler's is the handler's failure ([`RetryReason::HandlerFailed`]).
///
/// What MySQL needs that PostgreSQL does not, and the tier does (see [`MysqlTransaction`]):
/// the transaction is an XA transaction, so a handler's `COMMIT`, `ROLLBACK`,
/// `START TRANSACTION`, DDL or `LOCK TABLES` fails instead of ending it; a failed statement
/// fails the delivery although MySQL would have carried on; and a connection whose
/// transaction was not ended by the tier — the stack's future dropped by a `tower` timeout,
/// a panic behind, a statement of the handler's cut off mid-flight, a connection that
/// failed — is killed on the server (`KILL`, from a connection of its own), which rolls it
/// back at once, and never goes back to the pool. A connection goes back with `autocommit`
/// on; other session settings a handler changes (`SET SESSION …`, `GET_LOCK`, temporary
/// tables) stay on it, as they would on any pooled connection: change none.
///
/// The transaction runs at the session's isolation level (REPEATABLE READ by default). The
/// claim's `INSERT` locks the key's index record for the transaction's life, so a copy of
/// the same key waits for the first to end. A claim that finds the key's row (a copy, a
/// takeover of a `FAILURE` row) also holds the shared next-key lock of its duplicate-key
/// check — the record and the gap before it in the key index — until it ends, so a new key
/// that sorts into that gap waits for a takeover's handler. Under REPEATABLE READ a
/// handler's own locking reads take gap locks too, and two transactions that lock the same
/// rows in different orders deadlock: InnoDB fails one, which is retried.
///
/// Only services that write nothing outside the transaction may stand behind this tier
/// ([`TransactionSafe`]), as with [`PgTransactionalLayer`](crate::record::PgTransactionalLayer):
/// a flag (or lock, or state guard) inside the transaction is a compile error.
///
/// ```compile_fail
/// # use std::time::Duration;
/// # use oncely::{Envelope, HandlerError, handler_fn};
/// # use oncely::flag::{FlagLayer, MemoryFlagStore};
/// # use oncely::record::MysqlTransactionalLayer;
/// # fn stack(pool: oncely::mysql::sqlx::MySqlPool, table: oncely::mysql::Table) {
/// let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
/// let flag_inside_the_transaction = tower::ServiceBuilder::new()
///     .layer(MysqlTransactionalLayer::new(pool, table))
///     .layer(FlagLayer::new(MemoryFlagStore::new(), Duration::from_secs(600)))
///     .service(handler);
/// # }
/// ```
///
/// Limits: business keys up to [`MYSQL_MAX_KEY_BYTES`](crate::record::MYSQL_MAX_KEY_BYTES).
/// One delivery per transaction; [`batched`](MysqlTransactionalLayer::batched) shares one
/// among the deliveries in flight.
#[derive(Clone)]
pub struct MysqlTransactionalLayer {
    pub(super) pool: MySqlPool,
    table: Table,
    pub(super) statements: Arc<Statements>,
    pub(super) in_flight_delay: Duration,
    /// Kills the sessions of abandoned transactions, from one connection of its own.
    pub(super) killer: Arc<Killer>,
}

impl MysqlTransactionalLayer {
    /// A transactional record tier on `pool` using the record table `table` (create it with
    /// [`migrate`](crate::mysql::migrate)).
    pub fn new(pool: MySqlPool, table: Table) -> Self {
        MysqlTransactionalLayer {
            statements: Statements::new(&table),
            killer: Arc::new(Killer::new(&pool)),
            pool,
            table,
            in_flight_delay: Duration::from_secs(1),
        }
    }

    /// The typed handler `f` behind this tier: an `async fn` whose arguments are taken from
    /// the envelope as for [`handler`](crate::handler()) — [`Json<T>`](crate::Json),
    /// [`BusinessKey`](crate::BusinessKey), [`Delivery`](crate::Delivery) — and which may also
    /// take the open transaction, [`MysqlTransaction`], to write its effect in it.
    ///
    /// Only a handler built here (or by another transactional tier) can take a transaction:
    /// taking `MysqlTransaction` in [`handler`](crate::handler()) is a compile error.
    ///
    /// ```compile_fail
    /// use oncely::HandlerError;
    /// use oncely::record::MysqlTransaction;
    ///
    /// async fn deduct_stock(tx: MysqlTransaction) -> Result<(), HandlerError> {
    ///     Ok(())
    /// }
    /// let outside_the_record = oncely::handler(deduct_stock);
    /// ```
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

    /// Records a failed attempt after the rollback, outside the transaction: best effort,
    /// for operators; the outcome does not depend on it.
    pub(super) async fn note_failed_attempt(&self, request: &ClaimRequest, error: &str) {
        let fingerprint = request.fingerprint.to_string();
        let error = kept_error(error);
        let noted = sqlx::query(&self.statements.note_failure)
            .bind(request.key.as_str())
            .bind(&fingerprint)
            .bind(request.fencing_token.map(to_i64))
            .bind(error)
            .bind(&fingerprint)
            .bind(&fingerprint)
            .bind(&fingerprint)
            .bind(&fingerprint)
            .bind(error)
            .bind(&fingerprint)
            .bind(&fingerprint)
            .execute(&self.pool)
            .await;
        if let Err(failure) = noted {
            tracing::warn!(key = %request.key, %failure, "could not note the failed attempt");
        }
    }
}

impl fmt::Debug for MysqlTransactionalLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlTransactionalLayer")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl<S: TransactionSafe> Layer<S> for MysqlTransactionalLayer {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}

/// What the MySQL transactional record holds for one envelope: the open transaction in which
/// the key is claimed. Dropped without being settled (the stack's future was dropped, a tier
/// behind panicked), its connection is killed and the server rolls the transaction back.
pub struct MysqlTransactionalTicket {
    transaction: MysqlTransaction,
    request: ClaimRequest,
}

impl fmt::Debug for MysqlTransactionalTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlTransactionalTicket")
            .field("key", &self.request.key)
            .finish_non_exhaustive()
    }
}

impl TierDecision for MysqlTransactionalLayer {
    type Ticket = MysqlTransactionalTicket;
    const TIER: Tier = Tier::Record;

    /// Starts the transaction and claims the key in it; the transaction goes to the tiers
    /// behind as a [`MysqlTransaction`].
    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<MysqlTransactionalTicket>, StoreError> {
        let request = claim_request(envelope);
        let transaction = OpenTransaction::start(&self.pool, &self.killer).await?;
        let claimed = transaction
            .claim(&self.statements, std::slice::from_ref(&request))
            .await;
        let begin = match claimed {
            Ok(answers) => answers.into_iter().next().unwrap_or(Begin::InProgress),
            Err(error) => {
                transaction.roll_back().await;
                // A copy that waited for its key's first request until the server gave up
                // on it (a lock wait timeout, a deadlock) conflicts with a request in
                // progress: in flight, not a store failure.
                return match lost_to_another_claim(&error) {
                    true => Ok(Enter::Stop(Outcome::retry_later(
                        RetryReason::InFlight(Tier::Record),
                        format!("the claim of key {} lost to a copy's: {error}", request.key),
                        Some(self.in_flight_delay),
                    ))),
                    false => Err(error),
                };
            }
        };
        match begin.into_attempt(&request.key, request.fingerprint, self.in_flight_delay) {
            Ok(_) => {
                let transaction = MysqlTransaction(Arc::new(transaction));
                envelope.extensions_mut().insert(transaction.clone());
                Ok(Enter::Proceed(MysqlTransactionalTicket { transaction, request }))
            }
            Err(stop) => {
                transaction.roll_back().await;
                Ok(Enter::Stop(stop))
            }
        }
    }

    /// Commits when the tiers behind settled the key; rolls back otherwise, and notes the
    /// failure on the key's row.
    async fn exit(&self, ticket: MysqlTransactionalTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let MysqlTransactionalTicket { transaction, request } = ticket;
        let failure = if outcome.is_settled() {
            match commit(transaction).await {
                Ok(()) => return Ok(outcome),
                Err(failed) => failed,
            }
        } else {
            transaction.0.roll_back().await;
            outcome
        };
        self.note_failed_attempt(&request, &failure.to_string()).await;
        Ok(failure)
    }
}

/// True when the claim failed because the server let another transaction through:
/// copies racing to take over one `FAILURE` row each hold the shared lock of their
/// duplicate-key check and ask for the exclusive one, and InnoDB rolls one back.
pub(super) fn lost_to_another_claim(error: &StoreError) -> bool {
    match error {
        StoreError::Failed { source } => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(lost_to_another_transaction),
        StoreError::Malformed { .. } => false,
    }
}

/// Commits `transaction` unless a handle to it outlived the handler's answer.
pub(super) async fn commit(transaction: MysqlTransaction) -> Result<(), Outcome> {
    // The envelope, and every handle in it, is gone once the stack has answered; a handle
    // still alive (kept in a spawned task, say) could write after the commit, outside the
    // record. Rolled back, its statements find no connection.
    if Arc::strong_count(&transaction.0) > 1 {
        // The kept handle may be mid-statement: killed, not waited for.
        transaction.0.close().await;
        return Err(Outcome::retry_later(
            RetryReason::HandlerFailed,
            "nothing was committed: the handler kept its MysqlTransaction after answering",
            None,
        ));
    }
    transaction.0.commit().await
}
