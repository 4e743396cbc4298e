//! `rocketmq`: end-to-end messages per second through RocketMQ's concurrent listener with the
//! full stack (the Redis flag with the record behind it and the Redis lock as one tier, and the PostgreSQL
//! record, each message's handler writing a row in the record's transaction), the record one
//! transaction per message and batched, next to a raw listener that only counts. All on the
//! same broker and topic, each consumer group reading it from its first offset, with batches of
//! up to [`BATCH`] messages per listener call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use integration_tests::postgres::{RecordMode, ScratchSchema, insert_stock_move, pool, schema_pool};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::rocketmq::ScratchRocketMq;
use integration_tests::{redis_connection, unique};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::{Envelope, HandlerError, KeyExtractor, Route, handler_fn};
use oncely_rocketmq::ConcurrentListener;
use oncely_rocketmq::rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus,
};
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use tokio::runtime::Handle;
use tower::ServiceBuilder;

use crate::measure::median;
use crate::report::{Plot, Report, Row, Section, Target};

/// Messages on the topic, sent once before the first measurement.
const MESSAGES: usize = 10_000;
/// `consume_message_batch_max_size` of every consumer measured.
const BATCH: u32 = 16;
/// Each listener is measured this many times, in turn with the others; the median is kept.
const ROUNDS: usize = 2;

/// The listener a measurement reads the topic with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// The baseline: counts the messages and acknowledges them.
    Raw,
    /// oncely's concurrent listener, the full stack, one transaction per message.
    FullStack,
    /// The same with the record batched.
    FullStackBatched,
}

impl Listener {
    /// Every listener, the baseline first: the order they take turns in.
    const ALL: [Listener; 3] = [Listener::Raw, Listener::FullStack, Listener::FullStackBatched];

    fn name(self) -> &'static str {
        match self {
            Listener::Raw => "raw listener, counting",
            Listener::FullStack => "ConcurrentListener, full stack (record per message)",
            Listener::FullStackBatched => "ConcurrentListener, full stack, batched record",
        }
    }

    /// Messages per second reading the whole topic in a consumer group of its own, from the
    /// first message handled to the last (the group's rebalance before the first is not the
    /// listener's).
    async fn measure(self, services: &mut Services) -> f64 {
        let clock = Clock::default();
        let group = unique("oncely_bench_group").replace('-', "_");
        let topic = services.rocketmq.topic.clone();
        // The stack's schema lives until the measurement ends.
        let _schema = match self {
            Listener::Raw => {
                let clock = clock.clone();
                let listener = move |messages: &[&MessageExt],
                                     _: &ConsumeConcurrentlyContext|
                      -> ClientResult<ConsumeConcurrentlyStatus> {
                    clock.tick(messages.len());
                    Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
                };
                services
                    .rocketmq
                    .consume_concurrently(&topic, &group, listener)
                    .await;
                None
            }
            Listener::FullStack | Listener::FullStackBatched => {
                let mode = match self {
                    Listener::FullStackBatched => RecordMode::Batched,
                    _ => RecordMode::PerDelivery,
                };
                let schema = ScratchSchema::new(&pool(2)).await;
                schema
                    .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
                    .await;
                let route = services.full_stack(&schema, mode, clock.clone()).await;
                let dead_letters = services.rocketmq.dead_letters();
                let listener = ConcurrentListener::new(route, Handle::current(), dead_letters);
                services
                    .rocketmq
                    .consume_concurrently(&topic, &group, listener)
                    .await;
                Some(schema)
            }
        };
        clock.wait_for(MESSAGES).await;
        services.rocketmq.stop_consumers().await;
        clock.rate()
    }
}

/// When the first and the latest message were handled, and how many were.
#[derive(Clone, Default)]
struct Clock {
    handled: Arc<AtomicU64>,
    span: Arc<Mutex<Option<(Instant, Instant)>>>,
}

impl Clock {
    fn tick(&self, messages: usize) {
        let now = Instant::now();
        let mut span = self.span.lock().expect("not poisoned");
        let first = span.map_or(now, |(first, _)| first);
        *span = Some((first, now));
        self.handled.fetch_add(messages as u64, Ordering::Relaxed);
    }

    async fn wait_for(&self, messages: usize) {
        while (self.handled.load(Ordering::Relaxed) as usize) < messages {
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
        let senders: Vec<_> = (0..8)
            .map(|sender| {
                let (producer, topic) = (producer.clone(), rocketmq.topic.clone());
                tokio::spawn(async move {
                    for n in (sender..MESSAGES).step_by(8) {
                        let body = format!(r#"{{"orderId":"o-{n}","sku":"sku-{n}"}}"#);
                        let message = integration_tests::rocketmq::message(
                            &topic,
                            Some(&format!("o-{n}")),
                            body.as_bytes(),
                        );
                        producer.send(message).await.expect("send");
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
    /// with the record in `mode` on `schema`, to a handler writing the stock move in the
    /// record's transaction and ticking `clock`.
    async fn full_stack(
        &self,
        schema: &ScratchSchema,
        mode: RecordMode,
        clock: Clock,
    ) -> Route<integration_tests::postgres::BoxedStack> {
        let prefix = unique("bench");
        let flags =
            RedisFlagStore::new(redis_connection(&self.redis.url()).await).with_prefix(prefix.as_str());
        let locks =
            RedisLockStore::new(redis_connection(&self.redis.url()).await).with_prefix(prefix.as_str());
        let handler = handler_fn(move |envelope: Envelope| {
            let clock = clock.clone();
            async move {
                insert_stock_move(&envelope).await?;
                clock.tick(1);
                Ok::<(), HandlerError>(())
            }
        });
        let pool = schema_pool(schema.name(), 16);
        let flag = FlagLayer::new(flags, std::time::Duration::from_secs(600)).with_record_behind();
        let lock = LockLayer::new(locks, KeyExtractor::json_pointer("/sku"));
        let stack = ServiceBuilder::new()
            .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
            .service(mode.stack(&pool, schema.records(), handler));
        Route::new(
            "bench",
            KeyExtractor::broker_key(),
            integration_tests::postgres::boxed(stack),
        )
    }
}

/// Every listener against the raw one, each the median of [`ROUNDS`] taking turns; adds the
/// table and the batched full stack's target to `report`.
pub(crate) async fn run(report: &mut Report) {
    let mut services = Services::start().await;
    let mut rates = Listener::ALL.map(|_| Vec::new());
    for _ in 0..ROUNDS {
        for (listener, rates) in Listener::ALL.iter().zip(&mut rates) {
            rates.push(listener.measure(&mut services).await);
        }
    }
    services.rocketmq.shutdown().await;
    let [raw, measured @ ..] = rates.map(median);
    let rows: Vec<Row> = Listener::ALL[1..]
        .iter()
        .zip(measured)
        .map(|(listener, per_second)| Row {
            what: listener.name().into(),
            in_flight: BATCH as usize,
            per_second,
            baseline: raw,
        })
        .collect();
    report.add_target(Target {
        what: "RocketMQ full stack, batched record",
        ratio: Row::last_ratio(&rows, Listener::FullStackBatched.name()),
        baseline: "a raw listener that only counts",
        at_least: 0.25,
    });
    report.add(Section {
        title: format!("RocketMQ end to end ({MESSAGES} messages, 4 queues, batches of {BATCH})"),
        baseline_name: Listener::Raw.name(),
        unit: Some("messages"),
        rows,
        note: None,
        plot: Plot::Bars,
    });
}
