//! `rocketmq`: end-to-end messages per second through RocketMQ's concurrent listener with the
//! full stack (the Redis flag with the record behind it and the Redis lock as one tier, and the PostgreSQL
//! record, each message's handler writing a row in the record's transaction), the record one
//! transaction per message and batched, and batched with a batch handler writing a batch's
//! rows in one statement, next to the at-least-once listener users run today (a raw
//! listener writing each message's row in a transaction of its own, acknowledging after the
//! commits) and, for scale, a raw listener that only counts. All on the
//! same broker and topic, each consumer group reading it from its first offset, with batches of
//! up to [`BATCH`] messages per listener call. Under the rates: the CPU each message cost the
//! bench process (the consumer), the broker, Redis, PostgreSQL, the idle RabbitMQ and the
//! whole machine, from `/proc`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use integration_tests::postgres::{
    BoxedStack, ScratchSchema, boxed, insert_stock_move, pool, schema_pool, stock_moves,
};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::rocketmq::ScratchRocketMq;
use integration_tests::{redis_connection, unique};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::record::{BatchAnswer, PgTransaction, PgTransactionalLayer};
use oncely::tier::BoxFuture;
use oncely::{Envelope, HandlerError, HandlerFn, KeyExtractor, Route, handler_fn};
use oncely_rocketmq::ConcurrentListener;
use oncely_rocketmq::rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus,
};
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use tokio::runtime::Handle;
use tower::{Layer, ServiceBuilder};

use crate::baseline::Writer;
use crate::cpu::{BUDGET_HEADING, CpuTime, Server, budget_line, cpu_table};
use crate::measure::median;
use crate::report::{Plot, Report, Row, Section, Target};

/// Messages on the topic, sent once before the first measurement.
const MESSAGES: usize = 40_000;
/// Messages per batch the topic is filled with.
const SEND_BATCH: usize = 100;
/// `consume_message_batch_max_size` of every consumer measured.
const BATCH: u32 = 16;
/// Each listener is measured this many times, in turn with the others; the median is kept.
const ROUNDS: usize = 5;

/// The servers whose CPU the table splits out (RabbitMQ, idle, for what it takes from the
/// machine: its Erlang schedulers poll).
const SERVERS: [Server; 4] = [
    ("RocketMQ broker", "rocketmq-broker"),
    ("Redis", "redis-server"),
    ("PostgreSQL", "postgres"),
    ("RabbitMQ (idle)", "beam.smp"),
];

/// The listener a measurement reads the topic with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// The baseline: a raw listener that writes each message's row in a transaction of its
    /// own (the batch's messages at once, on a pool of 16) and acknowledges the batch after
    /// their commits: the at-least-once consumer users run today.
    AtLeastOnce,
    /// For scale: a raw listener that counts the messages and acknowledges them.
    Raw,
    /// oncely's concurrent listener, the full stack with this record and handler.
    FullStack(Record),
}

/// The record and handler behind the full stack's Redis tiers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Record {
    /// One transaction per message, its handler writing the stock move.
    PerMessage,
    /// Batched, each message's handler writing its stock move in the batch's transaction.
    Batched,
    /// Batched, a batch handler writing the batch's stock moves in one statement: the fast
    /// exact path.
    BatchHandler,
}

impl Listener {
    /// Every listener, the baseline first: the order they take turns in.
    const ALL: [Listener; 5] = [
        Listener::AtLeastOnce,
        Listener::Raw,
        Listener::FullStack(Record::PerMessage),
        Listener::FullStack(Record::Batched),
        Listener::FullStack(Record::BatchHandler),
    ];

    fn name(self) -> &'static str {
        match self {
            Listener::AtLeastOnce => "at-least-once listener, its row on PostgreSQL",
            Listener::Raw => "raw listener, counting (no row)",
            Listener::FullStack(Record::PerMessage) => "ConcurrentListener, full stack (record per message)",
            Listener::FullStack(Record::Batched) => "ConcurrentListener, full stack, batched record",
            Listener::FullStack(Record::BatchHandler) => {
                "ConcurrentListener, full stack, batched record + batch handler"
            }
        }
    }

    /// Messages per second reading the whole topic in a consumer group of its own, from the
    /// first message handled to the last (the group's rebalance before the first is not the
    /// listener's), and what each message cost in CPU.
    async fn measure(self, services: &mut Services) -> (f64, CpuTime<{ SERVERS.len() }>) {
        let clock = Clock::default();
        let group = unique("oncely_bench_group").replace('-', "_");
        let topic = services.rocketmq.topic.clone();
        // The stack's schema lives until the measurement ends.
        let _schema = match self {
            Listener::AtLeastOnce | Listener::Raw => {
                let schema = stock_schema().await;
                let writer = match self {
                    Listener::AtLeastOnce => Writer::Postgres(schema_pool(schema.name(), 16)),
                    _ => Writer::Nothing,
                };
                let (clock, runtime) = (clock.clone(), Handle::current());
                let listener = move |messages: &[&MessageExt],
                                     _: &ConsumeConcurrentlyContext|
                      -> ClientResult<ConsumeConcurrentlyStatus> {
                    if !matches!(writer, Writer::Nothing) {
                        let mut rows = tokio::task::JoinSet::new();
                        for message in messages {
                            let (writer, body) = (writer.clone(), message.body().unwrap_or_default());
                            rows.spawn_on(async move { writer.write(&body).await }, &runtime);
                        }
                        // The client calls from the runtime's blocking threads.
                        tokio::task::block_in_place(|| runtime.block_on(rows.join_all()));
                    }
                    clock.tick(messages.len());
                    Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
                };
                services
                    .rocketmq
                    .consume_concurrently(&topic, &group, listener)
                    .await;
                Some(schema)
            }
            Listener::FullStack(record) => {
                let schema = stock_schema().await;
                let records = PgTransactionalLayer::new(schema_pool(schema.name(), 16), schema.records());
                let route = services.full_stack(record.stack(records, clock.clone())).await;
                let dead_letters = services.rocketmq.dead_letters();
                let listener = ConcurrentListener::new(route, Handle::current(), dead_letters);
                services
                    .rocketmq
                    .consume_concurrently(&topic, &group, listener)
                    .await;
                Some(schema)
            }
        };
        // CPU from the first message handled on, as the rate: neither the consumer's start nor
        // the group's rebalance, nor a previous measurement's ending processes.
        clock.wait_for(1).await;
        let (cpu_before, handled_before) = (CpuTime::now(&SERVERS), clock.handled());
        clock.wait_for(MESSAGES).await;
        let cpu = CpuTime::now(&SERVERS).per_message_since(&cpu_before, clock.handled() - handled_before);
        services.rocketmq.stop_consumers().await;
        (clock.rate(), cpu)
    }
}

impl Record {
    /// `records` in this mode with its handler, which ticks `clock` for each stock move
    /// written.
    fn stack(self, records: PgTransactionalLayer, clock: Clock) -> BoxedStack {
        match self {
            Record::PerMessage => boxed(records.layer(clock.stock_move_handler())),
            Record::Batched => boxed(records.batched().layer(clock.stock_move_handler())),
            Record::BatchHandler => {
                let batch_handler = move |tx: PgTransaction, batch: Vec<Envelope>| {
                    let clock = clock.clone();
                    let messages = batch.len();
                    Box::pin(async move {
                        let answer = stock_moves(tx, batch).await?;
                        clock.tick(messages);
                        Ok(answer)
                    }) as BoxFuture<Result<BatchAnswer, HandlerError>>
                };
                boxed(records.batched().batch_handler(batch_handler))
            }
        }
    }
}

/// A schema of a measurement's own with the handler's table (no unique index: the
/// at-least-once listener writes what it gets).
async fn stock_schema() -> ScratchSchema {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
        .await;
    schema
}

/// When the first and the latest message were handled, and how many were.
#[derive(Clone, Default)]
struct Clock {
    handled: Arc<AtomicU64>,
    span: Arc<Mutex<Option<(Instant, Instant)>>>,
}

impl Clock {
    /// A handler writing each message's stock move in the record's transaction, then
    /// ticking this clock.
    fn stock_move_handler(
        self,
    ) -> HandlerFn<impl Fn(Envelope) -> BoxFuture<Result<(), HandlerError>> + Clone> {
        handler_fn(move |envelope: Envelope| {
            let clock = self.clone();
            Box::pin(async move {
                insert_stock_move(&envelope).await?;
                clock.tick(1);
                Ok(())
            }) as BoxFuture<Result<(), HandlerError>>
        })
    }

    fn tick(&self, messages: usize) {
        let now = Instant::now();
        let mut span = self.span.lock().expect("not poisoned");
        let first = span.map_or(now, |(first, _)| first);
        *span = Some((first, now));
        self.handled.fetch_add(messages as u64, Ordering::Relaxed);
    }

    fn handled(&self) -> usize {
        self.handled.load(Ordering::Relaxed) as usize
    }

    async fn wait_for(&self, messages: usize) {
        while self.handled() < messages {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    fn rate(&self) -> f64 {
        let (first, last) = self.span.lock().expect("not poisoned").expect("handled");
        self.handled.load(Ordering::Relaxed) as f64 / (last - first).as_secs_f64()
    }
}

/// What the measurements share: the broker's topic, filled once, and a Redis of the bench's
/// own.
struct Services {
    rocketmq: ScratchRocketMq,
    redis: ScratchRedis,
}

impl Services {
    async fn start() -> Self {
        let mut rocketmq = ScratchRocketMq::new("bench").await.with_batch_size(BATCH);
        rocketmq.create_topics(4).await;
        let producer = rocketmq.producer();
        // In batches: one send at a time would take longer than every measurement together.
        let senders: Vec<_> = (0..8)
            .map(|sender| {
                let (producer, topic) = (producer.clone(), rocketmq.topic.clone());
                tokio::spawn(async move {
                    let mine: Vec<usize> = (sender..MESSAGES).step_by(8).collect();
                    for batch in mine.chunks(SEND_BATCH) {
                        let messages = batch
                            .iter()
                            .map(|n| {
                                let body = format!(r#"{{"orderId":"o-{n}","sku":"sku-{n}"}}"#);
                                integration_tests::rocketmq::message(
                                    &topic,
                                    Some(&format!("o-{n}")),
                                    body.as_bytes(),
                                )
                            })
                            .collect();
                        producer.send_batch(messages).await.expect("send");
                    }
                })
            })
            .collect();
        for sender in senders {
            sender.await.expect("a sender");
        }
        Services {
            rocketmq,
            redis: ScratchRedis::start(),
        }
    }

    /// The full stack keyed by the message's KEYS, its Redis keys under a prefix of their own,
    /// in front of `record` (the record and the handler behind it).
    async fn full_stack(&self, record: BoxedStack) -> Route<BoxedStack> {
        let prefix = unique("bench");
        let flags =
            RedisFlagStore::new(redis_connection(&self.redis.url()).await).with_prefix(prefix.as_str());
        let locks =
            RedisLockStore::new(redis_connection(&self.redis.url()).await).with_prefix(prefix.as_str());
        let flag = FlagLayer::new(flags, std::time::Duration::from_secs(600)).with_record_behind();
        let lock = LockLayer::new(locks, KeyExtractor::json_pointer("/sku"));
        let stack = ServiceBuilder::new()
            .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
            .service(record);
        Route::new("bench", KeyExtractor::broker_key(), boxed(stack))
    }
}

/// Every listener against the at-least-once one, each the median of [`ROUNDS`] taking turns;
/// adds the table, the CPU per message, the full stack's three targets and what each leaves
/// a message of the machine's CPU to `report`.
pub(crate) async fn run(report: &mut Report) {
    let mut services = Services::start().await;
    let mut rounds = Listener::ALL.map(|_| Vec::new());
    for _ in 0..ROUNDS {
        for (listener, rounds) in Listener::ALL.iter().zip(&mut rounds) {
            rounds.push(listener.measure(&mut services).await);
        }
    }
    services.rocketmq.shutdown().await;
    let medians = rounds.map(|rounds| {
        let cpu: Vec<_> = rounds.iter().map(|(_, cpu)| *cpu).collect();
        (
            median(rounds.iter().map(|(rate, _)| *rate).collect()),
            CpuTime::median(&cpu),
        )
    });
    let [(baseline, _), measured @ ..] = &medians;
    let rows: Vec<Row> = Listener::ALL[1..]
        .iter()
        .zip(measured)
        .map(|(listener, (per_second, _))| Row {
            what: listener.name().into(),
            in_flight: BATCH as usize,
            per_second: *per_second,
            baseline: *baseline,
            lowest_ratio: None,
        })
        .collect();
    let mut budgets = String::new();
    for (record, at_least) in [
        (Record::Batched, 1.2),
        (Record::BatchHandler, 2.0),
        (Record::PerMessage, 0.6),
    ] {
        let target = Listener::FullStack(record);
        report.add_target(Target {
            what: format!("RocketMQ, batches of {BATCH}, {}", target.name()),
            ratio: Row::last_ratio(&rows, target.name()),
            baseline: "the at-least-once listener writing its row on PostgreSQL".into(),
            at_least,
        });
        let (_, target_cpu) = &medians[Listener::ALL
            .iter()
            .position(|each| *each == target)
            .expect("measured")];
        budgets.push_str(&budget_line(target.name(), at_least, *baseline, target_cpu));
    }
    report.add(Section {
        title: format!(
            "RocketMQ end to end on PostgreSQL: exactly-once against at-least-once ({} messages, 4 queues, batches of {BATCH}, the client's default consume threads for every listener)",
            integration_tests::thousands(MESSAGES as f64)
        ),
        baseline_name: "at-least-once listener writing its row on PostgreSQL",
        unit: Some("messages"),
        rows,
        note: Some(
            cpu_table(
                &SERVERS,
                (Listener::ALL.iter().zip(&medians)).map(|(listener, (_, cpu))| (listener.name(), cpu)),
            ) + BUDGET_HEADING
                + &budgets,
        ),
        plot: Plot::Bars,
    });
}
