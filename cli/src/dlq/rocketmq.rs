//! RocketMQ's dead letters: the topic the listeners' `oncely_rocketmq::DeadLetterTopic`
//! writes to.
//!
//! A topic's messages cannot be deleted one by one: they stay until the broker's retention
//! removes their commit log (72 hours by default). The tool reads the topic as a consumer
//! group of its own, `oncely-dlq-<topic>` ([`operator_group`]), whose offsets mark what was
//! handled: a dead letter replayed or purged lies before its queue's offset, one not handled
//! at or after it. Reading moves no offset, so `list` and `show` change nothing.
//!
//! Removing a dead letter moves its queue's offset past it, and the broker confirms the new
//! offset before the next one is handled. An offset passes a dead letter only together with
//! every one before it in the queue, so a dead letter left in place (not matching the
//! filter, or not oncely's) that lies before one removed is first written again at the end
//! of the topic — a copy with the same body and properties, stored (`SEND_OK`) before the
//! offset passes the original. Nothing is lost if the command dies halfway: at worst the
//! dead letter being replayed is still before the offset and a later replay sends it again
//! (the record takes that copy as a duplicate), or one left in place is there twice.
//! Consumers of the dead-letter topic in other groups see such copies too.
//!
//! The consumer keeps no offset in memory: its client writes those, unconfirmed, every few
//! seconds and at shutdown, which could move an offset back. One operator at a time per
//! topic: before moving an offset the tool checks that it is still where it was read, and
//! stops if another one moved it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use oncely::dead_letter;
use oncely_rocketmq::rocketmq_client_rust::{
    ClientConfig, ClientOptions, DefaultLitePullConsumer, DefaultMQProducer, OffsetStore,
};
use oncely_rocketmq::rocketmq_model::common::message::MessageConst;
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use oncely_rocketmq::rocketmq_model::common::message::message_queue::MessageQueue;
use oncely_rocketmq::rocketmq_model::common::message::message_single::Message;
use oncely_rocketmq::{OwnedClientRuntime, kept_properties, send_stored, user_properties};

use super::{DeadLetterInfo, DeadLetters, Filter, Whole};
use crate::Globals;
use crate::error::{CliError, Remote};

/// How long one poll waits for messages before the read checks its progress.
const POLL_MS: u64 = 200;

/// The largest copy the tool writes: the broker's own limit decides (4 MiB by default), not
/// the client's default, so that a dead letter a listener's producer was allowed to write
/// can be written again.
const MAX_COPY_BYTES: u32 = 64 << 20;

/// The shortest call timeout (milliseconds) the client's configuration accepts.
const MIN_API_TIMEOUT_MS: u64 = 100;
/// The longest.
const MAX_API_TIMEOUT_MS: u64 = 60_000;

/// The consumer group whose offsets on `topic` mark the dead letters the tool handled.
pub(crate) fn operator_group(topic: &str) -> String {
    format!("oncely-dlq-{topic}")
}

/// One queue of the topic, as far as this command reads it.
struct QueueState {
    queue: MessageQueue,
    /// The operator group's offset: every dead letter before it was handled.
    passed: i64,
    /// The queue's end when reading began: later dead letters are not read.
    end: i64,
    /// The dead letters read and not passed yet, by offset, ascending (cheap clones: the
    /// body is shared).
    unpassed: Vec<MessageExt>,
}

/// A dead-letter topic, read as the operator group with a lite pull consumer.
pub(super) struct DeadLetterTopic {
    runtime: Option<OwnedClientRuntime>,
    consumer: DefaultLitePullConsumer,
    offsets: Arc<OffsetStore>,
    /// Started on first need: replays and dead letters written again.
    producer: Option<DefaultMQProducer>,
    namesrv: String,
    remote: Remote,
    topic: String,
    name: String,
    queues: Vec<QueueState>,
}

impl DeadLetterTopic {
    /// Starts a client runtime and the operator group's consumer, and checks that `topic`
    /// has a route (it exists), writing nothing.
    pub(super) async fn open(globals: &Globals, topic: &str) -> Result<Self, CliError> {
        let remote = Remote::new("RocketMQ", &globals.rocketmq_namesrv, globals.timeout);
        // The client answers "no route" alike for a missing topic and for a name server it
        // cannot reach: which one it is must be told apart first.
        reachable(&remote, &globals.rocketmq_namesrv).await?;
        let runtime = OwnedClientRuntime::new("oncely-dlq").map_err(|error| remote.failed(error))?;
        // The client's own calls wait past the tool's timeout: its route lookup answers "no
        // route" when its timer fires first, which would read as a missing topic.
        let mut client = ClientConfig::default();
        let backstop = u64::try_from(remote.backstop().as_millis()).unwrap_or(u64::MAX);
        client.set_mq_client_api_timeout(backstop.clamp(MIN_API_TIMEOUT_MS, MAX_API_TIMEOUT_MS));
        let consumer = DefaultLitePullConsumer::builder(runtime.client_runtime())
            .client_options(ClientOptions::legacy(client))
            .consumer_group(operator_group(topic))
            .name_server_addr(globals.rocketmq_namesrv.clone())
            // Offsets move only when the broker confirmed each dead letter handled.
            .auto_commit(false)
            .build()
            .map_err(|error| remote.failed(error))?;
        remote.call(consumer.start()).await?;
        let offsets = consumer
            .offset_store()
            .await
            .ok_or_else(|| remote.failed("the consumer has no offset store"))?;
        let mut queues = match remote.call(consumer.fetch_message_queues(topic)).await {
            Ok(queues) if !queues.is_empty() => queues,
            Ok(_) | Err(CliError::Service { .. }) => {
                return Err(CliError::TopicNotFound {
                    topic: topic.to_owned(),
                    namesrv: remote.url.clone(),
                });
            }
            Err(error) => return Err(error),
        };
        queues.sort();
        Ok(DeadLetterTopic {
            runtime: Some(runtime),
            consumer,
            offsets,
            producer: None,
            namesrv: globals.rocketmq_namesrv.clone(),
            remote,
            topic: topic.to_owned(),
            name: format!("topic {topic}"),
            queues: queues
                .into_iter()
                .map(|queue| QueueState {
                    queue,
                    passed: 0,
                    end: 0,
                    unpassed: Vec::new(),
                })
                .collect(),
        })
    }

    /// Assigns every queue to the consumer and seeks each to the operator group's offset
    /// (or the queue's first offset, if the broker already removed older messages), noting
    /// where each ends now.
    async fn seek_to_unhandled(&mut self) -> Result<(), CliError> {
        let all = self.queues.iter().map(|state| state.queue.clone()).collect();
        self.remote.call(self.consumer.assign(all)).await?;
        for state in &mut self.queues {
            let queue = &state.queue;
            let first = self.remote.call(self.consumer.min_offset(queue)).await?;
            state.end = self.remote.call(self.consumer.max_offset(queue)).await?;
            // -1 for a group that never handled anything in this queue. Capped at the end:
            // a topic deleted and created again starts its offsets afresh.
            let committed = committed(&self.remote, &self.consumer, &self.offsets, queue).await?;
            state.passed = committed.max(first).min(state.end);
            self.remote.call(self.consumer.seek(queue, state.passed)).await?;
        }
        Ok(())
    }

    /// Polls until every queue was read to its end, or fails when no message came for
    /// `--timeout` while some were still expected.
    async fn poll_to_end(&mut self) -> Result<Vec<MessageExt>, CliError> {
        let mut next: Vec<i64> = self.queues.iter().map(|state| state.passed).collect();
        let mut messages = Vec::new();
        let mut progress = Instant::now();
        let behind = |next: &[i64], queues: &[QueueState]| {
            next.iter().zip(queues).any(|(next, state)| *next < state.end)
        };
        while behind(&next, &self.queues) {
            let polled = self.consumer.poll_with_timeout(POLL_MS).await;
            for message in polled {
                let Some(index) = self.index_of(&message) else {
                    continue;
                };
                let (offset, state) = (message.queue_offset(), &self.queues[index]);
                // The pull may run ahead past the end, and poll again what a seek replaced.
                if offset < next[index] || offset >= state.end {
                    continue;
                }
                next[index] = offset + 1;
                progress = Instant::now();
                messages.push(message);
            }
            if progress.elapsed() > self.remote.timeout {
                // The broker may have removed what was still expected (its retention ran
                // meanwhile): what is gone is not waited for.
                let mut skipped = false;
                for (next, state) in next.iter_mut().zip(&self.queues) {
                    let first = self.remote.call(self.consumer.min_offset(&state.queue)).await?;
                    skipped |= first > *next && *next < state.end;
                    *next = (*next).max(first);
                }
                if !skipped {
                    return Err(self.remote.failed(format!(
                        "read stopped before the end of {}: no message for {}",
                        self.name,
                        crate::output::duration(self.remote.timeout)
                    )));
                }
                progress = Instant::now();
            }
        }
        Ok(messages)
    }

    /// Which of the topic's queues `message` is in.
    fn index_of(&self, message: &MessageExt) -> Option<usize> {
        self.queues.iter().position(|state| {
            state.queue.queue_id() == message.queue_id()
                && state.queue.broker_name().as_str() == message.broker_name()
        })
    }

    /// The started producer, starting it on first need.
    async fn producer(&mut self) -> Result<&DefaultMQProducer, CliError> {
        if self.producer.is_none() {
            let runtime = self.runtime.as_ref().expect("running until finish");
            let mut producer = DefaultMQProducer::builder(runtime.client_runtime())
                .producer_group(format!("{}-producer", operator_group(&self.topic)))
                .name_server_addr(self.namesrv.clone())
                .max_message_size(MAX_COPY_BYTES)
                .build();
            self.remote.call(producer.start()).await?;
            self.producer = Some(producer);
        }
        Ok(self.producer.as_ref().expect("started above"))
    }

    /// Sends `message` and waits until the broker stored it.
    async fn send(&mut self, message: Message) -> Result<(), CliError> {
        let timeout = self.remote.timeout;
        let remote = self.remote.clone();
        let producer = self.producer().await?;
        remote.call(send_stored(producer, message, timeout)).await
    }

    /// Moves queue `index`'s offset to `offset`, once the broker confirmed that it is still
    /// where this command last left it; the broker confirms the new one.
    async fn pass(&mut self, index: usize, offset: i64) -> Result<(), CliError> {
        let state = &self.queues[index];
        let now = committed(&self.remote, &self.consumer, &self.offsets, &state.queue).await?;
        if now.max(0) > state.passed {
            return Err(CliError::Refused(format!(
                "another operator moved the offset of {} in group {} (to {now}, from {}): stopped; \
                 run the command again",
                state.queue,
                operator_group(&self.topic),
                state.passed
            )));
        }
        self.remote
            .call(
                self.offsets
                    .update_consume_offset_to_broker(&state.queue, offset, false),
            )
            .await?;
        self.queues[index].passed = offset;
        Ok(())
    }

    /// Writes a copy of `message`, as it is (its dead-letter metadata included), at the end
    /// of the topic.
    async fn write_again(&mut self, message: &MessageExt) -> Result<(), CliError> {
        let mut copy = Message::builder()
            .topic(self.topic.as_str())
            .body(message.body().unwrap_or_default())
            .build_unchecked();
        copy.set_properties(user_properties(message));
        self.send(copy).await
    }

    /// Stops the consumer, the producer and the runtime, each bounded by `--timeout`.
    async fn shut_down(&mut self) {
        let timeout = self.remote.timeout;
        let _ = tokio::time::timeout(timeout, self.consumer.shutdown()).await;
        if let Some(mut producer) = self.producer.take() {
            let _ = tokio::time::timeout(timeout, producer.shutdown()).await;
        }
        if let Some(runtime) = self.runtime.take() {
            let _ = tokio::time::timeout(timeout, runtime.shutdown()).await;
        }
    }
}

impl DeadLetters for DeadLetterTopic {
    type Message = MessageExt;

    fn name(&self) -> &str {
        &self.name
    }

    /// Reads every queue from the operator group's offset to its end when reading began, in
    /// queue order; `--limit` cuts the list after that many matches (all are read first).
    async fn read(
        &mut self,
        filter: Option<&Filter>,
    ) -> Result<Vec<(DeadLetterInfo, Self::Message)>, CliError> {
        self.seek_to_unhandled().await?;
        let mut messages = self.poll_to_end().await?;
        messages.sort_by_key(|message| (self.index_of(message), message.queue_offset()));
        let now = SystemTime::now();
        let (mut letters, mut matched) = (Vec::with_capacity(messages.len()), 0);
        for message in messages {
            if filter.is_some_and(|f| f.limit.is_some_and(|limit| matched >= limit)) {
                break;
            }
            let info = describe(letters.len() + 1, &message);
            matched += usize::from(filter.is_none_or(|f| info.matches(f, now)));
            let index = self.index_of(&message).expect("only the topic's queues are read");
            self.queues[index].unpassed.push(message.clone());
            letters.push((info, message));
        }
        Ok(letters)
    }

    fn whole<'m>(&self, message: &'m Self::Message) -> Whole<'m> {
        let mut properties = BTreeMap::new();
        properties.insert("topic", message.topic().to_string());
        properties.insert(
            "queue",
            format!("{}:{}", message.broker_name(), message.queue_id()),
        );
        properties.insert("queue_offset", message.queue_offset().to_string());
        properties.insert("offset_msg_id", message.msg_id().to_string());
        properties.insert("born_timestamp", message.born_timestamp().to_string());
        properties.insert("store_timestamp", message.store_timestamp().to_string());
        if let Some(id) = message
            .properties()
            .get(MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)
        {
            properties.insert("unique_id", id.to_string());
        }
        Whole {
            properties,
            headers: properties_as_text(message),
            body: message.message_inner().body_slice(),
        }
    }

    /// Any of oncely's: a dead-letter topic may take the dead letters of several topics, and
    /// each names the topic it was consumed from.
    fn replayable(&self, info: &DeadLetterInfo) -> bool {
        info.oncely
    }

    /// Nothing to check: each source topic was consumed from when the dead letter was
    /// written. A topic deleted since fails the send, and its dead letter stays.
    async fn check_replay(&self) -> Result<(), CliError> {
        Ok(())
    }

    /// Sends a copy to the source topic, keeping `KEYS`, `TAGS`, the user properties and the
    /// original's message id (its `UNIQ_KEY`), so that a route keyed by message id sees the
    /// same message.
    async fn replay(&mut self, info: &DeadLetterInfo, message: &Self::Message) -> Result<(), CliError> {
        let source = info.source.as_deref().expect("only oncely's dead letters");
        let mut properties = kept_properties(message);
        let existing = properties
            .get(dead_letter::HISTORY)
            .map(|history| history.to_string());
        properties.insert(
            dead_letter::HISTORY.into(),
            info.history(existing.as_deref()).into(),
        );
        if let Some(id) = &info.message_id {
            properties.insert(
                MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX.into(),
                id.as_str().into(),
            );
        }
        let mut copy = Message::builder()
            .topic(source)
            .body(message.body().unwrap_or_default())
            .build_unchecked();
        copy.set_properties(properties);
        self.send(copy).await
    }

    /// Writes again every dead letter of its queue read and left before it, then moves the
    /// queue's offset past it.
    async fn remove(&mut self, _info: &DeadLetterInfo, message: &Self::Message) -> Result<usize, CliError> {
        let index = self.index_of(message).expect("read from the topic's queues");
        let offset = message.queue_offset();
        let before: Vec<MessageExt> = self.queues[index]
            .unpassed
            .iter()
            .take_while(|left| left.queue_offset() < offset)
            .cloned()
            .collect();
        for left in &before {
            self.write_again(left).await?;
        }
        self.pass(index, offset + 1).await?;
        self.queues[index]
            .unpassed
            .retain(|left| left.queue_offset() > offset);
        Ok(before.len())
    }

    async fn finish(mut self) -> Result<(), CliError> {
        self.shut_down().await;
        Ok(())
    }
}

/// The operator group's offset in `queue` as the broker has it (-1: none yet), leaving none
/// in the consumer's memory: its client would write that back later, unconfirmed.
async fn committed(
    remote: &Remote,
    consumer: &DefaultLitePullConsumer,
    offsets: &OffsetStore,
    queue: &MessageQueue,
) -> Result<i64, CliError> {
    offsets.remove_offset(queue).await;
    let committed = remote.call(consumer.committed(queue)).await;
    offsets.remove_offset(queue).await;
    committed
}

/// Whether one of the name servers in `namesrv` (`host:port`, `;`-separated) takes a TCP
/// connection within the timeout.
async fn reachable(remote: &Remote, namesrv: &str) -> Result<(), CliError> {
    let mut last = None;
    for address in namesrv.split(';').map(str::trim).filter(|a| !a.is_empty()) {
        match remote.call(tokio::net::TcpStream::connect(address)).await {
            Ok(_) => return Ok(()),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| remote.failed("no name server address given")))
}

/// The user properties of `message`, with `KEYS` and `TAGS`, as text.
fn properties_as_text(message: &MessageExt) -> BTreeMap<String, String> {
    user_properties(message)
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

/// What the dead-letter schema says of `message`, at `position`: the message id is the
/// original's, from the metadata. A message of one of RocketMQ's own retry or dead-letter
/// topics (`%RETRY%…`, `%DLQ%…`) is the broker's, whatever it carries: a producer's
/// dead-letter metadata on it is not oncely's.
fn describe(position: usize, message: &MessageExt) -> DeadLetterInfo {
    let body_bytes = message.message_inner().body_slice().len();
    let info = DeadLetterInfo::new(position, None, &properties_as_text(message), body_bytes);
    let topic = message.topic().as_str();
    match topic.starts_with("%DLQ%") || topic.starts_with("%RETRY%") {
        true => info.not_oncely(),
        false => info,
    }
}
