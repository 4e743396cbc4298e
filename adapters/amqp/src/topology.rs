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
    retry_delays: Vec<Duration>,
}

impl Topology {
    /// The topology of work queue `queue`, with retry delays of 1 s, 5 s, 30 s and 2 min.
    pub fn new(queue: impl Into<String>) -> Self {
        Topology {
            queue: queue.into(),
            retry_delays: [1, 5, 30, 120].map(Duration::from_secs).to_vec(),
        }
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

    /// The retry queue for `delay`.
    pub fn retry_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}ms", self.queue, delay.as_millis())
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// The suspect queue: messages that came back unsettled, handled one at a time.
    pub fn suspect_queue(&self) -> String {
        format!("{}.suspect", self.queue)
    }

    /// The retry queue a message at `attempt` goes to, given the delay its outcome suggests.
    pub fn retry_queue_for(&self, suggested: Option<Duration>, attempt: u32) -> String {
        let last = *self.retry_delays.last().expect("at least one retry delay");
        let delay = match suggested {
            Some(suggested) => self
                .retry_delays
                .iter()
                .copied()
                .find(|delay| *delay >= suggested)
                .unwrap_or(last),
            None => self
                .retry_delays
                .get(attempt.saturating_sub(1) as usize)
                .copied()
                .unwrap_or(last),
        };
        self.retry_queue(delay)
    }

    /// Declares every queue of the topology.
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for queue in [self.queue.clone(), self.suspect_queue(), self.dead_letter_queue()] {
            channel.queue_declare(queue.into(), durable, quorum()).await?;
        }
        for delay in &self.retry_delays {
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
            channel
                .queue_declare(self.retry_queue(*delay).into(), durable, arguments)
                .await?;
        }
        Ok(())
    }

    /// Deletes every queue of the topology, with the messages in them (tests, teardown).
    pub async fn delete(&self, channel: &Channel) -> Result<(), Error> {
        let mut queues = vec![self.queue.clone(), self.suspect_queue(), self.dead_letter_queue()];
        queues.extend(self.retry_delays.iter().map(|delay| self.retry_queue(*delay)));
        for queue in queues {
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
    }
}
