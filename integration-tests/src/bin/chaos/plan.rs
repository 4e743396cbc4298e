//! What the publisher sends: each key once, copies of recent keys between them (producer
//! retries and re-sent orders), and poison messages.

use crate::options::Options;

/// What one published message is.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Message {
    /// An order, its business key `order_N`: once, or a copy.
    Order(usize),
    /// A poison message, its key `poison_N`: whichever consumer process handles it dies.
    /// Its own SKU, so that the lock its dead handlers leave behind blocks no order.
    Poison(usize),
}

impl Message {
    /// Its business key.
    pub(crate) fn key(self) -> String {
        match self {
            Message::Order(key) => format!("order_{key}"),
            Message::Poison(key) => format!("poison_{key}"),
        }
    }

    /// Its JSON body.
    pub(crate) fn body(self) -> Vec<u8> {
        let key = self.key();
        match self {
            Message::Order(order) => {
                format!(
                    r#"{{"orderId":"{key}","sku":"sku_{}","quantity":1}}"#,
                    order % 500
                )
            }
            Message::Poison(_) => {
                format!(r#"{{"orderId":"{key}","sku":"{key}","quantity":1,"poison":true}}"#)
            }
        }
        .into_bytes()
    }
}

/// What the publisher sends, in order, each with its message id (made as `broker`'s
/// producers make them):
/// - each key once under its own message id, spread evenly over the run, so that new
///   effects keep arriving for as long as the publisher runs (the throughput windows count
///   them);
/// - between them the copies, each of one of the keys sent shortly before it (the last
///   tenth of the keys so far), as retries and re-sends follow their original: alternately
///   under the original's id (a producer retry) and under a new id (a re-sent order);
/// - the poison messages spread over the first four fifths, so that orders keep flowing
///   after each of them.
pub(crate) fn plan(options: &Options) -> Vec<(Message, String)> {
    let new_id = || options.broker.new_message_id();
    let recent = (options.keys / 10).max(1);
    let mut ids: Vec<String> = Vec::with_capacity(options.keys);
    let mut plan = Vec::with_capacity(options.messages + options.poison);
    for slot in 0..options.messages {
        // Exactly `keys` of the `messages` slots, evenly spaced, the first one among them.
        let original = slot * options.keys % options.messages < options.keys;
        let (key, id) = if original {
            ids.push(new_id());
            (ids.len() - 1, ids[ids.len() - 1].clone())
        } else {
            let copy = slot - ids.len();
            let key = ids.len() - 1 - (copy * 7919) % recent.min(ids.len());
            let id = if copy.is_multiple_of(2) {
                ids[key].clone()
            } else {
                new_id()
            };
            (key, id)
        };
        plan.push((Message::Order(key), id));
    }
    // From the last position back, so that each insertion leaves the earlier ones in place.
    for poison in (0..options.poison).rev() {
        let at = plan.len() * 4 * (poison + 1) / (5 * (options.poison + 1));
        plan.insert(at, (Message::Poison(poison), new_id()));
    }
    plan
}
