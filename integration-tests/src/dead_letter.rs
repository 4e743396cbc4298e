//! The check every adapter's dead letters pass: the one metadata schema of
//! [`oncely::dead_letter`], read the same way from AMQP headers and RocketMQ properties.

use oncely::dead_letter::{ATTEMPTS, DETAIL, MAX_VALUE_CHARS, MESSAGE_ID, REASON, ROUTE, SOURCE};

/// What a dead letter's metadata must say.
#[derive(Clone, Copy, Debug)]
pub struct Expected<'a> {
    /// The reason code.
    pub reason: &'a str,
    /// The attempt it was dead-lettered at.
    pub attempts: u32,
    /// The route's name.
    pub route: &'a str,
    /// The queue or topic it was consumed from.
    pub source: &'a str,
    /// The original message id when the test knows it; `None` still requires one, of any
    /// value (every message the tests send has an id, stamped by the producer).
    pub message_id: Option<&'a str>,
}

/// Asserts that the metadata `read` finds by name (a dead letter's headers or properties, as
/// text) follows the schema and says what `expected` says: every name present, the detail
/// non-empty, clean and within [`MAX_VALUE_CHARS`].
pub fn assert_metadata(read: impl Fn(&str) -> Option<String>, expected: &Expected<'_>) {
    let value = |name: &str| read(name).unwrap_or_else(|| panic!("the dead letter has no {name}"));
    assert_eq!(value(REASON), expected.reason, "{REASON}");
    assert_eq!(value(ATTEMPTS), expected.attempts.to_string(), "{ATTEMPTS}");
    assert_eq!(value(ROUTE), expected.route, "{ROUTE}");
    assert_eq!(value(SOURCE), expected.source, "{SOURCE}");
    let detail = value(DETAIL);
    assert!(
        !detail.is_empty() && detail.chars().count() <= MAX_VALUE_CHARS && !detail.contains(char::is_control),
        "{DETAIL}: {detail:?}"
    );
    let message_id = value(MESSAGE_ID);
    assert!(!message_id.is_empty(), "{MESSAGE_ID} is empty");
    if let Some(expected_id) = expected.message_id {
        assert_eq!(message_id, expected_id, "{MESSAGE_ID}");
    }
}
