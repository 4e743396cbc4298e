//! Why a delivery was dead-lettered, and the metadata written on its dead-letter copy.
//!
//! One schema for every broker: the adapters write the pairs of [`DeadLetter::metadata`] —
//! AMQP as headers, RocketMQ as user properties — under the names below, so a reader of
//! dead letters looks for the same names and values whichever broker they came through.
//! Every value is text; each is written with control characters replaced by a space and
//! cut to [`MAX_VALUE_CHARS`] characters (see [`DeadLetter::metadata`] for why). The
//! README's "Dead letters" table lists the names with examples.

use std::fmt;

/// Metadata name: the reason code, e.g. `payload_mismatch` ([`DeadLetterReason::code`]).
pub const REASON: &str = "x-oncely-reason";
/// Metadata name: the reason's human-readable detail ([`DeadLetter::detail`]), cleaned and
/// capped at [`MAX_VALUE_CHARS`].
pub const DETAIL: &str = "x-oncely-detail";
/// Metadata name: the attempt the delivery was dead-lettered at, in decimal (1 for a first
/// delivery).
pub const ATTEMPTS: &str = "x-oncely-attempts";
/// Metadata name: the name of the route that dead-lettered the delivery.
pub const ROUTE: &str = "x-oncely-route";
/// Metadata name: where the delivery was consumed from — the AMQP work queue, or the
/// RocketMQ topic (the original one for a message from a retry topic).
pub const SOURCE: &str = "x-oncely-source";
/// Metadata name: the original message's id (AMQP `message_id`, RocketMQ `UNIQ_KEY`); absent
/// when the message had none.
pub const MESSAGE_ID: &str = "x-oncely-message-id";
/// Metadata name: when the delivery was dead-lettered, in milliseconds since the Unix epoch
/// (decimal), on the consumer's clock. AMQP messages carry no time of their own that a
/// reader could filter dead letters by.
pub const DEAD_LETTERED_AT: &str = "x-oncely-dead-lettered-at";
/// Metadata name, only on a message replayed from a dead-letter destination (`oncely dlq
/// replay`): the dead letters it was replayed from, oldest first, one per replay separated
/// by `; `, each `<dead-lettered-at ms> <reason>: <detail>` (each detail cut to 160
/// characters, with `; ` in it written `, `; the oldest entries dropped to stay within
/// [`MAX_VALUE_CHARS`]). It keeps why the message failed before while its attempt counter
/// starts afresh.
pub const HISTORY: &str = "x-oncely-history";

/// Metadata name, only on a dead letter whose body is not the original's: what was done to
/// it and why, e.g. `kept the first 4194304 of 6291456 bytes: the dead-letter producer's
/// limit is 4194304 bytes`. A broker's producer refuses a body over its limit (RocketMQ's
/// client also an empty one); a dead letter that could not be written would be retried
/// forever, so its body is cut to fit instead. Written by the RocketMQ adapter.
pub const BODY_CUT: &str = "x-oncely-body-cut";

/// Every metadata name a dead letter carries (all but [`HISTORY`]): what oncely writes, and
/// what nobody else may. The adapters drop a producer's own values of these on the way in —
/// a handler never sees them, and no copy of the message (a retry, a dead letter) keeps them
/// — so that a message is counted as oncely's dead letter only when oncely wrote it so.
pub const SCHEMA: [&str; 8] = [
    REASON,
    DETAIL,
    ATTEMPTS,
    ROUTE,
    SOURCE,
    DEAD_LETTERED_AT,
    MESSAGE_ID,
    BODY_CUT,
];

/// True when `name` is one of oncely's dead-letter metadata names ([`SCHEMA`]).
pub fn is_schema(name: &str) -> bool {
    SCHEMA.contains(&name)
}

/// The longest value written, in characters (not bytes); longer values, in practice only a
/// detail, are cut. The metadata travels with every dead letter and counts against the
/// broker's message size limits, and a detail can quote an error or a payload of any length.
pub const MAX_VALUE_CHARS: usize = 512;

/// Why a delivery was dead-lettered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The reason, as a code.
    pub reason: DeadLetterReason,
    /// Human-readable detail, written beside the code in the dead-letter metadata
    /// ([`DETAIL`]).
    pub detail: String,
}

/// The machine-readable reason of a [`DeadLetter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// No usable business key (or entity id, or state) could be read from the delivery.
    InvalidKey,
    /// The delivery names a state the route's state machine does not declare.
    UnknownState,
    /// The business key was seen before with another payload: a key reused by mistake,
    /// never silently dropped.
    PayloadMismatch,
    /// The delivery was retried the route's maximum number of times.
    AttemptsExhausted,
    /// The handler rejected the delivery as permanently unprocessable.
    Rejected,
    /// The body does not deserialise into the type the handler takes
    /// ([`Json`](crate::Json)): not JSON, a field missing, a value out of range.
    BadBody,
    /// The body is larger than the route's maximum
    /// ([`Route::with_max_body_len`](crate::Route::with_max_body_len)); it was not parsed.
    Oversize,
    /// The message came back unsettled the maximum number of times: each time its consumer
    /// died or lost its connection while holding it (a message that crashes its process,
    /// say), or the broker kept refusing its retry copy. Counted outside the stack — by the
    /// broker (RabbitMQ's quorum queues) or by a
    /// [delivery counter](crate::Route::with_delivery_limit) — so a crash counts too.
    DeliveryLimit,
}

impl DeadLetterReason {
    /// Every reason, in the order of their declaration.
    pub const ALL: [DeadLetterReason; 8] = [
        DeadLetterReason::InvalidKey,
        DeadLetterReason::UnknownState,
        DeadLetterReason::PayloadMismatch,
        DeadLetterReason::AttemptsExhausted,
        DeadLetterReason::Rejected,
        DeadLetterReason::BadBody,
        DeadLetterReason::Oversize,
        DeadLetterReason::DeliveryLimit,
    ];

    /// The reason whose [`code`](Self::code) is `code`, if any.
    pub fn from_code(code: &str) -> Option<DeadLetterReason> {
        Self::ALL.into_iter().find(|reason| reason.code() == code)
    }

    /// A short snake-case code, the value of the [`REASON`] metadata.
    pub fn code(self) -> &'static str {
        match self {
            DeadLetterReason::InvalidKey => "invalid_key",
            DeadLetterReason::UnknownState => "unknown_state",
            DeadLetterReason::PayloadMismatch => "payload_mismatch",
            DeadLetterReason::AttemptsExhausted => "attempts_exhausted",
            DeadLetterReason::Rejected => "rejected",
            DeadLetterReason::BadBody => "bad_body",
            DeadLetterReason::Oversize => "oversize",
            DeadLetterReason::DeliveryLimit => "delivery_limit",
        }
    }
}

/// Where and when a delivery was dead-lettered: what the adapter knows beside the
/// [`DeadLetter`] itself, for [`DeadLetter::metadata`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Context<'a> {
    /// The route's name ([`Route::name`](crate::Route::name)), written as [`ROUTE`].
    pub route: &'a str,
    /// The delivery's attempt number ([`Delivery::attempt`](crate::Delivery::attempt)),
    /// written as [`ATTEMPTS`].
    pub attempts: u32,
    /// The queue or topic it was consumed from ([`Source::name`](crate::Source::name)),
    /// written as [`SOURCE`].
    pub source: &'a str,
    /// The original message id, if it had one
    /// ([`Delivery::message_id`](crate::Delivery::message_id)), written as [`MESSAGE_ID`].
    pub message_id: Option<&'a str>,
}

impl DeadLetter {
    /// The metadata to write on the dead-letter copy, as (name, value) pairs: [`REASON`],
    /// [`DETAIL`], [`ATTEMPTS`], [`ROUTE`], [`SOURCE`], [`DEAD_LETTERED_AT`] (now) and, when
    /// `context` has one, [`MESSAGE_ID`], in that order.
    ///
    /// Every value has its control characters replaced by a space and is cut to
    /// [`MAX_VALUE_CHARS`] characters. RocketMQ encodes properties as text separated by the
    /// control characters 1 and 2, so such a character in a value would corrupt the
    /// message's properties; details come from errors and payloads, route names and message
    /// ids from users. The same rule on both brokers keeps the values the same whichever
    /// one a dead letter came through.
    pub fn metadata(&self, context: &Context<'_>) -> Vec<(&'static str, String)> {
        let mut pairs = vec![
            (REASON, self.reason.code().to_owned()),
            (DETAIL, clean(&self.detail)),
            (ATTEMPTS, context.attempts.to_string()),
            (ROUTE, clean(context.route)),
            (SOURCE, clean(context.source)),
            (
                DEAD_LETTERED_AT,
                unix_millis(std::time::SystemTime::now()).to_string(),
            ),
        ];
        if let Some(id) = context.message_id {
            pairs.push((MESSAGE_ID, clean(id)));
        }
        pairs
    }
}

/// Milliseconds since the Unix epoch; 0 for a clock set before it.
fn unix_millis(at: std::time::SystemTime) -> u128 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis())
}

/// A value as the metadata writes it: control characters replaced, at most
/// [`MAX_VALUE_CHARS`] characters.
fn clean(text: &str) -> String {
    text.chars()
        .take(MAX_VALUE_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

impl fmt::Display for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason.code(), self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(message_id: Option<&str>) -> Context<'_> {
        Context {
            route: "deduct_stock",
            attempts: 3,
            source: "orders",
            message_id,
        }
    }

    #[test]
    fn metadata_names_every_field_of_the_schema() {
        let dead = DeadLetter {
            reason: DeadLetterReason::PayloadMismatch,
            detail: "key order_1 was seen with another payload".into(),
        };
        let mut metadata = dead.metadata(&context(Some("0190b1c2-id")));
        let (name, at) = metadata.remove(5);
        let at: u128 = at.parse().unwrap();
        let now = unix_millis(std::time::SystemTime::now());
        assert!(
            name == DEAD_LETTERED_AT && at <= now && now - at < 60_000,
            "{name} {at}"
        );
        assert_eq!(
            metadata,
            [
                ("x-oncely-reason", "payload_mismatch".to_owned()),
                (
                    "x-oncely-detail",
                    "key order_1 was seen with another payload".to_owned()
                ),
                ("x-oncely-attempts", "3".to_owned()),
                ("x-oncely-route", "deduct_stock".to_owned()),
                ("x-oncely-source", "orders".to_owned()),
                ("x-oncely-message-id", "0190b1c2-id".to_owned()),
            ]
        );
        // No message id: the name is left out, not written empty.
        let names: Vec<_> = dead
            .metadata(&context(None))
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(names, [REASON, DETAIL, ATTEMPTS, ROUTE, SOURCE, DEAD_LETTERED_AT]);
    }

    #[test]
    fn every_reason_is_read_back_from_its_code() {
        for reason in DeadLetterReason::ALL {
            assert_eq!(DeadLetterReason::from_code(reason.code()), Some(reason));
        }
        assert_eq!(DeadLetterReason::from_code("panicked"), None);
    }

    #[test]
    fn metadata_values_lose_control_characters_and_are_capped() {
        let dead = DeadLetter {
            reason: DeadLetterReason::Rejected,
            detail: format!("bad\u{1}key\u{2}\nvalue {}", "é".repeat(2 * MAX_VALUE_CHARS)),
        };
        let metadata = dead.metadata(&Context {
            route: "route\u{0}name",
            message_id: Some("id\r\n"),
            ..context(None)
        });
        let value = |name| {
            metadata
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, value)| value.as_str())
                .unwrap()
        };
        let detail = value(DETAIL);
        assert!(detail.starts_with("bad key  value éé"), "{detail}");
        // The cap counts characters, not bytes: a multi-byte character is never split.
        assert_eq!(detail.chars().count(), MAX_VALUE_CHARS);
        assert_eq!(value(ROUTE), "route name");
        assert_eq!(value(MESSAGE_ID), "id  ");
    }
}
