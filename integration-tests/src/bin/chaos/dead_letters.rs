//! The dead letters a run ends with, sorted by reason code and by what they carried: poison
//! messages (which must end as [`DELIVERY_LIMIT`]) and orders.

use std::collections::{BTreeMap, BTreeSet};

/// The dead-letter reason code of a message that came back unsettled too often: what a
/// poison message must end as.
pub(crate) const DELIVERY_LIMIT: &str = "delivery_limit";

/// The reason code of a dead letter, given a lookup of its metadata (AMQP headers,
/// RocketMQ user properties) by name; "no reason" when it has none. Both brokers carry it
/// under the one schema's name (`oncely::dead_letter::REASON`).
pub(crate) fn reason_code(metadata: impl FnOnce(&str) -> Option<String>) -> String {
    metadata(oncely::dead_letter::REASON).unwrap_or_else(|| "no reason".into())
}

/// What was taken from the dead-letter queue or topic over the run.
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
