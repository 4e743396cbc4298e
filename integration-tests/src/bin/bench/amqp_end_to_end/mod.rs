//! `amqp`: what exactly-once costs through RabbitMQ against the consumer users run today.
//!
//! Every row and its baseline run at the same prefetch, the same number in flight and the
//! same messages, at 64 and at the runner's default ([`DEFAULT_PREFETCH`]), taking turns:
//! - on PostgreSQL and on MariaDB: the full stack (the Redis flag with the record behind it
//!   and the Redis lock, as one tier, then the transactional record: per delivery, batched,
//!   batched with a batch handler) next to an at-least-once lapin consumer that writes the
//!   same row per message in a transaction of its own and acks after its commit;
//! - without a database: the runner alone and with the Redis flag, next to a lapin consumer
//!   that only acks;
//! - a workload of 20,000 messages with 30 % duplicates (half re-sent with the same message
//!   id, half with a new one), half of them within 64 messages of their original, next to
//!   the same workload with every duplicate far from its original: the batched record alone,
//!   both handler kinds, both stores, at prefetch 64;
//! - the half-near workload through mq-bridge 1.3's deduplication route on PostgreSQL
//!   ([`peer`]) next to oncely's full stack, batched, on the same classic queue.
//!
//! Beside each rate: the CPU each message cost the bench process (the consumer) and each
//! server, from `/proc`; for every batched row, the deliveries per transaction (the batched
//! record's metrics).

pub(crate) mod consume;
mod peer;
mod rows;
pub(crate) mod services;

use std::sync::LazyLock;

use integration_tests::amqp::scratch_topology;
use lapin::options::QueueDeclareOptions;
use oncely_amqp::{DEFAULT_PREFETCH, Topology};

use self::consume::{fill, raw_consumer, runner_consumer};
use self::services::{Record, Services, Store};
use crate::baseline::Writer;
use crate::cpu::{CpuTime, Server};
use crate::prefilter::COUNTS;
use crate::report::Report;
use crate::workload::{self, Copies, Message};

/// Messages per measurement of fresh orders, published before the clock starts.
const MESSAGES: usize = 10_000;
/// Each consumer is measured this many times, in turn with the others; the median is kept.
/// Three, not five as elsewhere: 32 drains a round (about 4.5 minutes on the 2-core
/// machine). `ONCELY_BENCH_ROUNDS` overrides it (one for a quick look).
fn round_count() -> usize {
    (std::env::var("ONCELY_BENCH_ROUNDS").ok())
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(3)
}
/// The prefetch (and in-flight limit) every row and its baseline run at: the one users of a
/// raw consumer often pick, and the runner's default.
const SETTINGS: [u16; 2] = [64, DEFAULT_PREFETCH];
/// The prefetch of the duplicate workloads and the peer, as a user would try them.
const DUPLICATES_PREFETCH: u16 = 64;

/// The consumer a measurement drains its queue with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Consumer {
    /// A lapin loop that acks each message from its own task: the broker's and the client's
    /// cost alone.
    RawAck,
    /// The same loop writing each message's row in a transaction of its own before the ack:
    /// the at-least-once consumer users run today.
    AtLeastOnce(Store),
    /// The runner with a handler and no tier.
    Runner,
    /// The runner with the Redis flag in front of a handler that does nothing.
    RunnerFlag,
    /// The full stack in front of the record run as given, its handler writing the row.
    FullStack(Store, Record),
    /// The record alone (no Redis tiers), its handler writing the row.
    RecordAlone(Store, Record),
    /// mq-bridge 1.3's deduplication route on PostgreSQL ([`peer`]).
    MqBridge,
}

impl Consumer {
    /// As the report names it.
    fn name(self) -> String {
        match self {
            Consumer::RawAck => "raw lapin consumer, ack only".into(),
            Consumer::AtLeastOnce(store) => {
                format!("at-least-once lapin consumer, its row on {}", store.name())
            }
            Consumer::Runner => "runner, no tiers".into(),
            Consumer::RunnerFlag => "runner, Redis flag".into(),
            Consumer::FullStack(_, record) => format!("full stack, {}", record.name()),
            Consumer::RecordAlone(store, record) => {
                format!("{}, {} (no Redis tiers)", store.name(), record.name())
            }
            Consumer::MqBridge => "mq-bridge 1.3 deduplication route (message id, PostgreSQL)".into(),
        }
    }

    /// Whether its record runs batched, and so has deliveries per transaction to show.
    fn batched(self) -> bool {
        matches!(
            self,
            Consumer::FullStack(_, Record::Batched | Record::BatchHandler)
                | Consumer::RecordAlone(_, Record::Batched | Record::BatchHandler)
        )
    }
}

/// What one drain measured.
#[derive(Clone, Copy)]
struct Measured {
    per_second: f64,
    /// What each message cost in CPU, split by [`SERVERS`].
    cpu: CpuTime<{ SERVERS.len() }>,
    /// Deliveries per committed transaction of the batched record, if it ran batched.
    per_transaction: Option<f64>,
    /// Orders whose row was written more than once (PostgreSQL rows with duplicates only).
    doubled: Option<i64>,
}

/// The queue a measurement fills: one of oncely's topology (quorum queues), or a classic
/// durable queue without arguments, which mq-bridge's input insists on declaring itself;
/// oncely's runner then takes it as it exists.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Queue {
    Quorum,
    Classic,
}

/// The batched record's transactions and the deliveries they committed so far.
fn batch_counts() -> (u64, u64) {
    (
        COUNTS.get("oncely_batches_total{ending=committed}"),
        COUNTS.get("oncely_batch_deliveries_total{}"),
    )
}

impl Consumer {
    /// Drains a fresh queue holding `messages` through this consumer at `prefetch`.
    async fn measure(
        self,
        services: &Services,
        prefetch: u16,
        messages: &[Message],
        queue: Queue,
    ) -> Measured {
        let topology = match queue {
            Queue::Quorum => scratch_topology("bench"),
            Queue::Classic => {
                let topology = scratch_topology("bench-classic").with_existing_work_queue();
                let durable = QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                };
                (services.channel)
                    .queue_declare(topology.queue().into(), durable, Default::default())
                    .await
                    .expect("a classic queue");
                topology
            }
        };
        fill(&services.channel, &topology, messages).await;
        let (transactions, deliveries) = batch_counts();
        let cpu_before = CpuTime::now(&SERVERS);
        let per_second = self.drain(services, &topology, prefetch, messages.len()).await;
        let cpu = CpuTime::now(&SERVERS).per_message_since(&cpu_before, messages.len());
        let per_transaction = self.batched().then(|| {
            let (transactions_after, deliveries_after) = batch_counts();
            (deliveries_after - deliveries) as f64 / (transactions_after - transactions).max(1) as f64
        });
        let doubled = match self {
            Consumer::FullStack(Store::Postgres, _)
            | Consumer::RecordAlone(Store::Postgres, _)
            | Consumer::MqBridge => {
                let orders: Vec<String> = messages.iter().map(|message| message.order.clone()).collect();
                Some(services.doubled(&orders).await)
            }
            _ => None,
        };
        topology
            .delete(&services.channel)
            .await
            .expect("delete the bench queues");
        Measured {
            per_second,
            cpu,
            per_transaction,
            doubled,
        }
    }

    /// Consumes `messages` from `topology`'s full work queue; its rate.
    async fn drain(self, services: &Services, topology: &Topology, prefetch: u16, messages: usize) -> f64 {
        let channel = &services.channel;
        let stack = match self {
            Consumer::RawAck => {
                return raw_consumer(channel, topology.queue(), prefetch, messages, &Writer::Nothing).await;
            }
            Consumer::AtLeastOnce(store) => {
                let writer = services.writer(store);
                return raw_consumer(channel, topology.queue(), prefetch, messages, &writer).await;
            }
            Consumer::MqBridge => return peer::drain(services, topology.queue(), prefetch, messages).await,
            Consumer::Runner => integration_tests::postgres::boxed(services::nothing()),
            Consumer::RunnerFlag => {
                let flag = services.flag().await;
                integration_tests::postgres::boxed(tower::Layer::layer(&flag, services::nothing()))
            }
            Consumer::FullStack(store, record) => services.full_stack(services.record(store, record)).await,
            Consumer::RecordAlone(store, record) => services.record(store, record),
        };
        runner_consumer(channel, topology, prefetch, messages, stack).await
    }
}

/// The servers whose CPU the tables split out. Every process of that name on the machine
/// counts, idle ones too (the machine's own Redis beside the bench's, RabbitMQ 4.0 beside
/// 3.10), which adds little.
const SERVERS: [Server; 4] = [
    ("RabbitMQ", "beam.smp"),
    ("Redis", "redis-server"),
    ("PostgreSQL", "postgres"),
    ("MariaDB", "mariadbd"),
];

/// The consumers of fresh orders, each measured at every one of [`SETTINGS`]; the baselines
/// first.
const FRESH: [Consumer; 11] = [
    Consumer::RawAck,
    Consumer::Runner,
    Consumer::RunnerFlag,
    Consumer::AtLeastOnce(Store::Postgres),
    Consumer::FullStack(Store::Postgres, Record::PerDelivery),
    Consumer::FullStack(Store::Postgres, Record::Batched),
    Consumer::FullStack(Store::Postgres, Record::BatchHandler),
    Consumer::AtLeastOnce(Store::Mysql),
    Consumer::FullStack(Store::Mysql, Record::PerDelivery),
    Consumer::FullStack(Store::Mysql, Record::Batched),
    Consumer::FullStack(Store::Mysql, Record::BatchHandler),
];

/// The record alone on the duplicate workloads, each with its copies near and far.
const WITH_DUPLICATES: [Consumer; 4] = [
    Consumer::RecordAlone(Store::Postgres, Record::Batched),
    Consumer::RecordAlone(Store::Postgres, Record::BatchHandler),
    Consumer::RecordAlone(Store::Mysql, Record::Batched),
    Consumer::RecordAlone(Store::Mysql, Record::BatchHandler),
];

/// oncely and its peer on the half-near duplicate workload, the peer (the baseline) first.
const PEERS: [Consumer; 2] = [
    Consumer::MqBridge,
    Consumer::FullStack(Store::Postgres, Record::Batched),
];

/// Every measurement of a run, by what it measured.
#[derive(Default)]
struct Rounds {
    /// `(consumer, prefetch)` of fresh orders.
    fresh: Vec<((Consumer, u16), Vec<Measured>)>,
    /// `(consumer, copies)` of the duplicate workloads.
    duplicates: Vec<((Consumer, Copies), Vec<Measured>)>,
    /// The peers, on the half-near workload.
    peers: Vec<(Consumer, Vec<Measured>)>,
}

/// Adds `measured` to what `key` measured before in `rounds`.
fn push<K: PartialEq>(rounds: &mut Vec<(K, Vec<Measured>)>, key: K, measured: Measured) {
    match rounds.iter_mut().find(|(each, _)| *each == key) {
        Some((_, all)) => all.push(measured),
        None => rounds.push((key, vec![measured])),
    }
}

/// Whether the mq-bridge peer can run here ([`peer::binary`]); says why not once.
static PEER_READY: LazyLock<bool> = LazyLock::new(|| match peer::binary() {
    Ok(_) => true,
    Err(why) => {
        eprintln!("the mq-bridge peer is left out: {why}");
        false
    }
});

/// Runs every measurement [`round_count`] times, taking turns, and adds the tables and
/// targets ([`rows`]) to `report`.
pub(crate) async fn run(report: &mut Report) {
    let services = Services::start().await;
    let mut rounds = Rounds::default();
    let all = round_count();
    for round in 1..=all {
        eprintln!("amqp: round {round} of {all}");
        for prefetch in SETTINGS {
            for consumer in FRESH {
                let messages = workload::fresh(MESSAGES);
                let measured = consumer
                    .measure(&services, prefetch, &messages, Queue::Quorum)
                    .await;
                push(&mut rounds.fresh, (consumer, prefetch), measured);
            }
        }
        for consumer in WITH_DUPLICATES {
            for copies in [Copies::HalfNear, Copies::Far] {
                let messages = workload::with_duplicates(copies);
                let measured =
                    (consumer.measure(&services, DUPLICATES_PREFETCH, &messages, Queue::Quorum)).await;
                push(&mut rounds.duplicates, (consumer, copies), measured);
            }
        }
        for consumer in PEERS.into_iter().filter(|_| *PEER_READY) {
            let messages = workload::with_duplicates(Copies::HalfNear);
            let measured =
                (consumer.measure(&services, DUPLICATES_PREFETCH, &messages, Queue::Classic)).await;
            push(&mut rounds.peers, consumer, measured);
        }
    }
    rows::report(report, &rounds);
}
