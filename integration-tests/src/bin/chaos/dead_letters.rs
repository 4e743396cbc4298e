//! The dead letters a run ends with, sorted by reason code and by what they carried: poison
//! messages (which must end as [`DELIVERY_LIMIT`]) and orders.

use std::collections::{BTreeMap, BTreeSet};

use crate::options::BrokerKind;

/// The dead-letter reason code of a message that came back unsettled too often: what a
/// poison message must end as.
pub(crate) const DELIVERY_LIMIT: &str = "delivery_limit";

/// The metadata name the adapters write a dead letter's reason under on `broker`: an AMQP
/// header, a RocketMQ user property. With the dead-letter schema shared by both brokers
/// (`oncely::dead_letter::REASON`, `x-oncely-reason`), the match becomes that one name.
fn reason_name(broker: BrokerKind) -> &'static str {
    match broker {
        BrokerKind::Amqp => oncely_amqp::REASON_HEADER,
        BrokerKind::RocketMq => oncely_rocketmq::REASON_PROPERTY,
    }
}

/// The reason code of a dead letter that came through `broker`, given a lookup of its
/// metadata (headers, user properties) by name; "no reason" when it has none. Read as text,
/// so the run does not depend on the middleware's reason types. The value is the code, or
/// `code: detail` (the AMQP adapter's until the shared schema): the code is what comes
/// before the first colon.
pub(crate) fn reason_code(broker: BrokerKind, metadata: impl FnOnce(&str) -> Option<String>) -> String {
    match metadata(reason_name(broker)) {
        Some(reason) => reason.split(':').next().unwrap_or_default().to_owned(),
        None => "no reason".into(),
    }
}

/// What the dead-letter queue or topic held at the end.
#[derive(Debug, Default)]
pub(crate) struct DeadLetters {
    /// Dead letters per reason code.
    pub(crate) by_code: BTreeMap<String, u64>,
    /// Poison keys dead-lettered with [`DELIVERY_LIMIT`].
    pub(crate) poison_at_limit: BTreeSet<String>,
    /// Orders dead-lettered (a copy given up; its key may still have been applied by
    /// another), with their reason codes.
    pub(crate) orders: BTreeSet<(String, String)>,
}

impl DeadLetters {
    /// Sorts dead letters, each given as its reason code (see [`reason_code`]) and its body.
    pub(crate) fn sort<'a>(letters: impl IntoIterator<Item = (String, &'a [u8])>) -> Self {
        let mut dead = DeadLetters::default();
        for (code, body) in letters {
            match order_key(body) {
                Some((key, true)) if code == DELIVERY_LIMIT => {
                    dead.poison_at_limit.insert(key);
                }
                Some((key, false)) => {
                    dead.orders.insert((key, code.clone()));
                }
                _ => {}
            }
            *dead.by_code.entry(code).or_default() += 1;
        }
        dead
    }
}

/// The key of a dead letter, read from its body, and whether it is a poison message.
fn order_key(body: &[u8]) -> Option<(String, bool)> {
    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    let poison = body.pointer("/poison").and_then(|poison| poison.as_bool()) == Some(true);
    Some((body.pointer("/orderId")?.as_str()?.to_owned(), poison))
}
