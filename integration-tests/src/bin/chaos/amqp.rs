//! The RabbitMQ side of the chaos run: queues of the run's own, a confirmed publisher, the
//! broker's own fault (the consumers' connections closed by the broker), the quiet check
//! and the dead-letter queue.

use clap::ValueEnum;
use integration_tests::amqp::{Broker, close_connections_named, connect, drain, scratch_topology};
use lapin::Channel;
use lapin::message::BasicGetMessage;
use lapin::types::AMQPValue;
use oncely_amqp::{Producer, Topology};

use crate::dead_letters::{DeadLetters, reason_code};
use crate::options::Options;

/// The run's queues, a channel of the run's own to them, and the dead letters taken from
/// the dead-letter queue so far.
pub(crate) struct Amqp {
    topology: Topology,
    channel: Channel,
    dead_letters: Vec<BasicGetMessage>,
}

impl Amqp {
    /// Declares the run's queues.
    pub(crate) async fn start() -> Self {
        let topology = scratch_topology("chaos");
        let channel = connect()
            .await
            .expect("RabbitMQ")
            .create_channel()
            .await
            .expect("a channel");
        topology.declare(&channel).await.expect("declare the queues");
        Amqp {
            topology,
            channel,
            dead_letters: Vec::new(),
        }
    }

    /// The arguments of `amqp_consumer`: the run's queue, its schema (or database) and Redis
    /// prefix, the stack, the name of its connections, the store, and the prefetch.
    pub(crate) fn consumer_args(
        &self,
        schema: &str,
        prefix: &str,
        options: &Options,
        name: &str,
    ) -> Vec<String> {
        let store = options.store.to_possible_value().expect("no store is hidden");
        let mut args = [
            self.topology.queue(),
            schema,
            prefix,
            options.stack.name(),
            name,
            "--store",
            store.get_name(),
        ]
        .map(str::to_owned)
        .to_vec();
        if options.default_prefetch {
            args.push("--default-prefetch".to_owned());
        }
        args
    }

    /// A publisher to the run's queue on a connection of its own.
    pub(crate) async fn publisher(&self) -> Publisher {
        Publisher {
            producer: Producer::new(connect().await.expect("RabbitMQ")),
            queue: self.topology.queue().to_owned(),
        }
    }

    /// True when every poison message is dead-lettered and the run's work, suspect and retry
    /// queues hold no message (ready or unacknowledged): every copy has been answered.
    ///
    /// The queue counts alone do not say it: `rabbitmqctl` reads a quorum queue's count from
    /// the figures the queue publishes on its tick (every 5 s), each queue on its own tick.
    /// So a poison message moved from the work queue to the suspect queue between their
    /// ticks is in neither count for seconds, and a run once ended with a poison message one
    /// crash short of its dead letter. Its dead letter is what shows it answered.
    pub(crate) async fn idle(&mut self, poison: usize) -> bool {
        self.take_dead_letters().await;
        if self.dead_letters().poison_at_limit.len() < poison {
            return false;
        }
        let topology = self.topology.clone();
        tokio::task::spawn_blocking(move || messages_in_queues(&topology))
            .await
            .ok()
            .flatten()
            == Some(0)
    }

    /// Moves what the dead-letter queue holds into the run's dead letters.
    async fn take_dead_letters(&mut self) {
        let messages = drain(&self.channel, self.topology.dead_letter_queue()).await;
        self.dead_letters.extend(messages);
    }

    /// The dead letters taken so far, sorted.
    fn dead_letters(&self) -> DeadLetters {
        DeadLetters::sort(self.dead_letters.iter().map(|message| {
            let code = reason_code(|name| header(message, name));
            (code, &message.delivery.data[..])
        }))
    }

    /// Takes every message left in the dead-letter queue and sorts them with those taken
    /// before, then deletes the queues.
    pub(crate) async fn finish(mut self) -> DeadLetters {
        self.take_dead_letters().await;
        let dead = self.dead_letters();
        self.topology
            .delete(&self.channel)
            .await
            .expect("delete the queues");
        dead
    }
}

/// A new message id, as the AMQP producer makes them.
pub(crate) fn new_message_id() -> String {
    Producer::new_message_id()
}

/// Closes the connections named `name` on the broker's side; false if none was open.
pub(crate) async fn close_connections(name: &str) -> bool {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || close_connections_named(&name))
        .await
        .unwrap_or(0)
        > 0
}

/// Publishes to the run's queue with confirms.
pub(crate) struct Publisher {
    producer: Producer,
    queue: String,
}

impl Publisher {
    /// Publishes `body` with the message id `id` and the business key `key`, and waits for
    /// the broker's confirm.
    pub(crate) async fn send(&self, body: &[u8], key: &str, id: &str) {
        self.producer
            .publish_with_id(id, "", &self.queue, body, Some(key))
            .await
            .expect("publish");
    }
}

/// Messages (ready and unacknowledged) in the run's work, suspect and retry queues.
fn messages_in_queues(topology: &Topology) -> Option<u64> {
    let listing =
        Broker::at_amqp_addr().rabbitmqctl(&["list_queues", "-q", "--no-table-headers", "name", "messages"]);
    let mut total = 0;
    for line in listing.lines() {
        let mut fields = line.split_whitespace();
        let (Some(name), Some(count)) = (fields.next(), fields.next()) else {
            continue;
        };
        if name.starts_with(topology.queue()) && name != topology.dead_letter_queue() {
            total += count.parse::<u64>().ok()?;
        }
    }
    Some(total)
}

/// A message's header `name`, if it is text.
fn header(message: &BasicGetMessage, name: &str) -> Option<String> {
    let headers = message.delivery.properties.headers().as_ref()?;
    match headers.inner().get(name) {
        Some(AMQPValue::LongString(text)) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        _ => None,
    }
}
