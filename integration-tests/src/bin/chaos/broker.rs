//! What differs between the brokers, behind one face: where messages go, how the consumers
//! are started, when the run is quiet, where dead letters are read; and the publisher.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;

use crate::dead_letters::DeadLetters;
use crate::options::{BrokerKind, Options};
use crate::plan::Message;
use crate::tables::Ledger;
use crate::{amqp, rocketmq};

impl BrokerKind {
    /// A new message id, as the broker's producers make them.
    pub(crate) fn new_message_id(self) -> String {
        match self {
            BrokerKind::Amqp => amqp::new_message_id(),
            BrokerKind::RocketMq => rocketmq::new_message_id(),
        }
    }
}

/// A consumer binary, its arguments and environment variables.
pub(crate) type ConsumerCommand = (&'static str, Vec<String>, Vec<(&'static str, String)>);

/// What differs between the brokers: where messages go, how the consumers are started,
/// when the run is quiet, where dead letters are read.
pub(crate) enum Broker {
    /// RabbitMQ: the run's queues.
    Amqp(Box<amqp::Amqp>),
    /// RocketMQ: the run's topics and client.
    RocketMq(Box<rocketmq::RocketMq>),
}

impl Broker {
    /// The run's queues or topics, made ready on `kind`.
    pub(crate) async fn start(kind: BrokerKind) -> Self {
        match kind {
            BrokerKind::Amqp => Broker::Amqp(Box::new(amqp::Amqp::start().await)),
            BrokerKind::RocketMq => Broker::RocketMq(Box::new(rocketmq::RocketMq::start().await)),
        }
    }

    /// The consumer binary, its arguments, and its environment beside the run's own.
    /// `schema` is the run's schema, or its database on MySQL/MariaDB.
    pub(crate) fn consumer(
        &self,
        schema: &str,
        prefix: &str,
        options: &Options,
        name: &str,
    ) -> ConsumerCommand {
        match self {
            Broker::Amqp(amqp) => (
                "amqp_consumer",
                amqp.consumer_args(schema, prefix, options, name),
                Vec::new(),
            ),
            Broker::RocketMq(rocketmq) => (
                "rocketmq_consumer",
                rocketmq.consumer_args(schema, prefix),
                rocketmq.consumer_environment(),
            ),
        }
    }

    /// A publisher to the run's queue or topic.
    pub(crate) async fn publisher(&self) -> Publisher {
        match self {
            Broker::Amqp(amqp) => Publisher::Amqp(Box::new(amqp.publisher().await)),
            Broker::RocketMq(rocketmq) => Publisher::RocketMq(rocketmq.publisher()),
        }
    }

    /// Whether the outside faults go on after the last message was sent, until every key
    /// is applied: with RabbitMQ, whose retries come back within a second; not with
    /// RocketMQ, whose retries back off by the broker's delay levels (10 s, 30 s, 1 min,
    /// 2 min, …), so that faults past the last message would only stretch that tail.
    pub(crate) fn faults_after_publishing(&self) -> bool {
        matches!(self, Broker::Amqp(_))
    }

    /// True when nothing is left to answer but what the ledger already shows (see the
    /// crate docs), at [`quiet_checks`](Self::quiet_checks) checks in a row, a second apart.
    /// RabbitMQ: every poison message is dead-lettered and the run's queues are empty.
    /// RocketMQ: every key is applied and every poison message dead-lettered.
    pub(crate) async fn idle(&mut self, options: &Options, ledger: &Ledger) -> bool {
        match self {
            Broker::Amqp(amqp) => amqp.idle(options.poison).await,
            Broker::RocketMq(rocketmq) => {
                ledger.applied_keys >= options.keys as i64 && rocketmq.idle(options.poison)
            }
        }
    }

    /// RabbitMQ: seven, six seconds or more from the first to the last, longer than a quorum
    /// queue's tick (5 s), on which it publishes the count `rabbitmqctl` reads: every queue's
    /// count is a fresh one at least once in the window.
    /// RocketMQ: fifteen, longer than its first retry delay (10 s), so copies sent back
    /// meanwhile are answered.
    pub(crate) fn quiet_checks(&self) -> usize {
        match self {
            Broker::Amqp(_) => 7,
            Broker::RocketMq(_) => 15,
        }
    }

    /// The dead letters; the run's queues deleted, or its client shut down.
    pub(crate) async fn finish(self) -> DeadLetters {
        match self {
            Broker::Amqp(amqp) => amqp.finish().await,
            Broker::RocketMq(rocketmq) => rocketmq.finish().await,
        }
    }
}

/// Sends the plan's messages to the run's queue or topic.
pub(crate) enum Publisher {
    /// To the run's queue, with confirms.
    Amqp(Box<amqp::Publisher>),
    /// To the run's topic, re-sending until stored.
    RocketMq(rocketmq::Publisher),
}

impl Publisher {
    /// Sends `message` under `id` and waits until the broker stored it.
    async fn send(&self, message: Message, id: &str) {
        let (body, key) = (message.body(), message.key());
        match self {
            Publisher::Amqp(publisher) => publisher.send(&body, &key, id).await,
            Publisher::RocketMq(publisher) => publisher.send(&body, &key, id).await,
        }
    }
}

/// Publishes the plan at `rate` messages a second on eight concurrent publishers sharing
/// one publisher (one confirmed channel, or one producer), so that the faults fall while
/// messages still arrive; answers when the last message was stored.
pub(crate) async fn publish(plan: Vec<(Message, String)>, publisher: Publisher, rate: u64) -> SystemTime {
    let publisher = Arc::new(publisher);
    let plan = Arc::new(plan);
    let lanes: Vec<_> = (0..8)
        .map(|lane| {
            let (publisher, plan) = (publisher.clone(), plan.clone());
            tokio::spawn(async move {
                let mut pace = tokio::time::interval(Duration::from_secs_f64(8.0 / rate as f64));
                for (message, id) in plan.iter().skip(lane).step_by(8) {
                    pace.tick().await;
                    publisher.send(*message, id).await;
                }
            })
        })
        .collect();
    for lane in lanes {
        lane.await.expect("a publisher");
    }
    SystemTime::now()
}

/// When the publisher sent its last message, or now if it is still sending (the time limit
/// passed): then it is stopped.
pub(crate) async fn stop_publishing(publishing: JoinHandle<SystemTime>) -> SystemTime {
    if publishing.is_finished() {
        publishing.await.expect("the publisher")
    } else {
        publishing.abort();
        SystemTime::now()
    }
}
