//! RocketMQ messages → oncely deliveries.

use oncely::{Delivery, Headers, Position, Source};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::{MessageConst, STRING_HASH_SET};

/// Converts one RocketMQ message into an oncely [`Delivery`]:
///
/// | oncely | RocketMQ |
/// |---|---|
/// | broker key | the first of the message's `KEYS` (RocketMQ separates several keys by spaces) |
/// | message id | the producer's unique id, the `UNIQ_KEY` property — not [`MessageExt::msg_id`], which is the broker's storage offset id and differs between a message and its re-sent copy |
/// | headers | the user properties (system properties such as `KEYS` or `TAGS` are left out, and so is oncely's dead-letter metadata, [`oncely::dead_letter::SCHEMA`]: on a message coming in it is a producer's) |
/// | attempt | reconsume times + 1 |
/// | redelivered | reconsume times > 0 |
/// | source | the topic; for a message coming back from the group's retry topic, the original topic (`RETRY_TOPIC`) |
/// | tags, position | `TAGS`, queue id and queue offset |
///
/// Property values are UTF-8 strings in RocketMQ; a key read from them is still checked
/// against the route's key rules (length, emptiness) when it is extracted.
pub fn to_delivery(message: &MessageExt) -> Delivery {
    let properties = message.properties();
    let property = |name: &str| properties.get(name).map(|value| value.as_str());
    let topic = property(MessageConst::PROPERTY_RETRY_TOPIC).unwrap_or(message.topic().as_str());
    let reconsume_times = u32::try_from(message.reconsume_times()).unwrap_or(0);

    let mut headers = Headers::new();
    // oncely's dead-letter metadata on a message coming in is a producer's, not oncely's.
    for (name, value) in properties {
        if !STRING_HASH_SET.contains(name.as_str()) && !oncely::dead_letter::is_schema(name.as_str()) {
            headers.insert(name.as_str(), value.as_str().as_bytes().to_vec());
        }
    }

    let mut delivery = Delivery::new(Source::new(topic), message.body().unwrap_or_default())
        .with_headers(headers)
        .with_attempt(reconsume_times.saturating_add(1))
        .with_redelivered(reconsume_times > 0);
    if let Some(key) = property(MessageConst::PROPERTY_KEYS).and_then(|keys| {
        keys.split(MessageConst::KEY_SEPARATOR)
            .find(|key| !key.is_empty())
    }) {
        delivery = delivery.with_broker_key(key.as_bytes().to_vec());
    }
    if let Some(id) = unique_id(message) {
        delivery = delivery.with_message_id(id);
    }
    if let Some(tags) = property(MessageConst::PROPERTY_TAGS) {
        delivery = delivery.with_tags(tags);
    }
    if let (Ok(queue), Ok(offset)) = (
        u32::try_from(message.queue_id()),
        u64::try_from(message.queue_offset()),
    ) {
        delivery = delivery.with_position(Position { queue, offset });
    }
    delivery
}

/// The producer's unique id of `message` (`UNIQ_KEY`), which its retries keep.
pub(crate) fn unique_id(message: &MessageExt) -> Option<&str> {
    let id = message
        .properties()
        .get(MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)?;
    Some(id.as_str())
}

#[cfg(test)]
mod tests {
    use rocketmq_model::common::message::MessageTrait;
    use rocketmq_model::common::message::message_single::Message;

    use super::*;

    fn message_ext(message: Message) -> MessageExt {
        let mut ext = MessageExt::default();
        ext.set_message_inner(message);
        ext
    }

    #[test]
    fn reads_keys_unique_id_user_properties_and_attempt() {
        let message = Message::builder()
            .topic("orders")
            .tags("paid")
            .keys(vec!["order_1".into(), "user_9".into()])
            .body_slice(br#"{"orderId":"order_1"}"#)
            .raw_property("tenant", "acme")
            .unwrap()
            .build_unchecked();
        let mut ext = message_ext(message);
        ext.put_property(
            MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX.into(),
            "7F0000010001".into(),
        );
        ext.set_reconsume_times(2);
        ext.set_queue_id(3);
        ext.set_queue_offset(41);

        let delivery = to_delivery(&ext);
        assert_eq!(
            delivery.broker_key().map(|key| key.as_ref()),
            Some(&b"order_1"[..])
        );
        assert_eq!(delivery.message_id(), Some("7F0000010001"));
        assert_eq!(
            delivery.headers().get("tenant").map(|v| v.as_ref()),
            Some(&b"acme"[..])
        );
        assert!(delivery.headers().get(MessageConst::PROPERTY_KEYS).is_none());
        assert_eq!(delivery.attempt(), 3);
        assert!(delivery.redelivered());
        assert_eq!(delivery.tags(), Some("paid"));
        assert_eq!(delivery.position(), Some(Position { queue: 3, offset: 41 }));
        assert_eq!(delivery.source().name, "orders");
        assert_eq!(&delivery.body()[..], br#"{"orderId":"order_1"}"#);
    }

    #[test]
    fn a_retried_message_keeps_its_original_topic_and_a_keyless_one_has_no_broker_key() {
        let mut ext = message_ext(
            Message::builder()
                .topic("%RETRY%points")
                .body_slice(b"{}")
                .build_unchecked(),
        );
        ext.put_property(MessageConst::PROPERTY_RETRY_TOPIC.into(), "payments".into());
        let delivery = to_delivery(&ext);
        assert_eq!(delivery.source().name, "payments");
        assert!(delivery.broker_key().is_none());
        assert!(delivery.message_id().is_none());
        assert_eq!(delivery.attempt(), 1);
        assert!(!delivery.redelivered());
    }
}

/// Properties over inputs no one wrote by hand: `PROPTEST_CASES` sets how many (256 unless
/// set; `make fuzz` runs many more).
#[cfg(test)]
mod properties {
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use rocketmq_model::common::message::MessageTrait;
    use rocketmq_model::common::message::message_single::Message;

    use super::*;

    /// Property names, RocketMQ's system ones and oncely's dead-letter metadata among them.
    fn name() -> impl Strategy<Value = String> {
        let known: Vec<String> = oncely::dead_letter::SCHEMA
            .iter()
            .map(|name| name.to_string())
            .chain(STRING_HASH_SET.iter().map(|name| name.to_string()))
            .collect();
        prop_oneof!["[a-zA-Z0-9_.-]{1,16}", proptest::sample::select(known)]
    }

    proptest! {
        /// Any properties convert, never panicking: user properties kept as they are,
        /// system ones and oncely's dead-letter metadata left out of the headers.
        #[test]
        fn prop_any_properties_convert(
            properties in btree_map(name(), "[^\\x01\\x02]{0,24}", 0..10),
            body in vec(any::<u8>(), 0..64),
            reconsumed in 0..40i32,
        ) {
            let mut ext = MessageExt::default();
            ext.set_message_inner(Message::builder().topic("orders").body_slice(&body).build_unchecked());
            for (name, value) in &properties {
                ext.put_property(name.as_str().into(), value.as_str().into());
            }
            ext.set_reconsume_times(reconsumed);
            let delivery = to_delivery(&ext);
            for (name, value) in &properties {
                let kept = delivery.headers().get(name).map(|kept| kept.as_ref());
                match STRING_HASH_SET.contains(name.as_str()) || oncely::dead_letter::is_schema(name) {
                    true => prop_assert!(kept.is_none(), "{} kept", name),
                    false => prop_assert_eq!(kept, Some(value.as_bytes())),
                }
            }
            prop_assert_eq!(delivery.attempt(), reconsumed as u32 + 1);
        }
    }
}
