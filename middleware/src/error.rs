//! The crate's one error type.

use crate::outcome::Tier;

/// A boxed error from a store client or a user's service.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in oncely itself.
///
/// A duplicate is never an error: it is [`Outcome::Duplicate`](crate::Outcome::Duplicate).
/// Errors fall into three classes, told apart by the helpers:
/// - [`is_poison`](Error::is_poison): the delivery itself is unusable (no key, bad body,
///   unknown state); retrying cannot help, so it is dead-lettered with this error as the reason.
/// - [`is_retryable`](Error::is_retryable): a store could not be reached or answered with an
///   error; the same delivery may succeed later.
/// - [`is_config`](Error::is_config): the route was configured wrongly; reported when the
///   route is built, before any delivery is consumed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The field the business key is read from is absent from the delivery
    /// (no message id, no such header, no broker key).
    #[error("business key missing: {field} is absent")]
    KeyMissing {
        /// Which field was read, e.g. `header "x-order-id"`.
        field: String,
    },
    /// The field the business key is read from is present but empty.
    #[error("business key empty: {field} is empty")]
    KeyEmpty {
        /// Which field was read.
        field: String,
    },
    /// The field the business key is read from is not valid UTF-8.
    #[error("business key not UTF-8: {field} holds invalid UTF-8")]
    KeyNotUtf8 {
        /// Which field was read.
        field: String,
    },
    /// The key is read from the body, but the body is not JSON (or not UTF-8 JSON).
    #[error("body is not JSON: {source}")]
    BodyNotJson {
        /// The parser's error, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// The body is JSON but holds nothing at the configured JSON pointer
    /// (or holds `null` there).
    #[error("JSON pointer {pointer:?} not found in body")]
    PointerNotFound {
        /// The pointer, e.g. `/orderId`.
        pointer: String,
    },
    /// The value at the JSON pointer is an object, an array or a boolean; only strings and
    /// numbers make keys.
    #[error("JSON pointer {pointer:?} holds {found}, not a string or number")]
    KeyNotScalar {
        /// The pointer, e.g. `/orderId`.
        pointer: String,
        /// What was found instead: `an object`, `an array` or `a boolean`.
        found: &'static str,
    },
    /// The field holds a control character (NUL, newline, escape, …). Such keys cannot be
    /// stored (PostgreSQL rejects NUL in text) or logged faithfully, so they are refused
    /// before any store sees them.
    #[error("business key has a control character: {field} holds {character:?}")]
    KeyControlCharacter {
        /// Which field was read.
        field: String,
        /// The first control character found.
        character: char,
    },
    /// The value at the JSON pointer is a number that is not an integer within 64 bits
    /// (e.g. `12345678901234567890123` or `1.5e3`): JSON parsers read such numbers as
    /// floating point, and two different ids could then make one key. Send such ids as
    /// strings.
    #[error("JSON pointer {pointer:?} holds {number}, not an integer within 64 bits; send it as a string")]
    KeyNumberInexact {
        /// The pointer, e.g. `/orderId`.
        pointer: String,
        /// The number as parsed.
        number: String,
    },
    /// The body is larger than the route's maximum; it is refused before any parsing.
    #[error("body is {len} bytes, over the {max}-byte maximum")]
    BodyTooLarge {
        /// The body's length in bytes.
        len: usize,
        /// The route's maximum.
        max: usize,
    },
    /// The composed key is longer than the configured maximum (256 bytes unless configured).
    #[error("business key is {len} bytes, over the {max}-byte maximum")]
    KeyTooLong {
        /// The key's length in bytes.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// A key template could not be parsed (configuration error).
    #[error("invalid key template {template:?}: {reason}")]
    InvalidTemplate {
        /// The template as given.
        template: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A delivery names a state the route's state machine does not declare.
    #[error("unknown state {state:?}")]
    UnknownState {
        /// The state name as read from the delivery.
        state: String,
    },
    /// A state machine definition is inconsistent (configuration error).
    #[error("invalid state machine: {reason}")]
    InvalidStateMachine {
        /// What is wrong with it.
        reason: String,
    },
    /// A schema, table or column name is not a plain SQL identifier (configuration error).
    #[error(
        "invalid SQL identifier {identifier:?}: use 1 to 63 lowercase letters, digits and underscores, not starting with a digit"
    )]
    InvalidIdentifier {
        /// The name as given.
        identifier: String,
    },
    /// A pre-filter was sized with an impossible expected item count or false-positive rate
    /// (configuration error).
    #[error("invalid pre-filter: {reason}")]
    InvalidPreFilter {
        /// What is wrong with it.
        reason: String,
    },
    /// A tier's store failed: unreachable, timed out or answered with an error.
    #[error("{tier} store failed: {source}")]
    Store {
        /// The tier whose store failed.
        tier: Tier,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Wraps a store client's error for `tier`.
    pub fn store(tier: Tier, source: impl Into<BoxError>) -> Self {
        Error::Store {
            tier,
            source: source.into(),
        }
    }

    /// True when the same delivery may succeed if tried again later (a store failure).
    pub fn is_retryable(&self) -> bool {
        self.class() == Class::Store
    }

    /// True when the delivery itself is unusable and must be dead-lettered: retrying it can
    /// never succeed.
    pub fn is_poison(&self) -> bool {
        self.class() == Class::Poison
    }

    /// True when the error is in the route's configuration, not in a delivery.
    pub fn is_config(&self) -> bool {
        self.class() == Class::Config
    }

    /// Who must act on the error. An exhaustive match, so a new variant cannot be left
    /// without a class.
    fn class(&self) -> Class {
        match self {
            Error::KeyMissing { .. }
            | Error::KeyEmpty { .. }
            | Error::KeyNotUtf8 { .. }
            | Error::BodyNotJson { .. }
            | Error::PointerNotFound { .. }
            | Error::KeyNotScalar { .. }
            | Error::KeyControlCharacter { .. }
            | Error::KeyNumberInexact { .. }
            | Error::BodyTooLarge { .. }
            | Error::KeyTooLong { .. }
            | Error::UnknownState { .. } => Class::Poison,
            Error::InvalidTemplate { .. }
            | Error::InvalidStateMachine { .. }
            | Error::InvalidIdentifier { .. }
            | Error::InvalidPreFilter { .. } => Class::Config,
            Error::Store { .. } => Class::Store,
        }
    }
}

/// The three classes of [`Error`], by who must act.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// The delivery's sender: it is dead-lettered.
    Poison,
    /// Whoever configured the route.
    Config,
    /// The store's operator; the delivery is retried.
    Store,
}
