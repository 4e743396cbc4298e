//! The batched transactional mode: many deliveries, one transaction, one commit — written
//! once for every SQL store's transactional record ([`TransactionalRecord`]). Documented on
//! [`BatchedLayer`].
//!
//! The public types are generic over [`TransactionalRecord`], which stays crate-private:
//! that seals them (only oncely's stores run batches), and keeps the claim types out of the
//! public interface. Hence the two lints allowed for this module and its children.
#![allow(private_bounds, private_interfaces)]

mod lane;
mod set;
mod traffic;
mod turns;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tower_layer::Layer;

use self::lane::{Lanes, Limits};
pub use self::set::{BatchAnswer, BatchHandler, BatchHandlerService};
use self::turns::Turns;
pub use self::turns::{BatchLanes, BatchedService};
use crate::error::StoreError;
use crate::handler::{Argument, Handler, InTransaction, TypedHandler, typed};
use crate::outcome::Outcome;
use crate::record::{Begin, TransactionSafe};
use crate::store::sql::ClaimRequest;
use crate::tier::{TierDecision, TierService};

/// A SQL store's transactional record tier, as the batched mode's lanes run it: opening a
/// transaction with the first claims, claiming more in it, the handle its handlers take,
/// and ending it. Each store implements it in its own home.
pub(crate) trait TransactionalRecord: TierDecision + Clone + fmt::Debug {
    /// A batch's open transaction, as the lane holds it.
    type Open: Send + Sync + 'static;
    /// The transaction as a handler takes it (`PgTransaction`, `MysqlTransaction`).
    type Handle: Argument<InTransaction> + Clone + Send + Sync + 'static;

    /// Takes a connection, opens a transaction and claims `requests` (distinct keys, in key
    /// order) in it as `SUCCESS`; answers per request. A failure leaves nothing open.
    fn open(
        &self,
        requests: &[ClaimRequest],
    ) -> impl Future<Output = Result<(Self::Open, Vec<Begin>), StoreError>> + Send;

    /// Claims `requests` in the open transaction.
    fn claim_more(
        &self,
        open: &mut Self::Open,
        requests: &[ClaimRequest],
    ) -> impl Future<Output = Result<Vec<Begin>, StoreError>> + Send;

    /// Takes back, in the open transaction, the claims of `requests` whose deliveries went
    /// away before their handlers ran, so that the rest of the batch may commit: a key the
    /// batch claimed first goes as if never claimed (no row is left behind), one it took
    /// over is left as a failed attempt leaves it (`FAILURE`); either way the key's next
    /// delivery runs.
    fn withdraw(
        &self,
        open: &Self::Open,
        requests: &[ClaimRequest],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The handle to `open` the handlers take.
    fn handle(open: &Self::Open) -> Self::Handle;

    /// Commits, and proves it, as the per-delivery tier does; `Err` is the outcome when
    /// nothing was committed, or nobody knows.
    fn commit(&self, open: Self::Open) -> impl Future<Output = Result<(), Outcome>> + Send;

    /// Rolls back; the connection is pooled again only if that worked.
    fn roll_back(&self, open: Self::Open) -> impl Future<Output = ()> + Send;

    /// Ends the transaction without waiting for what may still run on its connection (a
    /// handler panicked or was cut off mid-statement): the connection is closed, and what
    /// runs on it cancelled.
    fn close(&self, open: Self::Open) -> impl Future<Output = ()> + Send;

    /// True when `error` is the server failing a claim to let another transaction through
    /// (a deadlock between lanes): nothing is wrong with the store or the deliveries.
    fn lost_to_another_transaction(error: &StoreError) -> bool;

    /// Notes a rolled-back attempt on the key's row, best effort.
    fn note_failure(&self, request: &ClaimRequest, error: &str) -> impl Future<Output = ()> + Send;

    /// The delay suggested when a key is in flight under a three-step lease.
    fn in_flight_delay(&self) -> Duration;

    /// What makes `open` unable to commit although no handler answered a failure — a
    /// statement failed (or was cut off) that a handler ignored — if anything. PostgreSQL
    /// aborts the transaction then, and its next statement fails; MySQL carries on, so the
    /// lane asks.
    fn doomed(open: &Self::Open) -> Option<String>;
}

/// The note on a claim withdrawn from a batch ([`TransactionalRecord::withdraw`]).
pub(crate) const WITHDRAWN: &str =
    "the delivery went away before its handler ran (its claim was withdrawn from its batch)";

/// How many batches of per-delivery handlers run at once unless configured otherwise
/// ([`BatchedLayer::with_lanes`], which says how it was chosen).
pub const DEFAULT_LANES: usize = 4;

/// The most deliveries a batch of per-delivery handlers takes unless configured otherwise
/// ([`BatchedLayer::with_max_batch`], which says how it was chosen).
pub const DEFAULT_MAX_BATCH: usize = 32;

/// How many batches run at once with a [`BatchHandler`] unless configured otherwise
/// ([`BatchedLayer::with_lanes`], which says how it was chosen).
pub const DEFAULT_BATCH_HANDLER_LANES: usize = 2;

/// The most deliveries a [`BatchHandler`]'s batch takes unless configured otherwise
/// ([`BatchedLayer::with_max_batch`]).
pub const DEFAULT_BATCH_HANDLER_MAX_BATCH: usize = 64;

/// How long a batch takes in joiners unless configured otherwise
/// ([`BatchedLayer::with_max_linger`]).
pub const DEFAULT_MAX_LINGER: Duration = Duration::from_millis(10);

impl<R: TransactionalRecord> BatchedLayer<R> {
    /// The batched mode of `record` (same pool, table and in-flight delay), with the
    /// defaults [`DEFAULT_LANES`] and [`DEFAULT_MAX_BATCH`] for per-delivery handlers,
    /// [`DEFAULT_BATCH_HANDLER_LANES`] and [`DEFAULT_BATCH_HANDLER_MAX_BATCH`] for a
    /// [`BatchHandler`], and [`DEFAULT_MAX_LINGER`].
    pub(crate) fn new(record: R) -> Self {
        BatchedLayer {
            record,
            max_batch: None,
            max_linger: DEFAULT_MAX_LINGER,
            lanes: None,
        }
    }
}

/// The transactional record tier, batched: deliveries in flight at the same time share one
/// transaction and one commit. Built by `PgTransactionalLayer::batched` (as
/// `PgBatchedLayer`) or `MysqlTransactionalLayer::batched` (as `MysqlBatchedLayer`);
/// what follows holds for both, and where the stores differ it says so.
///
/// The per-delivery transactional record pays a transaction per message: `BEGIN` and the
/// claim, the handler's statements, `COMMIT` and its flush to disk. The batched layer lets
/// the deliveries in flight at the same moment share one:
///
/// 1. A delivery joins a *lane* (a few run at once, each with its own connection). An idle
///    lane opens a transaction for it at once, together with every delivery already waiting,
///    when no other lane has a transaction open (group commit, as PostgreSQL does for WAL
///    flushes: a lone delivery never waits for a timer). While another lane's transaction
///    is open, the idle lane keeps collecting deliveries until one of the open transactions
///    ends, its batch is full or the [maximum linger](BatchedLayer::with_max_linger) has
///    passed (Nagle's rule: a transaction started for the one delivery that just arrived
///    pays a `BEGIN`, a claim and a commit for it alone, while the database is busy with
///    another commit anyway; fed by a broker, batches held 4 or 5 deliveries before).
/// 2. The group's claims decide it at once (one multi-row statement on PostgreSQL; on
///    MySQL, which has no `RETURNING`, one when every key is new, else a statement per key):
///    new or `FAILURE` keys are claimed;
///    duplicates, payload conflicts, fenced and in-flight keys are answered at once (what
///    decided them is committed). Two copies of one key are never claimed in two open
///    transactions, the same or two lanes': a copy of a key an open batch holds waits behind
///    that batch. When the batch commits the key, a copy of the same payload is answered a
///    duplicate from the commit, without a statement; any other (another payload, a
///    rollback, the first copy sent to run alone) joins a later batch, where its claim finds
///    the key as the batch left it. A producer's
///    retry lands right behind its original: claimed in another lane's transaction, it
///    would make that whole batch wait on the original's row lock, or deadlock with it.
/// 3. The handlers of the claimed deliveries run inside the transaction. Deliveries that
///    arrive meanwhile, while no other lane is idle to take them, join the open transaction
///    (another claim) while the batch is below its
///    [maximum size](BatchedLayer::with_max_batch) and younger than its
///    [maximum linger](BatchedLayer::with_max_linger).
/// 4. One checked commit, as in the per-delivery mode (on PostgreSQL it proves the
///    transaction that claimed the keys is the one committing, not aborted and not
///    replaced; on MySQL it is an XA transaction no handler can end, and a statement that
///    failed through the handle fails it). Only then is any
///    claimed delivery answered, so the adapters ack after the commit.
///
/// # Isolation: optimistic batches
/// One delivery's failure never fails or rolls back its neighbours' effects. Batches are
/// optimistic: no savepoint per delivery (which costs about 40 % of the gain of batching on
/// PostgreSQL, and past 64 subtransactions per transaction much more). When a handler
/// fails — returns an error, panics, is cut off by a timeout, swallows a failed statement,
/// ends the transaction itself (its `COMMIT` fails: on PostgreSQL the record table's guard
/// trigger lets only the tier commit, and after its `ROLLBACK` the session is read-only; on
/// MySQL the XA transaction refuses both) — or a delivery
/// goes away before its turn, or the commit fails, the whole batch is rolled back. The
/// failing delivery answers its own failure (a retry or a dead letter, as in the
/// per-delivery mode) when its handler was the first to run in the transaction; when a
/// handler ran before it, it runs again *alone*, in a transaction of its own, exactly as the
/// per-delivery tier runs it (a failed statement another handler swallowed fails the next
/// one: only alone is its failure surely its own). Every other delivery of the batch, the
/// failing one out of the way, *joins another batch*, where its handler runs (again, if it
/// had run); a delivery whose batch is rolled back for others a third time runs alone (a
/// handler that swallows a failed statement fails its neighbour on PostgreSQL, not itself,
/// until it runs alone, where the commit check catches it). On MySQL a failed statement
/// does not abort the transaction; the lane sees a swallowed one through the handle as soon
/// as its handler returns and rolls the batch back: the deliveries whose handlers answered
/// success since the last check run alone (where the one that swallowed it fails on its
/// own), the earlier ones join another batch. Where whose fault it was is unknown, the
/// deliveries run alone: a set handler call that fails as a whole sends that call's
/// envelopes; a claim that fails (lost to another transaction, or in an aborted one) and a
/// commit that fails or whose answer is lost send the whole batch (a batch of one answers
/// the commit's failure as it would alone; a delivery whose batch did commit finds its key
/// `SUCCESS` and answers duplicate). Isolation is paid for only when something fails: more
/// handler runs, in batches, for the failing delivery's neighbours; and the tier opens no
/// subtransaction (on PostgreSQL the commit check's savepoint writes nothing, so it takes
/// no subtransaction id).
///
/// # Per-delivery handler or batch handler
/// - [`BatchedLayer::handler`] (or the layer over any [`TransactionSafe`] service) keeps
///   the handler you have: it is called once per delivery, on the lane's task (in the
///   delivery's tracing span; task-locals of the delivery's own task are not there), with
///   the shared transaction as its `PgTransaction` or
///   `MysqlTransaction`. The handlers of a batch run one after
///   another, so each sees the writes of the ones before it exactly as it would after their
///   commits, and read-modify-write handlers stay correct. What the batch saves is the
///   `BEGIN`, the claim and the `COMMIT` with its flush: the handlers' own statements still
///   take a round trip each.
/// - [`BatchedLayer::batch_handler`] takes a [`BatchHandler`], called once per batch with
///   every claimed envelope, which writes all their effects in a few set-based statements
///   (`INSERT … SELECT … FROM unnest($1, $2)`, `UPDATE … FROM (VALUES …)`; on MySQL a
///   multi-row `INSERT … VALUES (…), (…)`, `UPDATE … JOIN`) and answers per
///   envelope. Use it when the effect can be written for many messages at once: it saves
///   the per-message round trips too. Its statements see the whole batch at once: two
///   envelopes touching one row must be folded together (a `GROUP BY` before an `UPDATE …
///   FROM`), as one `UPDATE` cannot change a row twice.
///
/// # Limits
/// - A batch holds the row locks of all its handlers' writes until its commit: deliveries
///   of other lanes that update the same rows (a hot product's stock) wait for the whole
///   batch, and two lanes that update hot rows in opposite orders deadlock until the server
///   breaks the tie by failing one batch (PostgreSQL after `deadlock_timeout`, 1 s by
///   default; InnoDB at once), whose deliveries then run alone. Keep such rows out of per-message handlers (a set handler
///   that updates them in key order), or use one lane.
/// - A handler that never returns holds its whole batch. Per-delivery handlers: put a
///   `tower` timeout in front of the stack (a delivery whose future is dropped cuts its
///   handler off, and the connection is closed, which also cancels its statement), or
///   inside, around the handler. A set handler runs on the lane's task, which no timeout in
///   front reaches: bound its time inside it (`tokio::time::timeout`, returning an error). A
///   timeout inside drops the handler's future but not the statement it left running on the
///   server: on PostgreSQL the batch's `ROLLBACK` waits for that statement (a
///   `statement_timeout` or `lock_timeout` set by the handler with `SET LOCAL` bounds it);
///   on MySQL no later statement touches that connection: the batch is rolled back by
///   killing its session.
/// - PostgreSQL: `SET CONSTRAINTS ALL IMMEDIATE` in a handler fires the record table's guard
///   trigger early and fails: name your constraints instead. Session settings a handler
///   changes with a plain `SET` stay on the pooled connection: use `SET LOCAL` (MySQL has
///   no `SET LOCAL`: change no session setting). A handler that opens savepoints itself uses
///   subtransactions: keep its savepoints times the batch size below 64.
/// - The lanes take their connections from the tier's pool, and a delivery that runs alone
///   takes another: size the pool for the lanes plus the deliveries running alone.
///
/// Every guarantee of the per-delivery tier holds per delivery: the record and the
/// handler's writes commit together, a delivery is answered only after its batch's commit,
/// and anything that fails or is cut off leaves nothing committed for it.
///
/// ```no_run
/// use oncely::{BusinessKey, HandlerError};
/// use oncely::record::{PgTransaction, PgTransactionalLayer};
///
/// async fn deduct_stock(tx: PgTransaction, order: BusinessKey) -> Result<(), HandlerError> {
///     tx.execute("INSERT INTO stock_moves (order_id) VALUES ($1)", &[&order.as_str()]).await?;
///     Ok(())
/// }
/// # fn stack(pool: oncely::postgres::deadpool_postgres::Pool, table: oncely::postgres::Table) {
/// let records = PgTransactionalLayer::new(pool, table).batched();
/// let service = records.handler(deduct_stock);
/// # }
/// ```
#[derive(Clone)]
pub struct BatchedLayer<R> {
    record: R,
    /// `None`: the default of the handler's kind.
    max_batch: Option<usize>,
    max_linger: Duration,
    /// `None`: the default of the handler's kind.
    lanes: Option<usize>,
}

impl<R: TransactionalRecord> BatchedLayer<R> {
    /// The most deliveries one transaction takes (at least 1; default [`DEFAULT_MAX_BATCH`]
    /// with per-delivery handlers, [`DEFAULT_BATCH_HANDLER_MAX_BATCH`] with a
    /// [`BatchHandler`]).
    ///
    /// Fuller batches cost less CPU per delivery, and a failure rolls back more: the failing
    /// delivery's neighbours run their handlers again in another batch, and a delivery whose
    /// batch is rolled back for others a third time runs alone (the isolation of
    /// [`BatchedLayer`]). With independent failures of 1 % of deliveries, about 28 % of
    /// 32-delivery batches fail and about 47 % of 64-delivery ones: a handler runs about 1.4
    /// times per delivery in the first, about 1.8 times in the second, and about 2 % and
    /// 11 % of deliveries end up in a transaction of their own. Where handlers fail often (a
    /// downstream service that times out), lower it.
    ///
    /// Why per-delivery handlers keep 32 (issue 25, the 2-core development machine, runs of
    /// 6 rounds taking turns):
    /// - at the RabbitMQ runner's 512 in flight, the full stack ran at 0.307× to 0.390× the
    ///   raw lapin consumer with 4 lanes of 64 (7 runs, median 0.361×), against 0.352× and
    ///   0.363× with 4 lanes of 32: inside the runs' spread;
    /// - at 64 in flight, the tier's own benchmark ran 2.73× and 2.82× the unbatched
    ///   transactional record with batches of 64, against 2.84× and 2.91× with 32: there a
    ///   lane that finds 64 deliveries waiting takes them all and runs their handlers one
    ///   after another while other lanes idle;
    /// - sharing what waits evenly between the idle lanes (batches of 64) cost more than it
    ///   bought at 512 in flight: 0.324× and 0.329× the raw consumer, against 0.371× and
    ///   0.390× taking it whole in the same runs (small batches spend the CPU that full ones
    ///   save); an even share of at least half a batch ran the tier's benchmark at 2.65× and
    ///   2.68× the unbatched record.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = Some(max_batch.max(1));
        self
    }

    /// How long after its `BEGIN` a batch still takes in deliveries that arrive while its
    /// handlers run, and how long an idle lane keeps collecting deliveries while another
    /// lane's transaction is open (it starts sooner when one ends or its batch is full). An
    /// open batch never waits for joiners: one whose handlers are done commits at once.
    /// Longer lingers make bigger batches under a steady stream, and make the first
    /// deliveries of a batch wait longer for their commit (and their ack). Default
    /// [`DEFAULT_MAX_LINGER`].
    pub fn with_max_linger(mut self, max_linger: Duration) -> Self {
        self.max_linger = max_linger;
        self
    }

    /// How many batches run at once, each on its own pooled connection (at least 1; default
    /// [`DEFAULT_LANES`] with per-delivery handlers, [`DEFAULT_BATCH_HANDLER_LANES`] with a
    /// [`BatchHandler`]).
    ///
    /// A connection runs its batch's statements one after another, a round trip each: the
    /// per-delivery handlers, a statement or more each, go as fast as lanes side by side
    /// keep the database busy; a batch handler writes a batch in a few statements, and fuller
    /// batches cost less per delivery. Hence the two defaults, measured on the 2-core
    /// development machine (issue 25) with the RabbitMQ runner at 256 in flight, the full
    /// stack and the PostgreSQL record batched, against a raw lapin consumer (short runs,
    /// taking turns; median, runs): with a batch handler 2 lanes of 64 ran at 0.51× (7),
    /// 2 of 32 at 0.53× (4), 4 of 32 at 0.46× (4), 4 of 16 at 0.40× (5); with per-delivery
    /// handlers 4 lanes of 32 at 0.345× (4), 2 of 64 at 0.34× (7), 4 of 16 at 0.30× (5). In
    /// the tier's own benchmark at 64 in flight, per-delivery handlers ran at 21,100/s on
    /// PostgreSQL and 21,900/s on MariaDB with 4 lanes of 32, against 18,100/s and 17,300/s
    /// with 2 of 64. With a batch handler 2 of 32 matched 2 of 64 within the runs' spread;
    /// 64 keeps room for fuller batches at higher rates. Other lane counts did not beat four
    /// for per-delivery handlers (a later machine, the same stack against the same raw
    /// consumer, 12 rounds a run; ratios, runs): 4 lanes of 32 at 0.335× to 0.367× (5), 3 at
    /// 0.342× to 0.357× (2), 6 at 0.328× to 0.330× (2), 8 at 0.326× to 0.330× (3), 2 at 0.313×
    /// (1), on a machine already about 90 % busy in that row.
    pub fn with_lanes(mut self, lanes: usize) -> Self {
        self.lanes = Some(lanes.max(1));
        self
    }

    /// The typed handler `f` behind this tier, as the per-delivery tier's `handler` builds
    /// it: an `async fn` whose arguments come from the envelope, which may take the batch's
    /// open transaction (`PgTransaction`,
    /// `MysqlTransaction`).
    pub fn handler<F, Args>(&self, f: F) -> BatchedService<TypedHandler<F, InTransaction, Args>, R>
    where
        F: Handler<InTransaction, Args>,
    {
        self.layer(typed(f))
    }

    /// The set handler `handler` behind this tier: called once per batch with every claimed
    /// envelope; see [`BatchHandler`].
    pub fn batch_handler<H: BatchHandler<R::Handle>>(&self, handler: H) -> BatchHandlerService<H, R> {
        let limits = self.limits(DEFAULT_BATCH_HANDLER_LANES, DEFAULT_BATCH_HANDLER_MAX_BATCH);
        BatchHandlerService::new(handler, self.record.clone(), limits)
    }

    /// The limits set, or else the given defaults of the handler's kind.
    fn limits(&self, lanes: usize, max_batch: usize) -> Limits {
        Limits {
            max_batch: self.max_batch.unwrap_or(max_batch),
            max_linger: self.max_linger,
            lanes: self.lanes.unwrap_or(lanes),
        }
    }
}

impl<R: fmt::Debug> fmt::Debug for BatchedLayer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchedLayer")
            .field("record", &self.record)
            .field("max_batch", &self.max_batch)
            .field("max_linger", &self.max_linger)
            .field("lanes", &self.lanes)
            .finish()
    }
}

/// Each call builds a service with lanes of its own, shared by that service's clones.
impl<S: TransactionSafe, R: TransactionalRecord> Layer<S> for BatchedLayer<R> {
    type Service = BatchedService<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(
            inner,
            BatchLanes::new(Lanes::new(
                self.record.clone(),
                Turns,
                self.limits(DEFAULT_LANES, DEFAULT_MAX_BATCH),
            )),
        )
    }
}
