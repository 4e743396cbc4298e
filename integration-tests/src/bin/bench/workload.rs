//! The messages an end-to-end benchmark publishes: fresh orders, or orders with duplicates as
//! producers make them — a retry with the same message id, a re-send with a new one — right
//! behind their original or far from it.

use integration_tests::unique;

/// Messages of a workload with duplicates.
pub(crate) const WITH_DUPLICATES: usize = 20_000;
/// The share of a workload's messages that copy an earlier one, in percent.
pub(crate) const DUPLICATE_PERCENT: usize = 30;
/// A copy "near" its original comes at most this many messages after it: within one
/// prefetch window of 64, so in the original's batch or the next.
pub(crate) const NEAR: usize = 64;

/// One message: its AMQP `message_id` and its body's order (the business key).
#[derive(Clone, Debug)]
pub(crate) struct Message {
    pub(crate) message_id: String,
    pub(crate) order: String,
}

impl Message {
    /// The JSON body: the order and its product, one product per order (a lock on the
    /// product then never makes one order wait for another).
    pub(crate) fn body(&self) -> String {
        format!(r#"{{"orderId":"{0}","sku":"{0}"}}"#, self.order)
    }
}

/// Where a workload's duplicates land.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Copies {
    /// Half within [`NEAR`] messages of their original, half far from it.
    HalfNear,
    /// Every copy far from its original (at least a third of the workload later).
    Far,
}

impl Copies {
    /// As the report names it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Copies::HalfNear => "half of the duplicates within 64 messages of their original",
            Copies::Far => "every duplicate far from its original",
        }
    }
}

/// `count` orders never seen before, each with a message id of its own.
pub(crate) fn fresh(count: usize) -> Vec<Message> {
    let batch = unique("o");
    (0..count)
        .map(|n| Message {
            message_id: format!("{batch}-m{n}"),
            order: format!("{batch}-{n}"),
        })
        .collect()
}

/// [`WITH_DUPLICATES`] messages of which [`DUPLICATE_PERCENT`] % copy an earlier order: half
/// with the original's message id (a producer's retry), half with a new one (a re-send, the
/// same business key). Where the copies land is `copies`. Deterministic: every consumer
/// compared drains the same sequence.
pub(crate) fn with_duplicates(copies: Copies) -> Vec<Message> {
    let copy_count = WITH_DUPLICATES * DUPLICATE_PERCENT / 100;
    let originals = fresh(WITH_DUPLICATES - copy_count);
    // Each message gets a place; sorting by it gives the sequence. Originals sit at whole
    // places, a copy just after the place it belongs at.
    let mut placed: Vec<(usize, usize, Message)> = (originals.iter().enumerate())
        .map(|(place, message)| (place, 0, message.clone()))
        .collect();
    let spread = originals.len();
    for n in 0..copy_count {
        // Originals spread evenly over the sequence.
        let of = n * spread / copy_count;
        let original = &originals[of];
        let message_id = match n % 2 {
            0 => original.message_id.clone(),
            _ => format!("{}-resent", original.message_id),
        };
        let near = copies == Copies::HalfNear && (n / 2) % 2 == 0;
        let place = match near {
            // 1 to NEAR / 2 originals after it, varied: with the copies that land between
            // them, within NEAR messages.
            true => of + 1 + (n * 37) % (NEAR / 2),
            // A third of the workload or more later; past the end, among the last.
            false => of + spread / 3 + (n * 7919) % (spread / 3),
        };
        let copy = Message {
            message_id,
            order: original.order.clone(),
        };
        placed.push((place, 1 + n, copy));
    }
    placed.sort_by_key(|(place, tie, _)| (*place, *tie));
    placed.into_iter().map(|(_, _, message)| message).collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// How far each copy lands from its original, in messages.
    fn distances(messages: &[Message]) -> Vec<usize> {
        let mut first = HashMap::new();
        let mut distances = Vec::new();
        for (at, message) in messages.iter().enumerate() {
            match first.get(&message.order) {
                Some(original) => distances.push(at - original),
                None => {
                    first.insert(message.order.clone(), at);
                }
            }
        }
        distances
    }

    #[test]
    fn thirty_percent_copies_half_of_them_near_in_the_first_workload() {
        let messages = with_duplicates(Copies::HalfNear);
        assert_eq!(messages.len(), WITH_DUPLICATES);
        let distances = distances(&messages);
        assert_eq!(distances.len(), WITH_DUPLICATES * DUPLICATE_PERCENT / 100);
        let near = distances.iter().filter(|d| **d <= NEAR).count();
        assert_eq!(near, distances.len() / 2);
        let same_id = (messages.iter())
            .filter(|message| !message.message_id.ends_with("-resent"))
            .count();
        assert_eq!(WITH_DUPLICATES - same_id, distances.len() / 2);
    }

    #[test]
    fn far_copies_land_thousands_of_messages_later() {
        let distances = distances(&with_duplicates(Copies::Far));
        assert!(
            distances.iter().all(|d| *d > 1_000),
            "{:?}",
            distances.iter().min()
        );
    }
}
