//! The dead-letter destination: a topic of the user's, with the reason in properties.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use oncely::DeadLetter;
use rocketmq_client_rust::DefaultMQProducer;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::{MessageConst, STRING_HASH_SET};
use rocketmq_model::result::SendStatus;

use crate::error::Error;

/// Dead-letter property: the reason code, e.g. `payload_mismatch` ([`oncely::DeadLetterReason::code`]).
pub const REASON_PROPERTY: &str = "ONCELY_REASON";
/// Dead-letter property: the reason's human-readable detail.
pub const DETAIL_PROPERTY: &str = "ONCELY_DETAIL";
/// Dead-letter property: the attempt the message was dead-lettered at (reconsume times + 1).
pub const ATTEMPTS_PROPERTY: &str = "ONCELY_ATTEMPTS";
/// Dead-letter property: the name of the route that dead-lettered it.
pub const ROUTE_PROPERTY: &str = "ONCELY_ROUTE";
/// Dead-letter property: the topic the message was consumed from.
pub const ORIGINAL_TOPIC_PROPERTY: &str = "ONCELY_ORIGINAL_TOPIC";
/// Dead-letter property: the original message's unique id (its `UNIQ_KEY`), when it had one.
pub const ORIGINAL_MESSAGE_ID_PROPERTY: &str = "ONCELY_ORIGINAL_MSG_ID";

/// Longest reason detail written into [`DETAIL_PROPERTY`], in characters; longer details are
/// cut, since every property travels with the message and counts against its size limit.
pub const MAX_DETAIL_CHARS: usize = 512;

/// Where dead letters go: a topic of yours, written by a started [`DefaultMQProducer`].
///
/// The copy keeps the body, `KEYS`, `TAGS` and user properties, and adds the reason
/// properties ([`REASON_PROPERTY`] and the others in this module). A listener acknowledges
/// the original only after the broker stored the copy (`SEND_OK`); if the send fails, the
/// original is retried instead, so a dead letter is never lost — but may, after such a
/// retry, be written twice. Consumers of the dead-letter topic should expect that.
///
/// This is not RocketMQ's own `%DLQ%<group>` topic: that one takes messages whose
/// retries ran out (maxReconsumeTimes) and carries no reason. The topic is created on first
/// send when the broker auto-creates topics; otherwise create it beforehand.
#[derive(Clone)]
pub struct DeadLetterTopic {
    producer: Arc<DefaultMQProducer>,
    topic: String,
    send_timeout: Duration,
}

impl DeadLetterTopic {
    /// Dead letters go to `topic` through `producer`, which must be started. The send
    /// timeout defaults to 3 s.
    pub fn new(producer: Arc<DefaultMQProducer>, topic: impl Into<String>) -> Self {
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

    /// Writes a copy of `message` with the reason to the topic and waits for the broker to
    /// store it.
    pub(crate) async fn publish(
        &self,
        message: &MessageExt,
        original_topic: &str,
        route: &str,
        attempt: u32,
        reason: &DeadLetter,
    ) -> Result<(), Error> {
        let kept = [MessageConst::PROPERTY_KEYS, MessageConst::PROPERTY_TAGS];
        let mut properties: HashMap<_, _> = message
            .properties()
            .iter()
            .filter(|(name, _)| kept.contains(&name.as_str()) || !STRING_HASH_SET.contains(name.as_str()))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        let mut add = |name: &'static str, value: String| {
            properties.insert(name.into(), value.into());
        };
        add(REASON_PROPERTY, reason.reason.code().to_owned());
        add(DETAIL_PROPERTY, property_safe(&reason.detail));
        add(ATTEMPTS_PROPERTY, attempt.to_string());
        add(ROUTE_PROPERTY, property_safe(route));
        add(ORIGINAL_TOPIC_PROPERTY, original_topic.to_owned());
        if let Some(id) = message
            .properties()
            .get(MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)
        {
            add(ORIGINAL_MESSAGE_ID_PROPERTY, id.to_string());
        }
        let mut copy = Message::builder()
            .topic(self.topic.as_str())
            .body(message.body().unwrap_or_default())
            .build_unchecked();
        copy.set_properties(properties);

        let timeout = u64::try_from(self.send_timeout.as_millis()).unwrap_or(u64::MAX);
        match self.producer.send_with_timeout(copy, timeout).await? {
            Some(result) if result.send_status == SendStatus::SendOk => Ok(()),
            Some(result) => Err(Error::NotStored(result.send_status)),
            None => Err(Error::NoSendResult),
        }
    }
}

impl std::fmt::Debug for DeadLetterTopic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterTopic")
            .field("topic", &self.topic)
            .field("send_timeout", &self.send_timeout)
            .finish_non_exhaustive()
    }
}

/// RocketMQ encodes properties as text separated by the control characters 1 and 2, so a
/// value containing them would corrupt the message's properties; details come from errors
/// and payloads, so control characters are replaced and the length is capped.
fn property_safe(text: &str) -> String {
    text.chars()
        .take(MAX_DETAIL_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn property_values_lose_control_characters_and_are_capped() {
        assert_eq!(property_safe("bad\u{1}key\u{2}\nvalue"), "bad key  value");
        assert_eq!(
            property_safe(&"x".repeat(2 * MAX_DETAIL_CHARS)).chars().count(),
            MAX_DETAIL_CHARS
        );
    }
}
