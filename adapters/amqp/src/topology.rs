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
/// consumer is found. Every queue but the dead-letter queue dead-letters *at least once*
/// (`x-dead-letter-strategy: at-least-once`, `x-overflow: reject-publish`): the retry queues
/// to the work queue when their delay runs out — the broker keeps a message in the retry
/// queue until the work queue has confirmed it, so a missing work queue delays retries
/// (RabbitMQ tries again about every three minutes) instead of dropping them —, and the work
/// and suspect queues to the dead-letter queue, as a safety net: RabbitMQ 4.0 and later give
/// every quorum queue a delivery limit of 20 and **drop** a message past it unless the queue
/// dead-letters. Past that limit the broker's copy reaches the dead-letter queue without
/// oncely's reason headers (the broker's `x-death` and `x-first-death-reason:
/// delivery_limit` say why), so keep [`Runner::with_max_deliveries`](crate::Runner::with_max_deliveries)
/// below 20. The dead-letter queue itself has a delivery limit of [`DEAD_LETTER_DELIVERY_LIMIT`]
/// (`x-delivery-limit`), so that whoever reads dead letters and returns them (a management
/// UI's "nack, requeue", a replay tool that crashes) cannot make 4.x drop one. Tested on
/// RabbitMQ 3.10 and 4.0.
///
/// [`declare`](Topology::declare) is idempotent as long as the queues were declared with the
/// same arguments; a queue of the same name with other arguments makes the broker refuse
/// (`PRECONDITION_FAILED`), and RabbitMQ never changes a declared queue's arguments. The work,
/// suspect and dead-letter queues declared by oncely 0.1 (before the safety net) are such
/// queues: keep them with [`with_safety_net_by_policy`](Topology::with_safety_net_by_policy)
/// and apply every one of [`safety_net_policies`](Topology::safety_net_policies) once, or
/// move their messages and delete them. A classic queue of the same name (declared by hand) must be moved and
/// deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    queue: String,
    suspect_queue: String,
    dead_letter_queue: String,
    retry_delays: Vec<Duration>,
    /// The retry queues' names, in the order of `retry_delays`.
    retry_queues: Vec<String>,
    /// Whether the work and suspect queues are declared with their dead-letter arguments
    /// (false: a policy gives them, for queues declared before the arguments existed).
    safety_net_declared: bool,
    /// Whether the work queue is taken as it exists (declared passively).
    work_queue_as_is: bool,
}

/// The delivery limit of the dead-letter queue: high enough never to be reached by people
/// and tools reading dead letters, and set because RabbitMQ 4.x would otherwise drop a dead
/// letter returned 20 times (`-1`, 4.x's "no limit", drops at once on 3.10).
pub const DEAD_LETTER_DELIVERY_LIMIT: i64 = 1_000_000;

/// A RabbitMQ policy that gives queues of a [`Topology`] declared without them the arguments
/// of its safety net (see [`Topology::with_safety_net_by_policy`]). Apply it with
/// [`rabbitmqctl_arguments`](SafetyNetPolicy::rabbitmqctl_arguments) or the management API.
///
/// RabbitMQ applies one policy per queue (the highest priority's): if your own policies
/// match these queues, add the definition's keys to yours instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetyNetPolicy {
    /// The policy's name: `oncely-dead-letter-QUEUE` (work and suspect queues) or
    /// `oncely-dead-letter-queue-QUEUE` (the dead-letter queue).
    pub name: String,
    /// The regular expression of the queue names it applies to.
    pub pattern: String,
    /// Its definition, as JSON.
    pub definition: String,
}

impl SafetyNetPolicy {
    /// The arguments of `rabbitmqctl` that set the policy (for queues, priority 1):
    /// `set_policy --apply-to queues --priority 1 NAME PATTERN DEFINITION`. The broker
    /// applies it to the queues shortly after it answered.
    pub fn rabbitmqctl_arguments(&self) -> Vec<String> {
        ["set_policy", "--apply-to", "queues", "--priority", "1"]
            .into_iter()
            .map(str::to_owned)
            .chain([self.name.clone(), self.pattern.clone(), self.definition.clone()])
            .collect()
    }
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
            safety_net_declared: true,
            work_queue_as_is: false,
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

    /// Declares the work and suspect queues without their dead-letter arguments, as oncely 0.1
    /// did (and the dead-letter queue without its delivery limit), so that
    /// [`declare`](Topology::declare) accepts queues declared then; their safety net then
    /// comes from [`safety_net_policies`](Topology::safety_net_policies), which you apply
    /// once. Without either, RabbitMQ 4.x drops a message past its delivery limit.
    pub fn with_safety_net_by_policy(mut self) -> Self {
        self.safety_net_declared = false;
        self
    }

    /// Takes the work queue as it already exists — a classic or quorum queue that producers
    /// already publish to, with whatever arguments it has — instead of declaring it: it is
    /// declared passively (it must exist; nothing of it changes), and the suspect, retry and
    /// dead-letter queues are declared beside it as usual. The drop-in onto a live queue,
    /// without moving a message (README, "Moving onto a queue that already exists").
    ///
    /// What it costs, on a classic work queue:
    /// - The broker counts no deliveries there (`x-delivery-count` is a quorum queue's): a
    ///   redelivered message is taken as returned once, and moves to the (quorum) suspect
    ///   queue, where it runs alone and is counted. A message that kills its consumer every
    ///   time is thus dead-lettered after one run among others plus
    ///   [`Runner::with_max_deliveries`](crate::Runner::with_max_deliveries) runs alone, as
    ///   on a quorum queue — but every redelivery, a restart's included (up to a prefetch's
    ///   worth per consumer), runs alone through the suspect queue, one at a time.
    /// - The work queue has no safety net of oncely's: whatever its own dead-letter settings
    ///   say holds (a quorum queue on RabbitMQ 4.x without a dead-letter target drops a
    ///   message past 20 deliveries — the runner moves a returned message to the suspect
    ///   queue at its first return, so only another consumer of the queue could get there).
    /// - A classic queue is not replicated: a node lost is its messages lost, whatever
    ///   oncely does.
    pub fn with_existing_work_queue(mut self) -> Self {
        self.work_queue_as_is = true;
        self
    }

    /// The policies that give this topology's queues the safety net that
    /// [`declare`](Topology::declare) gives new ones: the work and suspect queues their
    /// dead-letter target, the dead-letter queue its [`DEAD_LETTER_DELIVERY_LIMIT`]. See
    /// [`SafetyNetPolicy`].
    pub fn safety_net_policies(&self) -> Vec<SafetyNetPolicy> {
        let escaped: String = self
            .queue
            .chars()
            .flat_map(|c| {
                let special = "\\.^$|?*+()[]{}".contains(c);
                special.then_some('\\').into_iter().chain([c])
            })
            .collect();
        let dead_lettering = serde_json::json!({
            "dead-letter-exchange": "",
            "dead-letter-routing-key": self.dead_letter_queue,
            "dead-letter-strategy": "at-least-once",
            "overflow": "reject-publish",
        });
        let keeping = serde_json::json!({ "delivery-limit": DEAD_LETTER_DELIVERY_LIMIT });
        vec![
            SafetyNetPolicy {
                name: format!("oncely-dead-letter-{}", self.queue),
                pattern: format!("^{escaped}(\\.suspect)?$"),
                definition: dead_lettering.to_string(),
            },
            SafetyNetPolicy {
                name: format!("oncely-dead-letter-queue-{}", self.queue),
                pattern: format!("^{escaped}\\.dlq$"),
                definition: keeping.to_string(),
            },
        ]
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
            None => self.ladder_step(attempt),
        };
        &self.retry_queues[position]
    }

    /// The position in the ladder of a failed attempt's retry: one step up per attempt,
    /// the last step repeating.
    fn ladder_step(&self, attempt: u32) -> usize {
        (attempt.saturating_sub(1) as usize).min(self.retry_delays.len() - 1)
    }

    /// How long a delivery that fails every time waits in the retry queues before a route
    /// allowing `max_attempts` dead-letters it: the ladder's delay for each attempt before
    /// the last (each failure moves one step up; the last step repeats). The default ladder
    /// (1 s, 5 s, 30 s, 2 min) with the route's default 16 attempts takes 24 min 36 s, plus
    /// the handler's own time. Keep the record's retention above it (README, "The record's
    /// retention").
    pub fn retry_ladder_total(&self, max_attempts: u32) -> Duration {
        (1..max_attempts.max(1))
            .map(|attempt| self.retry_delays[self.ladder_step(attempt)])
            .sum()
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

    /// Declares every queue of the topology ([`with_existing_work_queue`](Self::with_existing_work_queue):
    /// checks the work queue exists). A queue of the same name declared with other
    /// arguments is [`Error::QueueMismatch`], naming the queue and the argument.
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        for queue in [self.queue(), self.suspect_queue()] {
            let declared = match (
                queue == self.queue() && self.work_queue_as_is,
                self.safety_net_declared,
            ) {
                (true, _) => channel.queue_declare(queue.into(), passive, FieldTable::default()),
                (false, true) => {
                    channel.queue_declare(queue.into(), durable, dead_lettering_to(self.dead_letter_queue()))
                }
                (false, false) => channel.queue_declare(queue.into(), durable, quorum()),
            };
            declared.await.map_err(|error| Error::declaring(queue, error))?;
        }
        let mut kept = quorum();
        if self.safety_net_declared {
            kept.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(DEAD_LETTER_DELIVERY_LIMIT),
            );
        }
        let dead_letters = self.dead_letter_queue();
        channel
            .queue_declare(dead_letters.into(), durable, kept)
            .await
            .map_err(|error| Error::declaring(dead_letters, error))?;
        for (delay, queue) in self.retry_delays.iter().zip(self.retry_queues()) {
            let mut arguments = dead_lettering_to(self.queue());
            arguments.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(delay.as_millis() as i64),
            );
            channel
                .queue_declare(queue.into(), durable, arguments)
                .await
                .map_err(|error| Error::declaring(queue, error))?;
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

/// A quorum queue's arguments to dead-letter through the default exchange to `queue`, at
/// least once: the broker keeps the message until `queue` confirmed it (which needs
/// `reject-publish` overflow).
fn dead_lettering_to(queue: &str) -> FieldTable {
    let mut arguments = quorum();
    for (name, value) in [
        ("x-dead-letter-exchange", ""),
        ("x-dead-letter-routing-key", queue),
        ("x-dead-letter-strategy", "at-least-once"),
        ("x-overflow", "reject-publish"),
    ] {
        arguments.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    arguments
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ladder_total_is_the_wait_before_a_failing_delivery_is_dead_lettered() {
        let topology = Topology::new("orders");
        assert_eq!(topology.retry_ladder_total(16), Duration::from_secs(24 * 60 + 36));
        assert_eq!(topology.retry_ladder_total(1), Duration::ZERO);
        assert_eq!(topology.retry_ladder_total(3), Duration::from_secs(6));
    }

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

    #[test]
    fn the_safety_net_policies_match_exactly_their_queues() {
        let policies = Topology::new("shop.orders").safety_net_policies();
        let [dead_lettering, keeping] = policies.as_slice() else {
            panic!("two policies: {policies:?}")
        };
        assert_eq!(dead_lettering.pattern, r"^shop\.orders(\.suspect)?$");
        assert_eq!(dead_lettering.name, "oncely-dead-letter-shop.orders");
        let definition: serde_json::Value = serde_json::from_str(&dead_lettering.definition).unwrap();
        assert_eq!(definition["dead-letter-routing-key"], "shop.orders.dlq");
        assert_eq!(definition["dead-letter-exchange"], "");
        assert_eq!(dead_lettering.rabbitmqctl_arguments()[0], "set_policy");
        assert_eq!(keeping.pattern, r"^shop\.orders\.dlq$");
        let definition: serde_json::Value = serde_json::from_str(&keeping.definition).unwrap();
        assert_eq!(definition["delivery-limit"], DEAD_LETTER_DELIVERY_LIMIT);
    }
}
