//! `amqp`: end-to-end messages per second through the RabbitMQ runner with no tiers, with
//! the Redis flag, with the PostgreSQL record alone (per delivery and batched), and with the
//! full stack (the Redis flag with the record behind it, the Redis lock and the record, on
//! PostgreSQL and on MySQL/MariaDB) — the record one transaction per delivery, batched
//! with per-delivery handlers (on PostgreSQL also with the handler's row deferred to the
//! commit), and batched with a batch handler — next to a raw lapin consumer that acks each
//! message from its own task. The runner runs at its defaults (prefetch
//! [`DEFAULT_PREFETCH`]) on a connection of its own (`run_with_reconnect`, which batches its
//! acks), the path a user runs; the raw consumer, the targets' baseline, at [`PREFETCH`],
//! and once more at the runner's prefetch for scale. Beside each rate: the CPU each message
//! cost the bench process (the consumer) and the whole machine (RabbitMQ, Redis and the
//! databases too), from `/proc`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures_lite::StreamExt;
use integration_tests::amqp::{connect, ready_messages, scratch_topology};
use integration_tests::mysql::{self, StockDatabase};
use integration_tests::postgres::{
    BoxedStack, RecordMode, ScratchSchema, boxed, defer_stock_move, insert_stock_move, pool, schema_pool,
    stock_moves,
};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{redis_connection, unique};
use lapin::Channel;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::mysql::sqlx::MySqlPool;
use oncely::record::{
    BatchAnswer, MysqlTransaction, MysqlTransactionalLayer, PgTransactionalLayer, TransactionSafe,
};
use oncely::tier::BoxFuture;
use oncely::{BoxError, Envelope, HandlerError, KeyExtractor, Outcome, Route, Token, handler_fn};
use oncely_amqp::{DEFAULT_PREFETCH, Runner, Topology};
use tokio_util::sync::CancellationToken;
use tower::Layer;
use tower::ServiceBuilder;

use crate::cpu::{BUDGET_HEADING, CpuTime, Server, budget_line, cpu_table};
use crate::measure::median;
use crate::report::{Plot, Report, Row, Section, Target};

/// Messages per measurement, published before the clock starts.
const MESSAGES: usize = 10_000;
/// Prefetch, and so messages in flight, of the raw consumer the targets compare with.
const PREFETCH: u16 = 64;
/// Each consumer is measured this many times, in turn with the others; the median is kept.
const ROUNDS: usize = 5;

/// The consumer a measurement drains its queue with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Consumer {
    /// The baseline: a plain lapin loop at [`PREFETCH`].
    RawLapin,
    /// The same loop at the runner's default prefetch: what more in flight alone buys.
    RawLapinAtRunnerPrefetch,
    /// The runner with a handler and no tier.
    Runner,
    /// The runner with the Redis flag in front of the handler.
    RunnerFlag,
    /// The runner with the PostgreSQL record alone, one transaction per delivery, the
    /// handler writing a row in the record's transaction.
    Record,
    /// The same with the record batched: what batching buys end to end, at the same
    /// prefetch.
    RecordBatched,
    /// The record batched with a batch handler writing the rows of a batch at once, alone:
    /// the guarantee at its cheapest.
    RecordBatchHandler,
    /// The same behind the Redis flag with the record behind it: what the flag costs when
    /// nothing is a duplicate.
    FlagRecordBatchHandler,
    /// The runner with the full stack (the flag and the lock as one tier, `FlagLockLayer`),
    /// the record one transaction per delivery, the handler writing a row in the record's
    /// transaction.
    FullStack,
    /// The same with the record batched.
    FullStackBatched,
    /// The same with the handler deferring its row to the batch's commit
    /// (`PgTransaction::defer`): one statement per batch writes the rows, as a batch handler
    /// would, from a per-delivery handler.
    FullStackBatchedDeferred,
    /// The same with the record batched and a batch handler writing the rows of a batch at
    /// once.
    FullStackBatchHandler,
    /// The same with the flag and the lock as two layers: what the joint tier saves.
    FullStackBatchHandlerTwoLayers,
    /// The full stack with the record on MySQL/MariaDB, one transaction per delivery.
    MysqlFullStack,
    /// The same with the record batched.
    MysqlFullStackBatched,
    /// The same with the record batched and a batch handler.
    MysqlFullStackBatchHandler,
}

impl Consumer {
    /// Every consumer, the baseline first: the order they take turns in.
    const ALL: [Consumer; 16] = [
        Consumer::RawLapin,
        Consumer::RawLapinAtRunnerPrefetch,
        Consumer::Runner,
        Consumer::RunnerFlag,
        Consumer::Record,
        Consumer::RecordBatched,
        Consumer::RecordBatchHandler,
        Consumer::FlagRecordBatchHandler,
        Consumer::FullStack,
        Consumer::FullStackBatched,
        Consumer::FullStackBatchedDeferred,
        Consumer::FullStackBatchHandler,
        Consumer::FullStackBatchHandlerTwoLayers,
        Consumer::MysqlFullStack,
        Consumer::MysqlFullStackBatched,
        Consumer::MysqlFullStackBatchHandler,
    ];

    fn name(self) -> &'static str {
        match self {
            Consumer::RawLapin => "raw lapin consumer",
            Consumer::RawLapinAtRunnerPrefetch => "raw lapin consumer at the runner's prefetch",
            Consumer::Runner => "runner, no tiers",
            Consumer::RunnerFlag => "runner, Redis flag",
            Consumer::Record => "runner, record per delivery (no Redis tiers)",
            Consumer::RecordBatched => "runner, batched record (no Redis tiers)",
            Consumer::RecordBatchHandler => "runner, batched record + batch handler (no Redis tiers)",
            Consumer::FlagRecordBatchHandler => {
                "runner, Redis flag + batched record + batch handler (no lock)"
            }
            Consumer::FullStack => "runner, full stack (flag + lock + record per delivery)",
            Consumer::FullStackBatched => "runner, full stack, batched record",
            Consumer::FullStackBatchedDeferred => {
                "runner, full stack, batched record, the handler's row deferred to the commit"
            }
            Consumer::FullStackBatchHandler => "runner, full stack, batched record + batch handler",
            Consumer::FullStackBatchHandlerTwoLayers => {
                "runner, full stack, batched record + batch handler, flag and lock as two layers"
            }
            Consumer::MysqlFullStack => "runner, full stack, MariaDB record per delivery",
            Consumer::MysqlFullStackBatched => "runner, full stack, MariaDB batched record",
            Consumer::MysqlFullStackBatchHandler => {
                "runner, full stack, MariaDB batched record + batch handler"
            }
        }
    }

    /// How many deliveries this consumer lets the broker send ahead: the raw loop's
    /// [`PREFETCH`], or the runner's default.
    fn prefetch(self) -> u16 {
        match self {
            Consumer::RawLapin => PREFETCH,
            _ => DEFAULT_PREFETCH,
        }
    }

    /// Draining a fresh queue of [`MESSAGES`] through this consumer: its rate, and what each
    /// message cost in CPU.
    async fn measure(self, services: &Services) -> Measured {
        let topology = scratch_topology("bench");
        fill(&services.channel, &topology).await;
        let handled = Arc::new(AtomicU64::new(0));
        let cpu_before = CpuTime::now(&SERVERS);
        let rate = match self {
            Consumer::RawLapin | Consumer::RawLapinAtRunnerPrefetch => {
                raw_consumer(&services.channel, topology.queue(), self.prefetch()).await
            }
            Consumer::Runner => {
                let stack = handler(handled.clone(), Effect::None);
                runner_consumer(&services.channel, &topology, stack, handled).await
            }
            Consumer::RunnerFlag => {
                let stack = ServiceBuilder::new()
                    .layer(services.flag().await)
                    .service(handler(handled.clone(), Effect::None));
                runner_consumer(&services.channel, &topology, stack, handled).await
            }
            Consumer::Record | Consumer::RecordBatched => {
                let mode = match self {
                    Consumer::RecordBatched => RecordMode::Batched,
                    _ => RecordMode::PerDelivery,
                };
                let records = services.schema.records();
                let stack = mode.stack(
                    &services.schema_pool,
                    records,
                    handler(handled.clone(), Effect::StockMove),
                );
                runner_consumer(&services.channel, &topology, stack, handled).await
            }
            Consumer::RecordBatchHandler | Consumer::FlagRecordBatchHandler => {
                let records = services.records().batched();
                let batch_handler = records.batch_handler(counted(handled.clone(), stock_moves));
                let stack = match self {
                    Consumer::FlagRecordBatchHandler => {
                        let flag = services.flag().await.with_record_behind();
                        boxed(ServiceBuilder::new().layer(flag).service(batch_handler))
                    }
                    _ => boxed(batch_handler),
                };
                runner_consumer(&services.channel, &topology, stack, handled).await
            }
            Consumer::FullStack => {
                let records = services.records();
                let stack = services.full_stack(records.layer(handler(handled.clone(), Effect::StockMove)));
                runner_consumer(&services.channel, &topology, stack.await, handled).await
            }
            Consumer::FullStackBatched | Consumer::FullStackBatchedDeferred => {
                let effect = match self {
                    Consumer::FullStackBatchedDeferred => Effect::StockMoveAtCommit,
                    _ => Effect::StockMove,
                };
                let records = services.records().batched();
                let stack = services.full_stack(records.layer(handler(handled.clone(), effect)));
                runner_consumer(&services.channel, &topology, stack.await, handled).await
            }
            Consumer::FullStackBatchHandler | Consumer::FullStackBatchHandlerTwoLayers => {
                let records = services.records().batched();
                let batch_handler = counted(handled.clone(), stock_moves);
                let stack = match self {
                    Consumer::FullStackBatchHandlerTwoLayers => {
                        services
                            .full_stack_in_two_layers(records.batch_handler(batch_handler))
                            .await
                    }
                    _ => services.full_stack(records.batch_handler(batch_handler)).await,
                };
                runner_consumer(&services.channel, &topology, stack, handled).await
            }
            Consumer::MysqlFullStack => {
                let records = services.mysql_records();
                let stack =
                    services.full_stack(records.layer(handler(handled.clone(), Effect::MysqlStockMove)));
                runner_consumer(&services.channel, &topology, stack.await, handled).await
            }
            Consumer::MysqlFullStackBatched => {
                let records = services.mysql_records().batched();
                let stack =
                    services.full_stack(records.layer(handler(handled.clone(), Effect::MysqlStockMove)));
                runner_consumer(&services.channel, &topology, stack.await, handled).await
            }
            Consumer::MysqlFullStackBatchHandler => {
                let records = services.mysql_records().batched();
                let batch_handler = counted(handled.clone(), mysql::stock_moves);
                let stack = services.full_stack(records.batch_handler(batch_handler));
                runner_consumer(&services.channel, &topology, stack.await, handled).await
            }
        };
        let cpu = CpuTime::now(&SERVERS).per_message_since(&cpu_before, MESSAGES);
        topology
            .delete(&services.channel)
            .await
            .expect("delete the bench queues");
        Measured {
            per_second: rate,
            cpu,
        }
    }
}

/// What the measurements share: a channel to RabbitMQ, a Redis of the bench's own, a
/// PostgreSQL schema and a MySQL/MariaDB database of its own with the handler's table.
struct Services {
    /// Held for the channel's sake.
    _connection: lapin::Connection,
    channel: Channel,
    redis: ScratchRedis,
    schema: ScratchSchema,
    /// Connections that search the schema first.
    schema_pool: Pool,
    /// Connections to the MySQL/MariaDB database.
    mysql_pool: MySqlPool,
}

impl Services {
    async fn start() -> Self {
        let connection = connect().await.expect("RabbitMQ");
        let channel = connection.create_channel().await.expect("a channel");
        let redis = ScratchRedis::start();
        let schema = ScratchSchema::new(&pool(16)).await;
        let schema_pool = schema_pool(schema.name(), 16);
        schema
            .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
            .await;
        Services {
            _connection: connection,
            channel,
            redis,
            schema,
            schema_pool,
            mysql_pool: StockDatabase::new().await.pool(16).await,
        }
    }

    /// A Redis flag with a prefix of its own, so that no measurement sees another's keys.
    async fn flag(&self) -> FlagLayer<RedisFlagStore<redis::aio::ConnectionManager>> {
        let flags =
            RedisFlagStore::new(redis_connection(&self.redis.url()).await).with_prefix(unique("bench"));
        FlagLayer::new(flags, Duration::from_secs(600))
    }

    /// The transactional record on the schema's pool.
    fn records(&self) -> PgTransactionalLayer {
        PgTransactionalLayer::new(self.schema_pool.clone(), self.schema.records())
    }

    /// The transactional record on the MySQL/MariaDB database.
    fn mysql_records(&self) -> MysqlTransactionalLayer {
        MysqlTransactionalLayer::new(self.mysql_pool.clone(), StockDatabase::records())
    }

    /// The full stack in front of `records` (the record tier with its handler): the Redis
    /// flag with the record behind it and the Redis lock on the body's `/sku`, as one tier
    /// ([`FlagLockLayer`], its scripts coalesced), as the fast path composes them.
    async fn full_stack<S>(&self, records: S) -> BoxedStack
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        let (flag, lock) = self.flag_and_lock().await;
        let stack = ServiceBuilder::new()
            .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
            .service(records);
        boxed(stack)
    }

    /// The same with the flag and the lock as two layers, one behind the other.
    async fn full_stack_in_two_layers<S>(&self, records: S) -> BoxedStack
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        let (flag, lock) = self.flag_and_lock().await;
        boxed(ServiceBuilder::new().layer(flag).layer(lock).service(records))
    }

    /// The full stack's flag, with the record behind it, and its lock on the body's `/sku`.
    async fn flag_and_lock(
        &self,
    ) -> (
        FlagLayer<RedisFlagStore<redis::aio::ConnectionManager>>,
        LockLayer<RedisLockStore<redis::aio::ConnectionManager>>,
    ) {
        let connection = redis_connection(&self.redis.url()).await;
        let lock = LockLayer::new(
            RedisLockStore::new(connection).with_prefix(unique("bench")),
            KeyExtractor::json_pointer("/sku"),
        );
        (self.flag().await.with_record_behind(), lock)
    }
}

/// One consumer's drain of the queue.
struct Measured {
    per_second: f64,
    /// What each message cost in CPU, split by [`SERVERS`].
    cpu: CpuTime<{ SERVERS.len() }>,
}

/// Every measured consumer against the raw one, each the median of [`ROUNDS`] taking turns;
/// adds the table, the CPU per message, the targets and what the full stack's targets leave
/// a message of the machine's CPU to `report`.
pub(crate) async fn run(report: &mut Report) {
    let services = Services::start().await;
    let mut rounds = Consumer::ALL.map(|_| Vec::new());
    for _ in 0..ROUNDS {
        for (consumer, rounds) in Consumer::ALL.iter().zip(&mut rounds) {
            rounds.push(consumer.measure(&services).await);
        }
    }
    let medians = rounds.map(|rounds| {
        let cpu: Vec<_> = rounds.iter().map(|measured| measured.cpu).collect();
        Measured {
            per_second: median(rounds.iter().map(|measured| measured.per_second).collect()),
            cpu: CpuTime::median(&cpu),
        }
    });
    let raw = medians[0].per_second;
    let rows: Vec<Row> = Consumer::ALL[1..]
        .iter()
        .zip(&medians[1..])
        .map(|(consumer, measured)| Row {
            what: consumer.name().into(),
            in_flight: usize::from(consumer.prefetch()),
            per_second: measured.per_second,
            baseline: raw,
        })
        .collect();
    report.add_target(Target {
        what: "RabbitMQ runner with the Redis flag",
        ratio: Row::last_ratio(&rows, Consumer::RunnerFlag.name()),
        baseline: "a raw lapin consumer at prefetch 64",
        at_least: 0.80,
    });
    let mut budgets = String::from(BUDGET_HEADING);
    for (consumer, what, at_least) in [
        (
            Consumer::FullStackBatched,
            "RabbitMQ full stack, batched record",
            0.35,
        ),
        (
            Consumer::FullStackBatchHandler,
            "RabbitMQ full stack, batched record + batch handler",
            0.50,
        ),
    ] {
        report.add_target(Target {
            what,
            ratio: Row::last_ratio(&rows, consumer.name()),
            baseline: "a raw lapin consumer at prefetch 64",
            at_least,
        });
        let measured = &medians[Consumer::ALL
            .iter()
            .position(|each| *each == consumer)
            .expect("measured")];
        budgets.push_str(&budget_line(consumer.name(), at_least, raw, &measured.cpu));
    }
    report.add_target(Target {
        what: "RabbitMQ batched record alone, end to end",
        ratio: Row::last_ratio(&rows, Consumer::RecordBatched.name())
            / Row::last_ratio(&rows, Consumer::Record.name()),
        baseline: "the record per delivery, end to end at the same prefetch",
        at_least: 2.5,
    });
    report.add(Section {
        title: format!(
            "RabbitMQ end to end ({MESSAGES} messages; the raw consumer at prefetch {PREFETCH}, the runner at its default {DEFAULT_PREFETCH}; each clock from its first delivery)"
        ),
        baseline_name: Consumer::RawLapin.name(),
        unit: Some("messages"),
        rows,
        note: Some(
            cpu_table(
                &SERVERS,
                (Consumer::ALL.iter().zip(&medians)).map(|(consumer, measured)| (consumer.name(), &measured.cpu)),
            ) + &budgets,
        ),
        plot: Plot::Bars,
    });
}

/// The key of every bench message: its order id.
fn key() -> KeyExtractor {
    KeyExtractor::json_pointer("/orderId")
}

/// What the handler does besides counting the delivery.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effect {
    /// Nothing: the stack's cost alone.
    None,
    /// A stock move written in the PostgreSQL record's transaction.
    StockMove,
    /// The same stock move, left to the record's commit (`PgTransaction::defer`).
    StockMoveAtCommit,
    /// A stock move written in the MySQL/MariaDB record's transaction.
    MysqlStockMove,
}

/// The bench's handler: `effect`, then the delivery counted in `handled`, which tells the
/// measurement when the queue is done.
fn handler(
    handled: Arc<AtomicU64>,
    effect: Effect,
) -> impl tower::Service<Envelope, Response = Outcome, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ TransactionSafe {
    handler_fn(move |envelope: Envelope| {
        let handled = handled.clone();
        async move {
            match effect {
                Effect::None => {}
                Effect::StockMove => insert_stock_move(&envelope).await?,
                Effect::StockMoveAtCommit => defer_stock_move(&envelope),
                Effect::MysqlStockMove => {
                    let tx = envelope.extensions().get::<MysqlTransaction>().cloned();
                    let tx = tx.expect("the MySQL transactional record in front");
                    mysql::stock_move(tx, envelope.key().clone()).await?;
                }
            }
            handled.fetch_add(1, Ordering::Relaxed);
            Ok::<(), HandlerError>(())
        }
    })
}

/// A batch handler of the bench: `stock_moves` (one `INSERT` for the stock moves of a batch,
/// in the transaction `T`), then the deliveries counted in `handled`.
fn counted<T, F, Fut>(
    handled: Arc<AtomicU64>,
    stock_moves: F,
) -> impl Fn(T, Vec<Envelope>) -> BoxFuture<Result<BatchAnswer, HandlerError>> + Send + Sync + 'static
where
    T: Send + 'static,
    F: Fn(T, Vec<Envelope>) -> Fut + Copy + Send + Sync + 'static,
    Fut: Future<Output = Result<BatchAnswer, HandlerError>> + Send + 'static,
{
    move |tx: T, batch: Vec<Envelope>| {
        let handled = handled.clone();
        Box::pin(async move {
            let count = batch.len() as u64;
            let answer = stock_moves(tx, batch).await?;
            handled.fetch_add(count, Ordering::Relaxed);
            Ok(answer)
        })
    }
}

/// Fills a fresh queue of `topology` with [`MESSAGES`] orders never seen before
/// (unconfirmed publishes, then a wait until the broker counts them all).
async fn fill(channel: &Channel, topology: &Topology) {
    topology.declare(channel).await.expect("declare");
    let batch = Token::random();
    for n in 0..MESSAGES {
        // A product per order: the lock then never makes one order wait for another.
        let body = format!(r#"{{"orderId":"{batch}-{n}","sku":"{batch}-{n}"}}"#);
        // Unconfirmed on purpose: filling is not measured, and the wait below counts what
        // the broker stored.
        drop(
            channel
                .basic_publish(
                    "".into(),
                    topology.queue().into(),
                    Default::default(),
                    body.as_bytes(),
                    Default::default(),
                )
                .await
                .expect("publish"),
        );
    }
    while (ready_messages(channel, topology.queue()).await as usize) < MESSAGES {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Consumes a full queue with a plain lapin loop at `prefetch` that acks every delivery from
/// its own task.
async fn raw_consumer(channel: &Channel, queue: &str, prefetch: u16) -> f64 {
    channel
        .basic_qos(prefetch, Default::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(queue.into(), "raw".into(), Default::default(), Default::default())
        .await
        .expect("consume");
    let acked = Arc::new(AtomicU64::new(0));
    let mut started = None;
    let mut received = 0;
    while received < MESSAGES {
        let delivery = consumer.next().await.expect("a delivery").expect("a delivery");
        // From the first delivery, as the runner's clock (see `runner_consumer`).
        started.get_or_insert_with(Instant::now);
        received += 1;
        let acked = acked.clone();
        tokio::spawn(async move {
            delivery.acker.ack(Default::default()).await.expect("ack");
            acked.fetch_add(1, Ordering::Relaxed);
        });
    }
    while (acked.load(Ordering::Relaxed) as usize) < MESSAGES {
        tokio::task::yield_now().await;
    }
    let rate = MESSAGES as f64 / started.expect("a delivery").elapsed().as_secs_f64();
    let _ = channel.basic_cancel("raw".into(), Default::default()).await;
    rate
}

/// Consumes a full queue through a runner of a route of `stack` at its defaults, counting
/// settled deliveries with the handler's own counter.
///
/// The clock starts when the first delivery reaches the stack, as the raw consumer's starts
/// at its first delivery: a rate is what a consumer sustains, and connecting, declaring the
/// topology and `basic.consume` (about 20 ms for the runner, against 2 ms for the raw loop
/// on a channel already open) happen once in a process's life, not per message. It stops
/// once the runner has shut down, every delivery settled, as the raw consumer's stops at its
/// last ack.
async fn runner_consumer<S>(channel: &Channel, topology: &Topology, stack: S, handled: Arc<AtomicU64>) -> f64
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let first_delivery = Arc::new(OnceLock::new());
    let stamped = {
        let first_delivery = first_delivery.clone();
        ServiceBuilder::new()
            .map_request(move |envelope: Envelope| {
                first_delivery.get_or_init(Instant::now);
                envelope
            })
            .service(stack)
    };
    let shutdown = CancellationToken::new();
    let runner = Runner::new(Route::new("bench", key(), stamped), topology.clone());
    // As the README runs it: on a connection and channel of its own, which lets it batch
    // its acks.
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { runner.run_with_reconnect(connect, &shutdown).await })
    };
    while (handled.load(Ordering::Relaxed) as usize) < MESSAGES
        || ready_messages(channel, topology.queue()).await > 0
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    shutdown.cancel();
    running.await.expect("the runner task").expect("the runner");
    let started = first_delivery.get().expect("a delivery reached the stack");
    MESSAGES as f64 / started.elapsed().as_secs_f64()
}

/// The servers whose CPU the table splits out. Every process of that name on the machine
/// counts, idle ones too (the machine's own Redis beside the bench's, RabbitMQ 4.0 beside
/// 3.10), which adds little.
const SERVERS: [Server; 4] = [
    ("RabbitMQ", "beam.smp"),
    ("Redis", "redis-server"),
    ("PostgreSQL", "postgres"),
    ("MariaDB", "mariadbd"),
];
