//! The adapter suite's harnesses ([`oncely::testing::adapter`]): RabbitMQ (3.10 or 4.0)
//! through the AMQP runner, and RocketMQ through the concurrent listener, each on a
//! destination of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::BasicGetOptions;
use lapin::{Channel, ConnectionProperties};
use oncely::report::RunReport;
use oncely::testing::adapter::{AdapterHarness, DeadLetterCopy, Features, Interruption, Interrupts};
use oncely::{BoxError, Envelope, KeyExtractor, Outcome, Route};
use oncely_amqp::{DEFAULT_KEY_HEADER, ORIGINAL_ROUTING_KEY_HEADER, Producer, Runner, Topology};
use oncely_rocketmq::rocketmq_model::common::message::MessageConst;
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use oncely_rocketmq::{ConcurrentListener, GroupLag};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::amqp::{Broker, close_connections_on, header_text, start_runner, topology_with_orders};
use crate::rocketmq::{ScratchRocketMq, namesrv_addr};
use crate::unique;

/// A RabbitMQ topology of its own, run by [`Runner`] in drain mode.
pub struct AmqpHarness {
    broker: Broker,
    topology: Topology,
    channel: Channel,
    producer: Producer,
    /// Dead letters taken from the queue so far (reading takes them).
    read: Vec<DeadLetterCopy>,
}

impl AmqpHarness {
    /// A fresh topology on `broker`.
    pub async fn new(broker: Broker) -> Self {
        let (topology, channel) = topology_with_orders(broker, "contract", &[]).await;
        AmqpHarness {
            broker,
            topology,
            channel,
            producer: Producer::new(broker.connect().await),
            read: Vec::new(),
        }
    }
}

impl AdapterHarness for AmqpHarness {
    fn features(&self) -> Features {
        Features::none().with_native_delivery_count().with_delayed_retry()
    }

    fn key_extractor(&self) -> KeyExtractor {
        KeyExtractor::header(DEFAULT_KEY_HEADER)
    }

    fn source(&self) -> String {
        self.topology.queue().to_owned()
    }

    async fn publish(&mut self, key: Option<&str>, body: &[u8]) -> String {
        self.producer
            .publish("", self.topology.queue(), body, key)
            .await
            .expect("publish")
    }

    async fn drain<S>(&mut self, route: Route<S>) -> RunReport
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send,
    {
        let runner = Runner::new(route, self.topology.clone()).with_drain(Duration::from_millis(500));
        let (_, running) = start_runner(runner, self.broker.address(), &unique("oncely-contract"));
        let ran = tokio::time::timeout(Duration::from_secs(60), running).await;
        ran.expect("drained within a minute")
            .unwrap()
            .expect("the runner ends without an error")
    }

    async fn dead_letters(&mut self) -> Vec<DeadLetterCopy> {
        let queue = self.topology.dead_letter_queue();
        let get = || {
            self.channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        };
        while let Some(message) = get().await.expect("the dead-letter queue answers") {
            let names: Vec<String> = (message.delivery.properties.headers().as_ref())
                .map(|headers| headers.inner().keys().map(|name| name.to_string()).collect())
                .unwrap_or_default();
            let metadata = names
                .into_iter()
                .filter_map(|name| Some((name.clone(), header_text(&message, &name)?)))
                .collect();
            self.read.push(DeadLetterCopy {
                metadata,
                body: message.delivery.data.clone(),
            });
        }
        self.read.clone()
    }

    async fn drain_interrupted<S>(
        &mut self,
        route: impl Fn() -> Route<S> + Send + Sync,
        interrupts: Interrupts,
        how: Interruption,
        max_deliveries: u32,
    ) -> RunReport
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send,
    {
        // Two at a time, with more sent ahead: an interruption finds deliveries of both kinds.
        let runner = || {
            let runner = Runner::new(route(), self.topology.clone())
                .with_drain(Duration::from_millis(500))
                .with_max_deliveries(max_deliveries)
                .with_concurrency(2);
            match how {
                // A dead process's handlers stop with it.
                Interruption::Crash => runner.with_shutdown_grace(Duration::from_millis(100)),
                _ => runner,
            }
        };
        // The consumer process: one connection, which a crash closes on the broker's side
        // (everything unsettled goes back at once) and a shutdown closes once the runner
        // stopped; then a new process.
        let name = unique("oncely-contract-interrupted");
        let shutdown = Arc::new(Mutex::new(CancellationToken::new()));
        let interrupter = {
            let (broker, name, shutdown) = (self.broker, name.clone(), shutdown.clone());
            tokio::spawn(async move {
                loop {
                    interrupts.asked().await;
                    match how {
                        Interruption::Shutdown => shutdown.lock().expect("not poisoned").cancel(),
                        _ => {
                            // rabbitmqctl lists the connection once the broker has it: retry
                            // until one is closed, so that a crash asked for always happens.
                            for _ in 0..50 {
                                let name = name.clone();
                                let closed =
                                    tokio::task::spawn_blocking(move || close_connections_on(broker, &name));
                                if closed.await.unwrap_or(0) > 0 {
                                    break;
                                }
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                        }
                    }
                }
            })
        };
        let process = async {
            loop {
                let token = CancellationToken::new();
                *shutdown.lock().expect("not poisoned") = token.clone();
                let properties = ConnectionProperties::default().with_connection_name(name.clone().into());
                let Ok(connection) = crate::amqp::connect_to(&self.broker.address(), properties).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let Ok(channel) = connection.create_channel().await else {
                    continue;
                };
                let ran = runner().run(&channel, &token).await;
                let _ = connection.close(200, "consumer process ends".into()).await;
                if let Ok(report) = ran
                    && report.drained
                {
                    return report;
                }
            }
        };
        let report = tokio::time::timeout(Duration::from_secs(90), process).await;
        interrupter.abort();
        report.expect("drained within 90 s")
    }

    async fn tear_down(self) {
        self.topology
            .delete(&self.channel)
            .await
            .expect("delete the topology");
    }

    fn check_own_metadata(&self, dead: &DeadLetterCopy, key: Option<&str>) {
        let field = |name: &str| dead.metadata.get(name).map(String::as_str);
        assert_eq!(
            field(ORIGINAL_ROUTING_KEY_HEADER),
            Some(self.topology.queue()),
            "{:?}",
            dead.metadata
        );
        assert_eq!(
            field(DEFAULT_KEY_HEADER),
            key,
            "the key header kept: {:?}",
            dead.metadata
        );
    }
}

/// A RocketMQ topic and dead-letter topic of their own, run by [`ConcurrentListener`] until
/// its group has no lag.
pub struct RocketMqHarness {
    rocketmq: ScratchRocketMq,
    dead: Arc<Mutex<Vec<MessageExt>>>,
    /// How far the dead-letter reader is behind the dead-letter topic.
    reader_lag: GroupLag,
}

impl RocketMqHarness {
    /// A fresh topic and dead-letter topic, created before anything subscribes.
    pub async fn new() -> Self {
        let mut rocketmq = ScratchRocketMq::new("contract").await;
        rocketmq.create_topics(4).await;
        let dead = rocketmq.collect_dead_letters().await;
        let reader_lag = GroupLag::start(
            rocketmq.runtime(),
            &namesrv_addr(),
            &rocketmq.dead_letter_reader_group(),
            &rocketmq.dead_letter_topic,
        )
        .await
        .expect("the dead-letter reader's lag");
        RocketMqHarness {
            rocketmq,
            dead,
            reader_lag,
        }
    }
}

impl AdapterHarness for RocketMqHarness {
    fn features(&self) -> Features {
        Features::none().with_ordered().with_delayed_retry()
    }

    fn key_extractor(&self) -> KeyExtractor {
        KeyExtractor::broker_key()
    }

    fn source(&self) -> String {
        self.rocketmq.topic.clone()
    }

    async fn publish(&mut self, key: Option<&str>, body: &[u8]) -> String {
        self.rocketmq.send(self.rocketmq.message(key, body)).await
    }

    async fn drain<S>(&mut self, route: Route<S>) -> RunReport
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send,
    {
        // No handler pulls these: one consumer runs until drained.
        let route = move || route.clone();
        (self.drain_interrupted(route, Interrupts::new(), Interruption::Shutdown, 0)).await
    }

    async fn drain_interrupted<S>(
        &mut self,
        route: impl Fn() -> Route<S> + Send + Sync,
        interrupts: Interrupts,
        how: Interruption,
        _: u32,
    ) -> RunReport
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send,
    {
        let rocketmq = &self.rocketmq;
        let (topic, group) = (&rocketmq.topic, &rocketmq.group);
        let lag = GroupLag::start(rocketmq.runtime(), &namesrv_addr(), group, topic)
            .await
            .expect("the group's lag");
        let drained = async {
            loop {
                let listener = ConcurrentListener::new(route(), Handle::current(), rocketmq.dead_letters());
                let progress = listener.progress();
                let process = rocketmq.consumer_process(topic, group, listener).await;
                // The broker's first retry comes after 10 s.
                tokio::select! {
                    report = progress.wait_until_drained(Duration::from_secs(2), &lag) => {
                        process.shut_down().await;
                        return report;
                    }
                    () = interrupts.asked() => match how {
                        Interruption::Shutdown => process.shut_down().await,
                        _ => process.kill(),
                    },
                }
            }
        };
        let report = tokio::time::timeout(Duration::from_secs(120), drained)
            .await
            .expect("the group drains within two minutes");
        lag.shutdown().await;
        report
    }

    async fn tear_down(self) {
        self.reader_lag.shutdown().await;
        self.rocketmq.shutdown().await;
    }

    fn check_own_metadata(&self, dead: &DeadLetterCopy, key: Option<&str>) {
        let keys = dead.metadata.get(MessageConst::PROPERTY_KEYS).map(String::as_str);
        assert_eq!(keys, key, "KEYS kept: {:?}", dead.metadata);
    }

    async fn dead_letters(&mut self) -> Vec<DeadLetterCopy> {
        // Each dead letter was stored before its original was acknowledged; the reader has
        // them all once its group has no lag (its offsets are committed every few seconds).
        let caught_up = async {
            while self.reader_lag.pending().await.ok().flatten() != Some(0) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), caught_up)
            .await
            .expect("the dead-letter reader catches up within 30 s");
        let dead = self.dead.lock().expect("not poisoned").clone();
        dead.iter()
            .map(|message| DeadLetterCopy {
                metadata: message
                    .properties()
                    .iter()
                    .map(|(name, value)| (name.to_string(), value.to_string()))
                    .collect::<HashMap<_, _>>(),
                body: message.body().map(|body| body.to_vec()).unwrap_or_default(),
            })
            .collect()
    }
}
