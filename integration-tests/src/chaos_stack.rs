//! The consumer side of the chaos ledger run (`make chaos`): the stacks in front of a
//! handler that misbehaves on purpose — the stock-deduction stack for RabbitMQ, the
//! `rocketmq-points` stack for RocketMQ — and the tables the run reads its verdict from, in
//! PostgreSQL or in MySQL/MariaDB ([`ChaosStore`]).
//!
//! The handler writes each order's effect as two rows in two statements (`stock_moves`
//! parts 1 and 2), so an effect committed in half shows as a key with one part. With
//! [`HandlerFaults`], a small random share of its calls — drawn per call, not per key, so a
//! retry of the same key passes — misbehaves in one of three ways:
//!
//! - panics between the two writes;
//! - sleeps between the two writes past the [`tower::timeout`] placed outermost in the
//!   stack, so the whole stack's future is dropped with the record's transaction open;
//! - runs a statement that fails after both writes, ignores the error and returns `Ok`, so
//!   the record tier commits an aborted transaction.
//!
//! A message whose body says `"poison": true` SIGKILLs the process that handles it, every
//! time, as a handler that crashes on one message would.
//!
//! Each fault is logged in `chaos_faults` just before it fires, through a pool of its own
//! outside the record's transaction (whose rollback would discard the entry), so the run
//! counts exactly the faults that took effect: one whose entry could not be written (its
//! connection was just terminated) is not fired.

use std::convert::Infallible;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::process::Command;
use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Client, Pool};
use oncely::deliveries::RedisDeliveryCounter;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::mysql::sqlx::{self, MySqlPool};
use oncely::record::{MysqlTransaction, PgTransaction};
use oncely::{BoxError, Envelope, HandlerError, KeyExtractor, Outcome, Route, handler_fn};
use redis::aio::ConnectionManager;
use tower::ServiceBuilder;
use tower::layer::util::{Identity, Stack};
use tower::timeout::TimeoutLayer;

use crate::mysql::lazy_pool_on;
use crate::postgres::{BoxedStack, RecordMode, boxed, schema_pool};

/// How many deliveries each of `amqp_consumer`'s runners takes at a time unless it runs with
/// `--default-prefetch` (the runner's default): few to redeliver after a kill.
pub const CHAOS_PREFETCH: u16 = 16;

/// The environment variable that turns `amqp_consumer` to the chaos stack, and sets the
/// handler faults of `rocketmq_consumer` (which runs only the chaos stack): the share of
/// handler calls, in percent, that get each handler fault (`0.5`: one call in 200 panics,
/// another one in 200 times out, another swallows a failed statement). Set to `0`, the
/// chaos stack runs without handler faults (poison messages still kill).
pub const FAULTS_ENV: &str = "ONCELY_CHAOS_FAULTS";

/// The environment variable naming the Redis that `rocketmq_consumer` keeps its delivery
/// counts in (default: `REDIS_URL`'s). The chaos run gives it a Redis of its own that the
/// faults leave alone: a count lost with Redis's data lets a crashing message run up to the
/// limit again, and a Redis that loses its data every few seconds, as the run's does, would
/// never let a poison message reach the limit.
pub const DELIVERIES_REDIS_ENV: &str = "ONCELY_DELIVERIES_REDIS_URL";

/// How many times the RocketMQ chaos route lets a key crash its consumer while running alone
/// before it dead-letters it (`delivery_limit`): RocketMQ does not count the redeliveries
/// of a consumer that died, so the route counts them, in Redis.
pub const DELIVERY_LIMIT: u32 = 5;

/// The `tower::timeout` in front of the stack. A normal delivery takes milliseconds, also
/// under the run's store faults (a stopped Redis or a terminated connection fails at once);
/// a timeout that fires on one anyway only costs a retry.
pub const HANDLER_TIMEOUT: Duration = Duration::from_secs(1);

/// The flag's and lock's leases: longer than the timeout bounds any run of the stack, and
/// shorter than the run's 5-second throughput window, so that the claim of a dropped or
/// killed delivery (held until its lease runs out) cannot by itself empty a window.
const LEASE: Duration = Duration::from_secs(3);

/// The database a chaos run keeps the record, the effects and the fault log in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ChaosStore {
    /// PostgreSQL on `DATABASE_URL`, in a schema of the run's own.
    Postgres,
    /// MySQL or MariaDB on `MYSQL_URL`, in a database of the run's own.
    Mysql,
}

impl ChaosStore {
    /// The store as the run's report names it.
    pub fn name(self) -> &'static str {
        match self {
            ChaosStore::Postgres => "PostgreSQL",
            ChaosStore::Mysql => "MySQL/MariaDB",
        }
    }

    /// The tables the chaos stack writes, to create in the run's schema or database: the
    /// two-part effect with each row's write time, and the log of handler faults that fired.
    pub fn tables(self) -> &'static str {
        match self {
            ChaosStore::Postgres => {
                "CREATE TABLE stock_moves (
                     id BIGSERIAL PRIMARY KEY,
                     order_id TEXT NOT NULL,
                     part SMALLINT NOT NULL,
                     created_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
                 );
                 CREATE TABLE chaos_faults (
                     kind TEXT NOT NULL,
                     order_id TEXT NOT NULL,
                     at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
                 );"
            }
            // `DATETIME(6)` in the session's time zone, which sqlx sets to UTC on every
            // connection, the consumers' and the run's alike.
            ChaosStore::Mysql => {
                "CREATE TABLE stock_moves (
                     id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                     order_id VARCHAR(64) NOT NULL,
                     part SMALLINT NOT NULL,
                     created_at DATETIME(6) NOT NULL DEFAULT NOW(6),
                     KEY (order_id)
                 ) ENGINE = InnoDB;
                 CREATE TABLE chaos_faults (
                     kind VARCHAR(32) NOT NULL,
                     order_id VARCHAR(64) NOT NULL,
                     at DATETIME(6) NOT NULL DEFAULT NOW(6)
                 ) ENGINE = InnoDB;"
            }
        }
    }
}

/// Connections to the run's schema (PostgreSQL) or database (MySQL/MariaDB), where the chaos
/// stack keeps its record, writes its effects and logs its faults.
#[derive(Clone)]
pub enum ChaosDatabase {
    /// PostgreSQL: a pool whose connections search `schema` first.
    Postgres {
        /// The pool.
        pool: Pool,
        /// The run's schema.
        schema: String,
    },
    /// MySQL or MariaDB: a pool on the run's database.
    Mysql(MySqlPool),
}

impl ChaosDatabase {
    /// A pool of up to `size` connections of `store` to the run's `schema` (its database,
    /// on MySQL/MariaDB), connecting when first used.
    pub fn new(store: ChaosStore, schema: &str, size: usize) -> Self {
        match store {
            ChaosStore::Postgres => ChaosDatabase::Postgres {
                pool: schema_pool(schema, size),
                schema: schema.to_owned(),
            },
            ChaosStore::Mysql => ChaosDatabase::Mysql(lazy_pool_on(schema, size as u32)),
        }
    }

    /// `handler` behind the transactional record (`consumption_record`) in `mode`.
    fn record_stack<S>(&self, mode: RecordMode, handler: S) -> BoxedStack
    where
        S: tower::Service<Envelope, Response = Outcome>
            + oncely::record::TransactionSafe
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        match self {
            ChaosDatabase::Postgres { pool, schema } => {
                let records = oncely::postgres::Table::new(schema, "consumption_record");
                mode.stack(pool, records.expect("a valid schema"), handler)
            }
            ChaosDatabase::Mysql(pool) => {
                let records = oncely::mysql::Table::new("consumption_record").expect("a valid name");
                mode.mysql_stack(pool, records, handler)
            }
        }
    }

    /// Logs `fault` for `order` in `chaos_faults`, in a transaction of its own; false if it
    /// could not.
    async fn log(&self, fault: HandlerFault, order: &str) -> bool {
        match self {
            ChaosDatabase::Postgres { pool, .. } => {
                let Ok(client) = pool.get().await else {
                    return false;
                };
                let insert = "INSERT INTO chaos_faults (kind, order_id) VALUES ($1, $2)";
                client.execute(insert, &[&fault.code(), &order]).await.is_ok()
            }
            ChaosDatabase::Mysql(pool) => {
                sqlx::query("INSERT INTO chaos_faults (kind, order_id) VALUES (?, ?)")
                    .bind(fault.code())
                    .bind(order)
                    .execute(pool)
                    .await
                    .is_ok()
            }
        }
    }
}

/// A fault the chaos handler injects into itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HandlerFault {
    /// A panic between the two writes.
    Panic,
    /// A sleep between the two writes, past [`HANDLER_TIMEOUT`].
    Timeout,
    /// A failed statement after the writes, ignored: the handler returns `Ok`.
    SwallowedError,
    /// A poison message: the handling process SIGKILLs itself.
    Poison,
}

impl HandlerFault {
    /// Every kind, in report order.
    pub const ALL: [HandlerFault; 4] = [
        HandlerFault::Panic,
        HandlerFault::Timeout,
        HandlerFault::SwallowedError,
        HandlerFault::Poison,
    ];

    /// The kind as logged in `chaos_faults.kind`.
    pub fn code(self) -> &'static str {
        match self {
            HandlerFault::Panic => "panic",
            HandlerFault::Timeout => "timeout",
            HandlerFault::SwallowedError => "swallowed_error",
            HandlerFault::Poison => "poison",
        }
    }

    /// The kind logged as `code`.
    pub fn from_code(code: &str) -> Option<Self> {
        HandlerFault::ALL.into_iter().find(|fault| fault.code() == code)
    }

    /// The kind as the run's report names it.
    pub fn name(self) -> &'static str {
        match self {
            HandlerFault::Panic => "handler panic",
            HandlerFault::Timeout => "handler past tower timeout",
            HandlerFault::SwallowedError => "swallowed failed statement",
            HandlerFault::Poison => "poison message SIGKILL",
        }
    }
}

/// The handler faults of one consumer process: how often each fires, and the pool (in
/// autocommit, outside any record transaction) that logs them.
#[derive(Clone)]
pub struct HandlerFaults {
    share: f64,
    log: ChaosDatabase,
}

impl HandlerFaults {
    /// Each of panic, timeout and swallowed error on `percent` % of the handler's calls
    /// (at most one per call), logged through `log`, a pool of their own on the run's
    /// schema or database.
    pub fn new(percent: f64, log: ChaosDatabase) -> Self {
        HandlerFaults {
            share: percent.clamp(0.0, 100.0 / 3.0) / 100.0,
            log,
        }
    }

    /// The handler faults `ONCELY_CHAOS_FAULTS` asks for, logged in `chaos_faults` of
    /// `store`'s `schema` (a database, on MySQL/MariaDB) through a small pool of their own;
    /// `None` when it is not set. Exits the process (status 2) when it is not a number.
    pub fn from_env(store: ChaosStore, schema: &str) -> Option<Self> {
        let percent = std::env::var(FAULTS_ENV).ok()?;
        let percent = percent.parse::<f64>().unwrap_or_else(|error| {
            eprintln!("{FAULTS_ENV}={percent:?}: {error}");
            std::process::exit(2);
        });
        Some(HandlerFaults::new(percent, ChaosDatabase::new(store, schema, 2)))
    }

    /// The fault this call gets, if any: random per call, so a retry draws again.
    fn draw(&self) -> Option<HandlerFault> {
        // A fresh `RandomState` has fresh keys, so hashing nothing gives a random number
        // without a dependency on a random number crate.
        let roll = (RandomState::new().hash_one(()) >> 11) as f64 / (1u64 << 53) as f64;
        [
            HandlerFault::Panic,
            HandlerFault::Timeout,
            HandlerFault::SwallowedError,
        ]
        .into_iter()
        .enumerate()
        .find(|(rank, _)| roll < self.share * (*rank + 1) as f64)
        .map(|(_, fault)| fault)
    }

    /// Logs `fault` for `order` and says whether it may fire: true only if it is logged, so
    /// the run's count of faults is exact.
    async fn log(&self, fault: HandlerFault, order: &str) -> bool {
        self.log.log(fault, order).await
    }

    /// True if `drawn` is `fault` and its log entry was written: the caller fires it now.
    async fn fires(&self, drawn: Option<HandlerFault>, fault: HandlerFault, order: &str) -> bool {
        drawn == Some(fault) && self.log(fault, order).await
    }
}

/// Where the handler writes its two rows.
#[derive(Clone)]
enum Effects {
    /// In the transaction the record tier hands on: the stacks with a record.
    InRecordTransaction,
    /// Each statement on its own (autocommit) on PostgreSQL: the flag-only stack, with no
    /// record.
    Autocommit(Pool),
}

/// The chaos stock-deduction handler: two rows per order, and the faults.
#[derive(Clone)]
struct ChaosHandler {
    effects: Effects,
    faults: HandlerFaults,
}

impl ChaosHandler {
    async fn handle(self, envelope: Envelope) -> Result<(), HandlerError> {
        let order = envelope.key().as_str();
        if is_poison(&envelope) {
            // Logged on a best effort: a poison message kills whether or not its entry is
            // written, as a real one would.
            self.faults.log(HandlerFault::Poison, order).await;
            kill_this_process();
        }
        let pooled;
        let session = match &self.effects {
            Effects::InRecordTransaction => EffectSession::in_record_transaction(&envelope),
            Effects::Autocommit(pool) => {
                pooled = pool.get().await?;
                EffectSession::Postgres(&pooled)
            }
        };
        let fault = self.faults.draw();
        session.write_part(order, 1).await?;
        if self.faults.fires(fault, HandlerFault::Panic, order).await {
            panic!("chaos: injected panic between the two writes of {order}");
        }
        if self.faults.fires(fault, HandlerFault::Timeout, order).await {
            tokio::time::sleep(HANDLER_TIMEOUT * 3).await;
        }
        session.write_part(order, 2).await?;
        if self
            .faults
            .fires(fault, HandlerFault::SwallowedError, order)
            .await
        {
            // The bug being injected: the error is dropped and the handler reports success.
            let _ = session.failing_statement().await;
        }
        Ok(())
    }
}

/// Where one call of the chaos handler writes.
enum EffectSession<'a> {
    /// A PostgreSQL connection: the record's transaction, or a pooled one in autocommit.
    Postgres(&'a Client),
    /// The MySQL record's transaction.
    Mysql(MysqlTransaction),
}

impl<'a> EffectSession<'a> {
    /// The transaction the record tier in front put in `envelope`'s extensions.
    fn in_record_transaction(envelope: &'a Envelope) -> Self {
        let extensions = envelope.extensions();
        match (
            extensions.get::<PgTransaction>(),
            extensions.get::<MysqlTransaction>(),
        ) {
            (Some(tx), _) => EffectSession::Postgres(tx.client()),
            (None, Some(tx)) => EffectSession::Mysql(tx.clone()),
            (None, None) => panic!("the transactional record tier in front"),
        }
    }

    async fn write_part(&self, order: &str, part: i16) -> Result<(), HandlerError> {
        match self {
            EffectSession::Postgres(client) => {
                let insert = "INSERT INTO stock_moves (order_id, part) VALUES ($1, $2)";
                client.execute(insert, &[&order, &part]).await?;
            }
            EffectSession::Mysql(tx) => {
                sqlx::query("INSERT INTO stock_moves (order_id, part) VALUES (?, ?)")
                    .bind(order)
                    .bind(part)
                    .execute(tx)
                    .await?;
            }
        }
        Ok(())
    }

    /// A statement that fails on either store (a column that does not exist).
    async fn failing_statement(&self) -> Result<(), HandlerError> {
        const FAILS: &str = "SELECT no_such_column FROM stock_moves";
        match self {
            EffectSession::Postgres(client) => {
                client.execute(FAILS, &[]).await?;
            }
            EffectSession::Mysql(tx) => {
                sqlx::query(FAILS).execute(tx).await?;
            }
        }
        Ok(())
    }
}

fn is_poison(envelope: &Envelope) -> bool {
    serde_json::from_slice::<serde_json::Value>(envelope.delivery().body())
        .ok()
        .and_then(|body| body.pointer("/poison")?.as_bool())
        .unwrap_or(false)
}

/// Ends this process with SIGKILL: no unwinding, no destructors, no goodbye to the broker,
/// like an OOM kill. (`std::process::exit` would be an orderly exit, not a crash.)
fn kill_this_process() -> ! {
    let _ = Command::new("kill")
        .args(["-9", &std::process::id().to_string()])
        .status();
    // Only reached if `kill` could not run: an abort is a crash too.
    std::process::abort()
}

/// The stack of the chaos run's RabbitMQ consumers (`chaos --stack`, and `amqp_consumer`'s
/// STACK argument, with or without [`FAULTS_ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChaosStack {
    /// The Redis flag, the Redis lock and the record: [`chaos_orders_route`].
    Full,
    /// The Redis flag alone, for comparison: [`chaos_flag_only_route`].
    FlagOnly,
    /// The Redis flag with the record behind it and the record, no lock:
    /// [`chaos_flag_record_route`].
    FlagRecord,
    /// The full stack with the record batched: [`chaos_orders_route`] with
    /// [`RecordMode::Batched`].
    Batched,
}

impl ChaosStack {
    /// Every stack.
    pub const ALL: [ChaosStack; 4] = [
        ChaosStack::Full,
        ChaosStack::FlagOnly,
        ChaosStack::FlagRecord,
        ChaosStack::Batched,
    ];

    /// The stack as command lines name it.
    pub fn name(self) -> &'static str {
        match self {
            ChaosStack::Full => "full",
            ChaosStack::FlagOnly => "flag-only",
            ChaosStack::FlagRecord => "flag-record",
            ChaosStack::Batched => "batched",
        }
    }
}

impl FromStr for ChaosStack {
    type Err = String;

    /// The stack named `name` ([`ChaosStack::name`]).
    fn from_str(name: &str) -> Result<Self, String> {
        let known = || ChaosStack::ALL.map(ChaosStack::name).join(" or ");
        (ChaosStack::ALL.into_iter())
            .find(|stack| stack.name() == name)
            .ok_or_else(|| format!("unknown stack {name:?}: {}", known()))
    }
}

impl fmt::Display for ChaosStack {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        out.write_str(self.name())
    }
}

/// The full stack of the chaos run: a `tower::timeout` outermost, then the Redis flag, the
/// Redis lock on the body's `/sku` and the transactional record in `database` (`mode`: per
/// delivery or batched), to the chaos handler writing in the record's transaction. Keyed by
/// the body's `/orderId`; Redis keys start with `prefix`.
///
/// Per delivery, the flag and the lock are two layers; batched, the fast path's
/// [`FlagLockLayer`] with its scripts coalesced, the same two tiers in two round trips
/// shared by the deliveries in flight: the run holds either to the same promise.
pub fn chaos_orders_route(
    database: ChaosDatabase,
    redis: ConnectionManager,
    prefix: &str,
    faults: HandlerFaults,
    mode: RecordMode,
) -> Route<impl crate::RouteStack<BoxError> + use<>> {
    let flag = chaos_flag(redis.clone(), prefix, false);
    let lock = LockLayer::new(
        RedisLockStore::new(redis).with_prefix(prefix),
        KeyExtractor::json_pointer("/sku"),
    )
    .with_lease(LEASE)
    .with_busy_delay(Duration::from_millis(100));
    let records = database.record_stack(mode, handler_service(Effects::InRecordTransaction, faults));
    let timeout = ServiceBuilder::new().layer(TimeoutLayer::new(HANDLER_TIMEOUT));
    let stack = match mode {
        RecordMode::PerDelivery => boxed(timeout.layer(flag).layer(lock).service(records)),
        RecordMode::Batched => boxed(
            timeout
                .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
                .service(records),
        ),
    };
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The RocketMQ chaos route, shaped as `examples/rocketmq-points`' `credit-points`: keyed by
/// the message's KEYS in the namespace `credit_points`, with a [`DELIVERY_LIMIT`] counted in
/// the Redis of `deliveries` (RocketMQ does not count the redeliveries of a consumer that
/// died), through a `tower::timeout` outermost, the Redis flag (on `redis`, with the record
/// behind it) and the transactional record in `database`, to the chaos handler writing in
/// the record's transaction. Redis keys start with `prefix`.
pub fn chaos_points_route(
    database: ChaosDatabase,
    redis: ConnectionManager,
    deliveries: ConnectionManager,
    prefix: &str,
    faults: HandlerFaults,
) -> Route<impl crate::RouteStack<BoxError> + use<>> {
    let stack = flag_and_record(database, redis, prefix, faults);
    Route::new(
        "credit_points",
        KeyExtractor::broker_key().with_namespace("credit_points"),
        stack,
    )
    .with_delivery_limit(
        RedisDeliveryCounter::new(deliveries).with_prefix(prefix),
        DELIVERY_LIMIT,
    )
}

/// The flag-only stack for comparison, with the same timeout and handler faults: the Redis
/// flag in front of the chaos handler writing each row on its own in PostgreSQL (no record,
/// no transaction). `pool`'s connections must search the run's schema first.
pub fn chaos_flag_only_route(
    pool: Pool,
    redis: ConnectionManager,
    prefix: &str,
    faults: HandlerFaults,
) -> Route<impl crate::RouteStack<BoxError> + use<>> {
    let stack =
        timeout_and_flag(redis, prefix, false).service(handler_service(Effects::Autocommit(pool), faults));
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The red-packet shape with the same timeout and handler faults: the Redis flag with the
/// record behind it ([`FlagLayer::with_record_behind`]) in front of the transactional record
/// in `database`, no lock, to the chaos handler writing in the record's transaction.
pub fn chaos_flag_record_route(
    database: ChaosDatabase,
    redis: ConnectionManager,
    prefix: &str,
    faults: HandlerFaults,
) -> Route<impl crate::RouteStack<BoxError> + use<>> {
    let stack = flag_and_record(database, redis, prefix, faults);
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The timeout, the flag with the record behind it and the record, in front of the chaos
/// handler writing in the record's transaction.
fn flag_and_record(
    database: ChaosDatabase,
    redis: ConnectionManager,
    prefix: &str,
    faults: HandlerFaults,
) -> impl crate::RouteStack<BoxError> + use<> {
    let handler = handler_service(Effects::InRecordTransaction, faults);
    timeout_and_flag(redis, prefix, true).service(database.record_stack(RecordMode::PerDelivery, handler))
}

/// The chaos handler writing its effect as `effects` says, with `faults`.
fn handler_service(
    effects: Effects,
    faults: HandlerFaults,
) -> impl tower::Service<Envelope, Response = Outcome, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ oncely::record::TransactionSafe {
    let handler = ChaosHandler { effects, faults };
    handler_fn(move |envelope: Envelope| handler.clone().handle(envelope))
}

/// The Redis flag of every chaos stack.
type ChaosFlag = FlagLayer<RedisFlagStore<ConnectionManager>>;

/// The front of the chaos stacks without a lock: the `tower::timeout` outermost, so that a
/// timeout drops the whole stack's future (mid-transaction, where the stack has a record),
/// then the Redis flag.
fn timeout_and_flag(
    redis: ConnectionManager,
    prefix: &str,
    record_behind: bool,
) -> ServiceBuilder<Stack<ChaosFlag, Stack<TimeoutLayer, Identity>>> {
    ServiceBuilder::new()
        .layer(TimeoutLayer::new(HANDLER_TIMEOUT))
        .layer(chaos_flag(redis, prefix, record_behind))
}

/// The Redis flag of every chaos stack on `redis`, its keys starting with `prefix`.
fn chaos_flag(redis: ConnectionManager, prefix: &str, record_behind: bool) -> ChaosFlag {
    let flag = FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix(prefix),
        Duration::from_secs(600),
    )
    .with_lease(LEASE)
    .with_in_flight_delay(Duration::from_millis(100));
    if record_behind {
        flag.with_record_behind()
    } else {
        flag
    }
}
