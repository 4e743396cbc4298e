//! The dead-letter destination: a topic of the user's, with the reason in properties.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use cheetah_string::CheetahString;
use oncely::{DeadLetter, dead_letter};
use rocketmq_client_rust::DefaultMQProducer;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::{MessageConst, STRING_HASH_SET};
use rocketmq_model::result::SendStatus;

use crate::error::Error;

/// Where dead letters go: a topic of yours, written by a started [`DefaultMQProducer`].
///
/// The copy keeps the body, `KEYS`, `TAGS` and user properties, and adds the dead-letter
/// metadata of [`oncely::dead_letter`] as user properties (reason code, detail, attempts,
/// route, source topic, the original `UNIQ_KEY`). A listener acknowledges the original only
/// after the broker stored the copy (`SEND_OK`); if the send fails, the original is retried
/// instead, so a dead letter is never lost — but may, after such a retry, be written twice.
/// Consumers of the dead-letter topic should expect that.
///
/// A body the producer would refuse — over its `max_message_size` (4 MiB by default), or
/// empty — is cut to the producer's limit (an empty one becomes `-`), and the copy says so in
/// [`dead_letter::BODY_CUT`]: a dead letter that can never be written would otherwise be
/// retried forever, and under an orderly listener hold its queue for good.
///
/// This is not RocketMQ's own `%DLQ%<group>` topic: that one takes messages whose
/// retries ran out (maxReconsumeTimes) and carries no reason. The topic is created on first
/// send when the broker auto-creates topics (`autoCreateTopicEnable`, on by default);
/// otherwise create it beforehand, or every dead letter fails to send and its original is
/// retried instead.
///
/// Shut it down ([`shutdown`](Self::shutdown)) after the consumers whose listeners use it,
/// and before the client runtime: a producer left running keeps the runtime's shutdown
/// waiting for its tasks (30 s with `rocketmq-client-rust` 1.0).
#[derive(Clone)]
pub struct DeadLetterTopic {
    producer: DefaultMQProducer,
    topic: String,
    send_timeout: Duration,
}

impl DeadLetterTopic {
    /// Dead letters go to `topic` through `producer`, which must be started (clones of a
    /// producer share its connections: this may be the one your code sends with). The send
    /// timeout defaults to 3 s.
    pub fn new(producer: DefaultMQProducer, topic: impl Into<String>) -> Self {
        DeadLetterTopic {
            producer,
            topic: topic.into(),
            send_timeout: Duration::from_secs(3),
        }
    }

    /// How long one send may take before it counts as failed (and the original is retried).
    pub fn with_send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// The topic dead letters go to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Shuts the producer down (every clone of it: they share one). Call it once the
    /// consumers whose listeners write here are shut down; a dead letter sent after it
    /// fails, and its original is retried.
    pub async fn shutdown(&self) {
        self.producer.clone().shutdown().await;
    }

    /// Writes a copy of `message` with the dead letter's metadata to the topic and waits for
    /// the broker to store it.
    pub(crate) async fn publish(
        &self,
        message: &MessageExt,
        dead: &DeadLetter,
        context: &dead_letter::Context<'_>,
    ) -> Result<(), Error> {
        let mut properties = kept_properties(message);
        // The metadata's values hold no control characters, which RocketMQ uses to separate
        // properties (see `DeadLetter::metadata`).
        for (name, value) in dead.metadata(context) {
            properties.insert(name.into(), value.into());
        }
        let (body, cut) = fit(
            message.body().unwrap_or_default(),
            self.producer.max_message_size() as usize,
        );
        if let Some(cut) = cut {
            properties.insert(dead_letter::BODY_CUT.into(), cut.into());
        }
        let mut copy = Message::builder()
            .topic(self.topic.as_str())
            .body(body)
            .build_unchecked();
        copy.set_properties(properties);
        send_stored(&self.producer, copy, self.send_timeout).await
    }
}

/// The properties a copy of `message` as it is keeps: `KEYS`, `TAGS` and the user
/// properties, oncely's dead-letter metadata among them. RocketMQ's other system properties
/// (the unique id, the retry topic, store and transaction flags) describe the stored message,
/// not a copy of it; a copy gets its own.
pub fn user_properties(message: &MessageExt) -> HashMap<CheetahString, CheetahString> {
    let kept = [MessageConst::PROPERTY_KEYS, MessageConst::PROPERTY_TAGS];
    message
        .properties()
        .iter()
        .filter(|(name, _)| kept.contains(&name.as_str()) || !STRING_HASH_SET.contains(name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

/// The properties a copy of `message` sent on keeps (a replay, a dead letter): its
/// [`user_properties`] but oncely's dead-letter metadata
/// ([`oncely::dead_letter::SCHEMA`]: what such a copy carries of it is oncely's to write).
pub fn kept_properties(message: &MessageExt) -> HashMap<CheetahString, CheetahString> {
    let mut properties = user_properties(message);
    properties.retain(|name, _| !oncely::dead_letter::is_schema(name.as_str()));
    properties
}

/// Sends `message` through `producer` and waits up to `timeout` for the broker to store it:
/// only `SEND_OK` is success, as a copy whose original is removed afterwards must be stored
/// durably first.
pub async fn send_stored(
    producer: &DefaultMQProducer,
    message: Message,
    timeout: Duration,
) -> Result<(), Error> {
    let timeout = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    match producer.send_with_timeout(message, timeout).await? {
        Some(result) if result.send_status == SendStatus::SendOk => Ok(()),
        Some(result) => Err(Error::NotStored(result.send_status)),
        None => Err(Error::NoSendResult),
    }
}

/// The body of a dead letter, cut to what a producer with `limit` takes, and what was done
/// to it if anything.
fn fit(body: Bytes, limit: usize) -> (Bytes, Option<String>) {
    if body.is_empty() {
        let note = "the body was empty, which the producer refuses: the copy carries `-`";
        return (Bytes::from_static(b"-"), Some(note.to_owned()));
    }
    if body.len() <= limit {
        return (body, None);
    }
    let note = format!(
        "kept the first {limit} of {} bytes: the dead-letter producer's limit is {limit} bytes",
        body.len()
    );
    (body.slice(..limit), Some(note))
}

impl std::fmt::Debug for DeadLetterTopic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterTopic")
            .field("topic", &self.topic)
            .field("send_timeout", &self.send_timeout)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_the_producer_would_refuse_is_cut_to_fit_and_says_so() {
        let (kept, cut) = fit(Bytes::from_static(b"0123456789"), 4);
        assert_eq!(
            (&kept[..], cut.unwrap().contains("first 4 of 10 bytes")),
            (&b"0123"[..], true)
        );
        let (kept, cut) = fit(Bytes::new(), 4);
        assert_eq!((&kept[..], cut.is_some()), (&b"-"[..], true));
        assert_eq!(
            fit(Bytes::from_static(b"0123"), 4),
            (Bytes::from_static(b"0123"), None)
        );
    }
}
