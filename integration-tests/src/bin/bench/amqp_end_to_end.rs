//! `amqp`: end-to-end messages per second through the RabbitMQ runner with no tiers, with
//! the Redis flag, with the PostgreSQL record alone (per delivery and batched), and with the
//! full stack (the Redis flag with the record behind it, the Redis lock and the record, on
//! PostgreSQL and on MySQL/MariaDB) — the record one
//! transaction per delivery, batched with per-delivery handlers, and batched with a batch
//! handler — next to a raw lapin consumer with the same prefetch that acks each message from
//! its own task.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures_lite::StreamExt;
use integration_tests::RouteStack;
use integration_tests::amqp::{connect, ready_messages, scratch_topology};
use integration_tests::mysql::{self, StockDatabase};
use integration_tests::postgres::{
    RecordMode, ScratchSchema, insert_stock_move, pool, schema_pool, stock_moves,
};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{redis_connection, unique};
use lapin::Channel;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::mysql::sqlx::MySqlPool;
use oncely::record::{
    BatchAnswer, MysqlTransaction, MysqlTransactionalLayer, PgTransactionalLayer, TransactionSafe,
};
use oncely::tier::BoxFuture;
use oncely::{BoxError, Envelope, HandlerError, KeyExtractor, Outcome, Route, Token, handler_fn};
use oncely_amqp::{Runner, Topology};
use tokio_util::sync::CancellationToken;
use tower::Layer;
use tower::ServiceBuilder;

use crate::measure::median;
use crate::report::{Plot, Report, Row, Section, Target};

/// Messages per measurement, published before the clock starts.
const MESSAGES: usize = 10_000;
/// Prefetch, and so messages in flight, of every consumer measured.
const PREFETCH: u16 = 64;
/// Each consumer is measured this many times, in turn with the others; the median is kept.
const ROUNDS: usize = 3;

/// The consumer a measurement drains its queue with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Consumer {
    /// The baseline: a plain lapin loop.
    RawLapin,
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
    /// The runner with the full stack, the record one transaction per delivery, the handler
    /// writing a row in the record's transaction.
    FullStack,
    /// The same with the record batched.
    FullStackBatched,
    /// The same with the record batched and a batch handler writing the rows of a batch at
    /// once.
    FullStackBatchHandler,
    /// The full stack with the record on MySQL/MariaDB, one transaction per delivery.
    MysqlFullStack,
    /// The same with the record batched.
    MysqlFullStackBatched,
    /// The same with the record batched and a batch handler.
    MysqlFullStackBatchHandler,
}

impl Consumer {
    /// Every consumer, the baseline first: the order they take turns in.
    const ALL: [Consumer; 11] = [
        Consumer::RawLapin,
        Consumer::Runner,
        Consumer::RunnerFlag,
        Consumer::Record,
        Consumer::RecordBatched,
        Consumer::FullStack,
        Consumer::FullStackBatched,
        Consumer::FullStackBatchHandler,
        Consumer::MysqlFullStack,
        Consumer::MysqlFullStackBatched,
        Consumer::MysqlFullStackBatchHandler,
    ];

    fn name(self) -> &'static str {
        match self {
            Consumer::RawLapin => "raw lapin consumer",
            Consumer::Runner => "runner, no tiers",
            Consumer::RunnerFlag => "runner, Redis flag",
            Consumer::Record => "runner, record per delivery (no Redis tiers)",
            Consumer::RecordBatched => "runner, batched record (no Redis tiers)",
            Consumer::FullStack => "runner, full stack (flag + lock + record per delivery)",
            Consumer::FullStackBatched => "runner, full stack, batched record",
            Consumer::FullStackBatchHandler => "runner, full stack, batched record + batch handler",
            Consumer::MysqlFullStack => "runner, full stack, MariaDB record per delivery",
            Consumer::MysqlFullStackBatched => "runner, full stack, MariaDB batched record",
            Consumer::MysqlFullStackBatchHandler => {
                "runner, full stack, MariaDB batched record + batch handler"
            }
        }
    }

    /// Messages per second draining a fresh queue of [`MESSAGES`] through this consumer.
    async fn measure(self, services: &Services) -> f64 {
        let topology = scratch_topology("bench");
        fill(&services.channel, &topology).await;
        let handled = Arc::new(AtomicU64::new(0));
        let rate = match self {
            Consumer::RawLapin => raw_consumer(&services.channel, topology.queue()).await,
            Consumer::Runner => {
                let route = Route::new("bench", key(), handler(handled.clone(), Effect::None));
                runner_consumer(&services.channel, &topology, route, handled).await
            }
            Consumer::RunnerFlag => {
                let stack = ServiceBuilder::new()
                    .layer(services.flag().await)
                    .service(handler(handled.clone(), Effect::None));
                let route = Route::new("bench", key(), stack);
                runner_consumer(&services.channel, &topology, route, handled).await
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
                let route = Route::new("bench", key(), stack);
                runner_consumer(&services.channel, &topology, route, handled).await
            }
            Consumer::FullStack => {
                let records = services.records();
                let route = services.full_stack(records.layer(handler(handled.clone(), Effect::StockMove)));
                runner_consumer(&services.channel, &topology, route.await, handled).await
            }
            Consumer::FullStackBatched => {
                let records = services.records().batched();
                let route = services.full_stack(records.layer(handler(handled.clone(), Effect::StockMove)));
                runner_consumer(&services.channel, &topology, route.await, handled).await
            }
            Consumer::FullStackBatchHandler => {
                let records = services.records().batched();
                let batch_handler = counted(handled.clone(), stock_moves);
                let route = services.full_stack(records.batch_handler(batch_handler));
                runner_consumer(&services.channel, &topology, route.await, handled).await
            }
            Consumer::MysqlFullStack => {
                let records = services.mysql_records();
                let route =
                    services.full_stack(records.layer(handler(handled.clone(), Effect::MysqlStockMove)));
                runner_consumer(&services.channel, &topology, route.await, handled).await
            }
            Consumer::MysqlFullStackBatched => {
                let records = services.mysql_records().batched();
                let route =
                    services.full_stack(records.layer(handler(handled.clone(), Effect::MysqlStockMove)));
                runner_consumer(&services.channel, &topology, route.await, handled).await
            }
            Consumer::MysqlFullStackBatchHandler => {
                let records = services.mysql_records().batched();
                let batch_handler = counted(handled.clone(), mysql::stock_moves);
                let route = services.full_stack(records.batch_handler(batch_handler));
                runner_consumer(&services.channel, &topology, route.await, handled).await
            }
        };
        topology
            .delete(&services.channel)
            .await
            .expect("delete the bench queues");
        rate
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
    /// flag with the record behind it and the Redis lock on the body's `/sku`.
    async fn full_stack<S>(&self, records: S) -> Route<impl RouteStack<S::Error> + use<S>>
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        let connection = redis_connection(&self.redis.url()).await;
        let lock = LockLayer::new(
            RedisLockStore::new(connection).with_prefix(unique("bench")),
            KeyExtractor::json_pointer("/sku"),
        );
        let stack = ServiceBuilder::new()
            .layer(self.flag().await.with_record_behind())
            .layer(lock)
            .service(records);
        Route::new("bench", key(), stack)
    }
}

/// Every measured consumer against the raw one, each the median of [`ROUNDS`] taking turns;
/// adds the table and the flag's target to `report`.
pub(crate) async fn run(report: &mut Report) {
    let services = Services::start().await;
    let mut rates = Consumer::ALL.map(|_| Vec::new());
    for _ in 0..ROUNDS {
        for (consumer, rates) in Consumer::ALL.iter().zip(&mut rates) {
            rates.push(consumer.measure(&services).await);
        }
    }
    let [raw, measured @ ..] = rates.map(median);
    let rows: Vec<Row> = Consumer::ALL[1..]
        .iter()
        .zip(measured)
        .map(|(consumer, per_second)| Row {
            what: consumer.name().into(),
            in_flight: usize::from(PREFETCH),
            per_second,
            baseline: raw,
        })
        .collect();
    report.add_target(Target {
        what: "RabbitMQ runner with the Redis flag",
        ratio: Row::last_ratio(&rows, Consumer::RunnerFlag.name()),
        baseline: "a raw lapin consumer",
        at_least: 0.80,
    });
    report.add_target(Target {
        what: "RabbitMQ full stack, batched record",
        ratio: Row::last_ratio(&rows, Consumer::FullStackBatched.name()),
        baseline: "a raw lapin consumer",
        at_least: 0.35,
    });
    report.add_target(Target {
        what: "RabbitMQ full stack, batched record + batch handler",
        ratio: Row::last_ratio(&rows, Consumer::FullStackBatchHandler.name()),
        baseline: "a raw lapin consumer",
        at_least: 0.50,
    });
    report.add_target(Target {
        what: "RabbitMQ batched record alone, end to end",
        ratio: Row::last_ratio(&rows, Consumer::RecordBatched.name())
            / Row::last_ratio(&rows, Consumer::Record.name()),
        baseline: "the record per delivery, end to end at the same prefetch",
        at_least: 2.5,
    });
    report.add(Section {
        title: format!("RabbitMQ end to end ({MESSAGES} messages, prefetch {PREFETCH})"),
        baseline_name: Consumer::RawLapin.name(),
        unit: Some("messages"),
        rows,
        note: None,
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

/// Consumes a full queue with a plain lapin loop that acks every delivery from its own task.
async fn raw_consumer(channel: &Channel, queue: &str) -> f64 {
    channel
        .basic_qos(PREFETCH, Default::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(queue.into(), "raw".into(), Default::default(), Default::default())
        .await
        .expect("consume");
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut received = 0;
    while received < MESSAGES {
        let delivery = consumer.next().await.expect("a delivery").expect("a delivery");
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
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    let _ = channel.basic_cancel("raw".into(), Default::default()).await;
    rate
}

/// Consumes a full queue through a runner of `route`, counting settled deliveries with the
/// handler's own counter.
async fn runner_consumer<S>(
    channel: &Channel,
    topology: &Topology,
    route: Route<S>,
    handled: Arc<AtomicU64>,
) -> f64
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let shutdown = CancellationToken::new();
    let runner = Runner::new(route, topology.clone())
        .with_prefetch(PREFETCH)
        .with_concurrency(PREFETCH.into());
    let started = Instant::now();
    let running = {
        let (channel, shutdown) = (channel.clone(), shutdown.clone());
        tokio::spawn(async move { runner.run(&channel, &shutdown).await })
    };
    while (handled.load(Ordering::Relaxed) as usize) < MESSAGES
        || ready_messages(channel, topology.queue()).await > 0
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = MESSAGES as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    running.await.expect("the runner task").expect("the runner");
    rate
}
