//! The queues a route consumes from, retries through and dead-letters to.

use std::time::Duration;

use lapin::Channel;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::error::Error;

/// A work queue with its delayed-retry queues, its suspect queue and its dead-letter queue.
///
/// - work queue `QUEUE`: where messages are consumed;
/// - retry queues `QUEUE.retry.DELAYms`, one per delay: a message sent there waits out the
///   queue's message TTL and is dead-lettered by the broker back to the work queue (default
///   exchange, routing key `QUEUE`) — a delayed retry with no plugin;
/// - suspect queue `QUEUE.suspect`: messages that came back unsettled — their consumer
///   died or lost its channel while holding them — handled one at a time, so that a message
///   that crashes its process is counted alone (see [`Runner`](crate::Runner));
/// - dead-letter queue `QUEUE.dlq`: messages that can never be processed, with the reason in
///   their headers.
///
/// All are durable quorum queues (RabbitMQ 3.10 or later): the broker counts each message's
/// unsettled deliveries (`x-delivery-count`), which is how a message that kills its
/// consumer is found, and the retry queues dead-letter *at least once*
/// (`x-dead-letter-strategy: at-least-once`, `x-overflow: reject-publish`): the broker keeps
/// a message in the retry queue until the work queue has confirmed it, so a missing work
/// queue delays retries (RabbitMQ tries again about every three minutes) instead of dropping
/// them. Tested on RabbitMQ 3.10; the work and suspect queues dead-letter to the dead-letter
/// queue should a later broker drop a message from them by its own delivery limit.
///
/// [`declare`](Topology::declare) is idempotent as long as the queues were declared with the
/// same arguments; a queue of the same name with other arguments (a classic queue declared
/// by an earlier version) makes the broker refuse (`PRECONDITION_FAILED`): move its messages
/// and delete it first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    queue: String,
    suspect_queue: String,
    dead_letter_queue: String,
    retry_delays: Vec<Duration>,
    /// The retry queues' names, in the order of `retry_delays`.
    retry_queues: Vec<String>,
}

impl Topology {
    /// The topology of work queue `queue`, with retry delays of 1 s, 5 s, 30 s and 2 min.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Topology {
            suspect_queue: format!("{queue}.suspect"),
            dead_letter_queue: format!("{queue}.dlq"),
            retry_delays: Vec::new(),
            retry_queues: Vec::new(),
            queue,
        }
        .with_retry_delays([1, 5, 30, 120].map(Duration::from_secs))
    }

    /// Sets the retry delays (whole milliseconds, at least 1 ms; an empty list keeps the
    /// current ones). A retry without a suggested delay waits the delay at its attempt's
    /// position, the last one for every later attempt; one with a suggestion waits the
    /// shortest delay not below it.
    pub fn with_retry_delays(mut self, delays: impl IntoIterator<Item = Duration>) -> Self {
        let mut delays: Vec<Duration> = delays
            .into_iter()
            .map(|delay| Duration::from_millis(delay.as_millis().max(1) as u64))
            .collect();
        delays.sort();
        delays.dedup();
        if !delays.is_empty() {
            self.retry_queues = delays
                .iter()
                .map(|delay| format!("{}.retry.{}ms", self.queue, delay.as_millis()))
                .collect();
            self.retry_delays = delays;
        }
        self
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The retry queues' delays, shortest first.
    pub fn retry_delays(&self) -> &[Duration] {
        &self.retry_delays
    }

    /// The retry queue for `delay`, if `delay` is one of the retry delays.
    pub fn retry_queue(&self, delay: Duration) -> Option<&str> {
        let position = self.retry_delays.iter().position(|known| *known == delay)?;
        Some(&self.retry_queues[position])
    }

    /// The retry queues, shortest delay first.
    pub fn retry_queues(&self) -> impl Iterator<Item = &str> {
        self.retry_queues.iter().map(String::as_str)
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> &str {
        &self.dead_letter_queue
    }

    /// The suspect queue: messages that came back unsettled, handled one at a time.
    pub fn suspect_queue(&self) -> &str {
        &self.suspect_queue
    }

    /// The retry queue a message at `attempt` goes to, given the delay its outcome suggests.
    pub fn retry_queue_for(&self, suggested: Option<Duration>, attempt: u32) -> &str {
        let last = self.retry_delays.len() - 1;
        let position = match suggested {
            Some(suggested) => self
                .retry_delays
                .iter()
                .position(|delay| *delay >= suggested)
                .unwrap_or(last),
            None => (attempt.saturating_sub(1) as usize).min(last),
        };
        &self.retry_queues[position]
    }

    /// The queues a message waits in before it is consumed, in the order it moves through
    /// them: the retry queues, the work queue, the suspect queue (not the dead-letter
    /// queue). Counted in this order, a message moving on while they are counted is counted
    /// in its next queue rather than missed.
    fn waiting_queues(&self) -> impl Iterator<Item = &str> {
        self.retry_queues().chain([self.queue(), self.suspect_queue()])
    }

    /// How many messages are ready in the work, suspect and retry queues (a retry waiting
    /// out its delay is ready in its retry queue), by a passive declaration of each on
    /// `channel`. Messages delivered to a consumer and not yet acknowledged are not counted.
    /// A queue that does not exist is an error (and closes `channel`, as the broker does).
    pub async fn ready_messages(&self, channel: &Channel) -> Result<u64, Error> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let mut ready = 0;
        for queue in self.waiting_queues() {
            let declared = channel
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await?;
            ready += u64::from(declared.message_count());
        }
        Ok(ready)
    }

    /// Declares every queue of the topology.
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for queue in [self.queue(), self.suspect_queue(), self.dead_letter_queue()] {
            channel.queue_declare(queue.into(), durable, quorum()).await?;
        }
        for (delay, queue) in self.retry_delays.iter().zip(self.retry_queues()) {
            let mut arguments = quorum();
            let mut set = |name: &str, value: AMQPValue| {
                arguments.insert(name.into(), value);
            };
            set("x-message-ttl", AMQPValue::LongLongInt(delay.as_millis() as i64));
            set("x-dead-letter-exchange", AMQPValue::LongString("".into()));
            set(
                "x-dead-letter-routing-key",
                AMQPValue::LongString(self.queue.as_str().into()),
            );
            set(
                "x-dead-letter-strategy",
                AMQPValue::LongString("at-least-once".into()),
            );
            set("x-overflow", AMQPValue::LongString("reject-publish".into()));
            channel.queue_declare(queue.into(), durable, arguments).await?;
        }
        Ok(())
    }

    /// Deletes every queue of the topology, with the messages in them (tests, teardown).
    pub async fn delete(&self, channel: &Channel) -> Result<(), Error> {
        for queue in self.waiting_queues().chain([self.dead_letter_queue()]) {
            channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

fn quorum() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    arguments
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_queues_follow_the_suggestion_or_the_attempt() {
        let topology =
            Topology::new("orders").with_retry_delays([Duration::from_secs(5), Duration::from_secs(1)]);
        assert_eq!(topology.retry_queue_for(None, 1), "orders.retry.1000ms");
        assert_eq!(topology.retry_queue_for(None, 2), "orders.retry.5000ms");
        assert_eq!(topology.retry_queue_for(None, 9), "orders.retry.5000ms");
        assert_eq!(
            topology.retry_queue_for(Some(Duration::from_millis(1500)), 1),
            "orders.retry.5000ms"
        );
        assert_eq!(
            topology.retry_queue_for(Some(Duration::from_secs(60)), 1),
            "orders.retry.5000ms"
        );
        assert_eq!(topology.dead_letter_queue(), "orders.dlq");
        assert_eq!(topology.suspect_queue(), "orders.suspect");
        assert_eq!(
            topology.retry_queue(Duration::from_secs(5)),
            Some("orders.retry.5000ms")
        );
        assert_eq!(topology.retry_queue(Duration::from_secs(2)), None);
    }
}
