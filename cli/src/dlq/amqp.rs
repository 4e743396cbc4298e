//! RabbitMQ's dead letters: the dead-letter queue of a [`Topology`]'s work queue.
//!
//! Reading takes messages with `basic.get` without acknowledging them, on a channel of its
//! own; closing that channel gives the broker back every message not acknowledged, in
//! place. oncely's dead-letter queue has a delivery limit of
//! [`DEAD_LETTER_DELIVERY_LIMIT`](oncely_amqp::DEAD_LETTER_DELIVERY_LIMIT), so giving
//! messages back never drops one. A replayed or purged dead letter is acknowledged, which
//! removes it — for a replay, only after the broker confirmed its copy in the work queue:
//! a replay that dies halfway loses nothing (at worst one message is in both queues, and
//! the record takes the second as a duplicate).

use std::collections::BTreeMap;
use std::time::SystemTime;

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};
use oncely::dead_letter;
use oncely_amqp::Topology;

use super::{DeadLetterInfo, DeadLetters, Filter, Whole};
use crate::Globals;
use crate::error::{CliError, Remote};

/// The header quorum queues put on a message delivered again (RabbitMQ's): it belongs to
/// the delivery, not to a replayed copy.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// What a replayed copy must not carry besides the dead-letter schema: the runner's counters
/// (a copy starts afresh). The schema's `ATTEMPTS` is also the runner's attempt counter.
const RUNNER_HEADERS: [&str; 3] = [
    oncely_amqp::SEAL_HEADER,
    oncely_amqp::RETURNS_HEADER,
    DELIVERY_COUNT_HEADER,
];

/// The dead-letter queue of one work queue, on a connection to `--amqp-addr`.
pub(super) struct DeadLetterQueue {
    connection: Connection,
    remote: Remote,
    /// The work queue: where a replay sends copies.
    queue: String,
    /// The work queue's suspect queue: with the work queue, the queues the broker
    /// dead-letters into the dead-letter queue.
    suspect_queue: String,
    dead_letter_queue: String,
    /// The channel dead letters are read on, unacknowledged: closing it gives them back.
    reading: Option<Channel>,
    /// The channel in confirm mode replayed copies are sent on.
    publisher: Option<Channel>,
}

impl DeadLetterQueue {
    /// Connects and checks that `queue`'s dead-letter queue exists, declaring nothing.
    pub(super) async fn open(globals: &Globals, queue: &str) -> Result<Self, CliError> {
        let remote = Remote::new("RabbitMQ", &globals.amqp_addr, globals.timeout);
        let tls = oncely_amqp::tls::config(&globals.tls()?)?;
        let runtime = oncely_amqp::lapin::runtime::default_runtime().map_err(|error| remote.failed(error))?;
        let connection = remote
            .call(Connection::connect_with_config(
                &globals.amqp_addr,
                ConnectionProperties::default(),
                tls,
                runtime,
            ))
            .await?;
        let topology = Topology::new(queue);
        let dead = DeadLetterQueue {
            connection,
            remote,
            queue: queue.to_owned(),
            suspect_queue: topology.suspect_queue().to_owned(),
            dead_letter_queue: topology.dead_letter_queue().to_owned(),
            reading: None,
            publisher: None,
        };
        dead.ready(&dead.dead_letter_queue).await?;
        Ok(dead)
    }

    /// How many messages are ready in `queue`, by a passive declaration on a channel of its
    /// own (a failed one closes its channel): [`CliError::QueueNotFound`] if it does not exist.
    async fn ready(&self, queue: &str) -> Result<u32, CliError> {
        let channel = self.remote.call(self.connection.create_channel()).await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = self
            .remote
            .call(channel.queue_declare(queue.into(), passive, FieldTable::default()))
            .await;
        match declared {
            Ok(declared) => {
                let _ = channel.close(200, "done".into()).await;
                Ok(declared.message_count())
            }
            Err(CliError::Service { source, .. }) if is_not_found(&*source) => Err(CliError::QueueNotFound {
                queue: queue.to_owned(),
                url: self.remote.url.clone(),
            }),
            Err(error) => Err(error),
        }
    }
}

impl DeadLetters for DeadLetterQueue {
    type Message = BasicGetMessage;

    fn name(&self) -> &str {
        &self.dead_letter_queue
    }

    /// Takes the messages ready at the start with `basic.get`, unacknowledged, on a channel
    /// of its own, until `filter`'s `--limit` matched.
    async fn read(
        &mut self,
        filter: Option<&Filter>,
    ) -> Result<Vec<(DeadLetterInfo, Self::Message)>, CliError> {
        let ready = self.ready(&self.dead_letter_queue).await? as usize;
        let channel = self.remote.call(self.connection.create_channel()).await?;
        let (now, mut matched) = (SystemTime::now(), 0);
        let mut letters = Vec::new();
        // Only those ready at the start: dead letters arriving meanwhile are not waited for.
        while letters.len() < ready && filter.is_none_or(|f| f.limit.is_none_or(|limit| matched < limit)) {
            let get = channel.basic_get(
                self.dead_letter_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            );
            let Some(message) = self.remote.call(get).await? else {
                break;
            };
            let info = describe(letters.len() + 1, &message, [&self.queue, &self.suspect_queue]);
            matched += usize::from(filter.is_none_or(|f| info.matches(f, now)));
            letters.push((info, message));
        }
        self.reading = Some(channel);
        Ok(letters)
    }

    fn whole<'m>(&self, message: &'m Self::Message) -> Whole<'m> {
        let mut headers = headers(message);
        // The broker's count of this letter's deliveries — every read of it included — not
        // the original's attempts (`x-oncely-attempts` is that).
        if let Some(count) = headers.remove(DELIVERY_COUNT_HEADER) {
            headers.insert(format!("{DELIVERY_COUNT_HEADER} (times read)"), count);
        }
        Whole {
            properties: properties(message),
            headers,
            body: &message.delivery.data,
        }
    }

    fn replayable(&self, info: &DeadLetterInfo) -> bool {
        info.oncely && info.source.as_deref() == Some(self.queue.as_str())
    }

    /// Checks that the work queue exists: a missing one is a clear error, not a returned copy.
    async fn check_replay(&self) -> Result<(), CliError> {
        self.ready(&self.queue).await.map(|_| ())
    }

    /// Publishes on a channel in confirm mode, opened at the first replay.
    async fn replay(&mut self, info: &DeadLetterInfo, message: &Self::Message) -> Result<(), CliError> {
        if self.publisher.is_none() {
            let channel = self.remote.call(self.connection.create_channel()).await?;
            self.remote
                .call(channel.confirm_select(ConfirmSelectOptions::default()))
                .await?;
            self.publisher = Some(channel);
        }
        let publisher = self.publisher.as_ref().expect("opened above");
        republish(&self.remote, publisher, &self.queue, info, message).await
    }

    /// Acknowledges it: the broker deletes it, and no other is touched.
    async fn remove(&mut self, _info: &DeadLetterInfo, message: &Self::Message) -> Result<usize, CliError> {
        let acker = &message.delivery.acker;
        self.remote
            .call(acker.ack(BasicAckOptions::default()))
            .await
            .map(|_| 0)
    }

    /// Gives the broker back every message not acknowledged, in place, with one
    /// `basic.nack` (requeue) — not by closing the channel: RabbitMQ 4.3 counts no nack in a
    /// quorum queue's `x-delivery-count`, while it counts a lost consumer's return (3.10
    /// and 4.0 count both) — then closes the channel.
    async fn finish(self) -> Result<(), CliError> {
        let given_back = match &self.reading {
            Some(channel) => {
                let every_unacked = BasicNackOptions {
                    multiple: true,
                    requeue: true,
                };
                let nacked = self.remote.call(channel.basic_nack(0, every_unacked)).await;
                let closed = self.remote.call(channel.close(200, "done".into())).await;
                nacked.and(closed)
            }
            None => Ok(()),
        };
        let _ = self.connection.close(200, "done".into()).await;
        given_back
    }
}

/// True when `error` is the broker's `NOT_FOUND`.
fn is_not_found(error: &(dyn std::error::Error + 'static)) -> bool {
    error.downcast_ref::<lapin::Error>().is_some_and(|error| {
        matches!(error.kind(), ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)))
    })
}

/// What the dead-letter schema says of `message`, at `position`, in the dead-letter queue
/// of the queues named `dead_lettering_queues` (the work and suspect queues).
///
/// A message RabbitMQ dead-lettered itself from one of those queues (rejected by another
/// consumer, past a delivery limit) is the broker's, whatever else it carries: the runner
/// writes its dead letters without a death from those queues, and drops a producer's
/// dead-letter headers, so a letter with both was forged, or copied by mistake. Deaths in
/// retry queues (a letter written before oncely dropped the broker's marks from its copies
/// carries them from its retries) leave the letter oncely's.
fn describe(position: usize, message: &BasicGetMessage, dead_lettering_queues: [&str; 2]) -> DeadLetterInfo {
    let properties = &message.delivery.properties;
    let message_id = properties.message_id().as_ref().map(|id| id.to_string());
    let info = DeadLetterInfo::new(
        position,
        message_id,
        &headers(message),
        message.delivery.data.len(),
    );
    let broker_dead_lettered = properties
        .headers()
        .as_ref()
        .is_some_and(|table| dead_lettered_from(table, dead_lettering_queues));
    match broker_dead_lettered {
        true => info.not_oncely(),
        false => info,
    }
}

/// Whether RabbitMQ last dead-lettered the message of `table` from one of `queues`: by
/// `x-last-death-queue` (written by RabbitMQ 3.13 and later) or by the first, most recent,
/// entry of `x-death` — either: RabbitMQ before 3.13 leaves a producer's
/// `x-last-death-queue` as it is but puts its own death first in `x-death`, and 3.13 and
/// later overwrite `x-last-death-queue`. A death whose queue cannot be read counts as
/// theirs: such a letter is left to a person, never replayed by rule.
fn dead_lettered_from(table: &FieldTable, queues: [&str; 2]) -> bool {
    let header = |name: &str| {
        table
            .inner()
            .iter()
            .find(|(header, _)| header.as_str() == name)
            .map(|(_, value)| value)
    };
    let text = |value: &AMQPValue| match value {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        AMQPValue::ShortString(text) => Some(text.as_str().to_owned()),
        _ => None,
    };
    let most_recent = |deaths: &AMQPValue| match deaths {
        AMQPValue::FieldArray(deaths) => match deaths.as_slice().first() {
            Some(AMQPValue::FieldTable(death)) => death
                .inner()
                .iter()
                .find(|(name, _)| name.as_str() == "queue")
                .and_then(|(_, queue)| text(queue)),
            _ => None,
        },
        _ => None,
    };
    let (last, deaths) = (header("x-last-death-queue"), header("x-death"));
    if last.is_none() && deaths.is_none() {
        return false;
    }
    let died_at = [last.and_then(text), deaths.and_then(most_recent)];
    died_at.iter().all(Option::is_none)
        || died_at
            .iter()
            .flatten()
            .any(|queue| queues.contains(&queue.as_str()))
}

/// The message's headers as text (`oncely_amqp::headers_of`): strings as they are, numbers
/// and booleans spelled out; nested tables left out.
fn headers(message: &BasicGetMessage) -> BTreeMap<String, String> {
    let headers = message
        .delivery
        .properties
        .headers()
        .as_ref()
        .map(oncely_amqp::headers_of);
    headers
        .unwrap_or_default()
        .iter()
        .map(|(name, value)| (name.to_owned(), String::from_utf8_lossy(value).into_owned()))
        .collect()
}

/// The message's AMQP properties that are set, by name.
fn properties(message: &BasicGetMessage) -> BTreeMap<&'static str, String> {
    let props = &message.delivery.properties;
    let mut properties = BTreeMap::new();
    let mut put = |name: &'static str, value: Option<String>| {
        if let Some(value) = value {
            properties.insert(name, value);
        }
    };
    put("message_id", props.message_id().as_ref().map(|v| v.to_string()));
    put(
        "correlation_id",
        props.correlation_id().as_ref().map(|v| v.to_string()),
    );
    put(
        "content_type",
        props.content_type().as_ref().map(|v| v.to_string()),
    );
    put(
        "content_encoding",
        props.content_encoding().as_ref().map(|v| v.to_string()),
    );
    put("type", props.kind().as_ref().map(|v| v.to_string()));
    put("app_id", props.app_id().as_ref().map(|v| v.to_string()));
    put("timestamp", props.timestamp().map(|v| v.to_string()));
    put("delivery_mode", props.delivery_mode().map(|v| v.to_string()));
    properties
}

/// Publishes a copy of the dead letter `message` to its source queue through the default
/// exchange, persistent and mandatory, and waits for the broker's confirm.
async fn republish(
    remote: &Remote,
    publisher: &Channel,
    queue: &str,
    info: &DeadLetterInfo,
    message: &BasicGetMessage,
) -> Result<(), CliError> {
    let properties = message
        .delivery
        .properties
        .clone()
        .with_headers(replay_headers(message, info))
        .with_delivery_mode(2);
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let publish = publisher.basic_publish(
        "".into(),
        queue.into(),
        mandatory,
        &message.delivery.data,
        properties,
    );
    let confirm = remote.call(publish).await?;
    match remote.call(confirm).await? {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(remote.failed(format!(
            "the copy of dead letter #{} was returned: no queue {queue:?} takes it",
            info.position
        ))),
        Confirmation::Nack(_) => Err(remote.failed(format!(
            "the broker refused the copy of dead letter #{}",
            info.position
        ))),
        Confirmation::NotRequested => Err(remote.failed("the channel is not in confirm mode")),
    }
}

/// The replayed copy's headers: the dead letter's own less the dead-letter schema and the
/// runner's counters, with the reason appended to the history; the original exchange and
/// routing key stay.
fn replay_headers(message: &BasicGetMessage, info: &DeadLetterInfo) -> FieldTable {
    let existing = headers(message).remove(dead_letter::HISTORY);
    let original = message.delivery.properties.headers().clone().unwrap_or_default();
    let mut headers = original.inner().clone();
    // The dead-letter schema goes (the history keeps the reason), and so do the runner's
    // counters: the copy starts afresh.
    for name in dead_letter::SCHEMA.iter().chain(&RUNNER_HEADERS) {
        headers.remove(*name);
    }
    let mut headers = FieldTable::from(headers);
    headers.insert(
        dead_letter::HISTORY.into(),
        AMQPValue::LongString(info.history(existing.as_deref()).into()),
    );
    headers
}
