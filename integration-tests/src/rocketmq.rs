//! RocketMQ for the tests: the name server on `ROCKETMQ_NAMESRV`, and a topic, consumer
//! group and dead-letter topic of each test's own.

use std::sync::{Arc, Mutex};

use oncely_rocketmq::rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, DefaultMQProducer,
    DefaultMQPushConsumer, MQPushConsumer, MessageListenerConcurrently, MessageListenerOrderly,
};
use oncely_rocketmq::rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use oncely_rocketmq::rocketmq_model::common::message::message_single::Message;
use oncely_rocketmq::{DeadLetterTopic, OwnedClientRuntime};

/// The name server the tests use: `ROCKETMQ_NAMESRV`, or `127.0.0.1:9876`.
pub fn namesrv_addr() -> String {
    std::env::var("ROCKETMQ_NAMESRV").unwrap_or_else(|_| "127.0.0.1:9876".into())
}

/// A client runtime, a started producer, and a topic, consumer group and dead-letter topic
/// no other test uses. Topics are created by the first send (the broker auto-creates them)
/// and left behind; their names are unique, so reruns do not see each other's messages.
pub struct ScratchRocketMq {
    runtime: OwnedClientRuntime,
    producer: Arc<DefaultMQProducer>,
    consumers: Vec<DefaultMQPushConsumer>,
    batch_size: u32,
    /// The topic to send to and consume from.
    pub topic: String,
    /// The consumer group of the test's listener.
    pub group: String,
    /// The topic dead letters go to.
    pub dead_letter_topic: String,
}

impl ScratchRocketMq {
    /// Starts a client runtime and a producer for a fresh topic named after `name`.
    pub async fn new(name: &str) -> Self {
        let id = oncely::Token::random();
        Self::with_names(
            name,
            format!("oncely_test_{name}_{id}"),
            format!("oncely_test_{name}_group_{id}"),
            format!("oncely_test_{name}_dlq_{id}"),
        )
        .await
    }

    /// Starts a client runtime and a producer (its group named after `name`) for a topic,
    /// consumer group and dead-letter topic another process chose: a consumer process of a
    /// chaos run joins the run's with this.
    pub async fn with_names(name: &str, topic: String, group: String, dead_letter_topic: String) -> Self {
        let id = oncely::Token::random();
        let runtime = OwnedClientRuntime::new(&format!("oncely-test-{name}")).expect("a client runtime");
        let mut producer = DefaultMQProducer::builder(runtime.client_runtime())
            .producer_group(format!("oncely_test_{name}_producer_{id}"))
            .name_server_addr(namesrv_addr())
            .build();
        producer.start().await.unwrap_or_else(|error| {
            panic!("RocketMQ producer did not start ({error}); run integration-tests/services.sh rocketmq")
        });
        ScratchRocketMq {
            runtime,
            producer: Arc::new(producer),
            consumers: Vec::new(),
            batch_size: 1,
            topic,
            group,
            dead_letter_topic,
        }
    }

    /// Creates the topic and the dead-letter topic with `queues` queues each, before any
    /// consumer subscribes: the broker would create them on their first message, but a
    /// consumer subscribed before that only learns of them at its next route refresh
    /// (30 s). Call it before handing the producer out.
    pub async fn create_topics(&mut self, queues: i32) {
        let producer = Arc::get_mut(&mut self.producer).expect("the producer not handed out yet");
        let key = producer.create_topic_key().to_string();
        for topic in [&self.topic, &self.dead_letter_topic] {
            producer
                .create_topic(&key, topic, queues, Default::default())
                .await
                .unwrap_or_else(|error| panic!("create the topic {topic}: {error}"));
        }
    }

    /// A second started producer, on the test's runtime, that takes bodies up to
    /// `max_message_size` bytes (the test's own producer, and so its dead-letter
    /// destination, keeps the client's default of 4 MiB).
    pub async fn producer_for_bodies_up_to(&self, max_message_size: u32) -> DefaultMQProducer {
        let mut producer = DefaultMQProducer::builder(self.runtime.client_runtime())
            .producer_group(format!("oncely_test_big_producer_{}", oncely::Token::random()))
            .name_server_addr(namesrv_addr())
            .max_message_size(max_message_size)
            .build();
        producer.start().await.expect("a second producer");
        producer
    }

    /// Consumers started from now on hand their listeners up to `size` messages at once
    /// (`consume_message_batch_max_size`; 1 by default).
    pub fn with_batch_size(mut self, size: u32) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// The client runtime the test's producer and consumers run on.
    pub fn runtime(&self) -> &OwnedClientRuntime {
        &self.runtime
    }

    /// The test's started producer.
    pub fn producer(&self) -> Arc<DefaultMQProducer> {
        self.producer.clone()
    }

    /// The dead-letter destination of the test's listener.
    pub fn dead_letters(&self) -> DeadLetterTopic {
        DeadLetterTopic::new((*self.producer).clone(), self.dead_letter_topic.clone())
    }

    /// A message for the test's topic.
    pub fn message(&self, keys: Option<&str>, body: &[u8]) -> Message {
        message(&self.topic, keys, body)
    }

    /// Sends `message`, waits for the broker to store it, and returns its message id (the
    /// producer's `UNIQ_KEY`, which the adapter reads as the message id).
    pub async fn send(&self, message: Message) -> String {
        let result = self.producer.send(message).await.expect("send");
        let result = result.expect("a send result");
        result.msg_id.expect("a message id").to_string()
    }

    /// Sends `message` to the queue `queue % queues` of its topic, so that messages of one
    /// entity stay in order.
    pub async fn send_to_queue(&self, message: Message, queue: usize) {
        self.producer
            .send_with_selector(
                message,
                |queues: &[oncely_rocketmq::rocketmq_model::common::message::message_queue::MessageQueue],
                 _: &Message,
                 queue: &usize| queues.get(queue % queues.len().max(1)).cloned(),
                queue,
            )
            .await
            .expect("send to a queue");
    }

    /// Starts a consumer of `topic` in `group`, from the topic's first offset, with a
    /// concurrent listener.
    pub async fn consume_concurrently(
        &mut self,
        topic: &str,
        group: &str,
        listener: impl MessageListenerConcurrently + 'static,
    ) {
        let mut consumer = self.consumer(topic, group).await;
        consumer.register_message_listener_concurrently(listener);
        self.start(consumer).await;
    }

    /// As [`consume_concurrently`](Self::consume_concurrently), with an orderly listener.
    pub async fn consume_orderly(
        &mut self,
        topic: &str,
        group: &str,
        listener: impl MessageListenerOrderly + 'static,
    ) {
        let mut consumer = self.consumer(topic, group).await;
        consumer.register_message_listener_orderly(listener);
        self.start(consumer).await;
    }

    /// Starts a consumer of `topic` in `group` with a concurrent listener, as
    /// [`consume_concurrently`](Self::consume_concurrently) does, on a client runtime of its
    /// own: a consumer process, which can be killed, or shut down letting the listener calls
    /// running finish (up to [`PROCESS_SHUTDOWN_GRACE_MS`]).
    pub async fn consumer_process(
        &self,
        topic: &str,
        group: &str,
        listener: impl MessageListenerConcurrently + 'static,
    ) -> ConsumerProcess {
        let runtime = OwnedClientRuntime::new("oncely-test-process").expect("a client runtime");
        let mut consumer = (self.consumer_on(&runtime, topic, group, PROCESS_SHUTDOWN_GRACE_MS)).await;
        consumer.register_message_listener_concurrently(listener);
        consumer.start().await.expect("start a consumer");
        ConsumerProcess { consumer, runtime }
    }

    /// Collects every message of the dead-letter topic as it arrives.
    pub async fn collect_dead_letters(&mut self) -> Arc<Mutex<Vec<MessageExt>>> {
        let collected = Arc::new(Mutex::new(Vec::new()));
        let sink = collected.clone();
        let listener = move |messages: &[&MessageExt],
                             _: &ConsumeConcurrentlyContext|
              -> ClientResult<ConsumeConcurrentlyStatus> {
            let mut sink = sink.lock().expect("not poisoned");
            sink.extend(messages.iter().map(|message| (*message).clone()));
            Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
        };
        let (topic, group) = (self.dead_letter_topic.clone(), self.dead_letter_reader_group());
        self.consume_concurrently(&topic, &group, listener).await;
        collected
    }

    /// The consumer group of [`collect_dead_letters`](Self::collect_dead_letters)' reader.
    pub fn dead_letter_reader_group(&self) -> String {
        format!("{}_dlq_reader", self.group)
    }

    async fn consumer(&self, topic: &str, group: &str) -> DefaultMQPushConsumer {
        self.consumer_on(&self.runtime, topic, group, 0).await
    }

    /// A consumer whose shutdown waits up to `shutdown_grace_ms` for its listener calls.
    async fn consumer_on(
        &self,
        runtime: &OwnedClientRuntime,
        topic: &str,
        group: &str,
        shutdown_grace_ms: u64,
    ) -> DefaultMQPushConsumer {
        let mut consumer = DefaultMQPushConsumer::builder(runtime.client_runtime())
            .consumer_group(group.to_owned())
            .name_server_addr(namesrv_addr())
            .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
            // 1 unless a test asks for batches: the listener settles a batch as one, so a
            // retry of one message brings back every other message of its batch.
            .consume_message_batch_max_size(self.batch_size)
            .await_termination_millis_when_shutdown(shutdown_grace_ms)
            .build();
        consumer.subscribe(topic, "*").await.expect("subscribe");
        consumer
    }

    async fn start(&mut self, mut consumer: DefaultMQPushConsumer) {
        consumer.start().await.expect("start a consumer");
        self.consumers.push(consumer);
    }

    /// Shuts down the consumers started so far.
    pub async fn stop_consumers(&mut self) {
        for consumer in &mut self.consumers {
            consumer.shutdown().await;
        }
        // The listeners hold clones of the producer (their dead-letter topic).
        self.consumers.clear();
    }

    /// Shuts the consumers, the producer and the runtime down.
    pub async fn shutdown(mut self) {
        self.stop_consumers().await;
        if let Some(producer) = Arc::get_mut(&mut self.producer) {
            producer.shutdown().await;
        }
        self.runtime.shutdown().await;
    }
}

/// How long [`ConsumerProcess::shut_down`] lets the listener calls running finish.
pub const PROCESS_SHUTDOWN_GRACE_MS: u64 = 30_000;

/// A consumer on a client runtime of its own ([`ScratchRocketMq::consumer_process`]): shut
/// down as at a deploy, or killed as a process that dies.
pub struct ConsumerProcess {
    consumer: DefaultMQPushConsumer,
    runtime: OwnedClientRuntime,
}

impl ConsumerProcess {
    /// Shuts the consumer down — the listener calls running finish, up to
    /// [`PROCESS_SHUTDOWN_GRACE_MS`], its offsets are committed and its group told — then
    /// its runtime.
    pub async fn shut_down(mut self) {
        self.consumer.shutdown().await;
        self.runtime.shutdown().await;
    }

    /// Kills the consumer as a process that dies: its runtime stops at once — connections
    /// dropped, nothing committed since the last periodic commit, the group not told — and
    /// the consumer is never shut down. Listener calls running at that moment run to their
    /// end on the listener's own runtime, with nobody left to settle their messages.
    pub fn kill(self) {
        let ConsumerProcess { consumer, runtime } = self;
        drop(runtime);
        // Dropped, not shut down: a process that dies runs no shutdown.
        drop(consumer);
    }
}

/// A message for `topic` with `body` and, if given, `keys`.
pub fn message(topic: &str, keys: Option<&str>, body: &[u8]) -> Message {
    let builder = Message::builder().topic(topic).body_slice(body);
    match keys {
        Some(keys) => builder.key(keys),
        None => builder,
    }
    .build_unchecked()
}

/// The value of `name` among `message`'s properties.
pub fn property(message: &MessageExt, name: &str) -> Option<String> {
    message.properties().get(name).map(|value| value.to_string())
}
