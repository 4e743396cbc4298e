//! Errors, one type per party that must act on them.
//!
//! | type | who acts | what oncely does |
//! |---|---|---|
//! | [`InputError`] | the delivery's sender: the message itself is unusable | dead-letters it with the error as the reason |
//! | [`ConfigError`] | whoever configured the route | reports it when the route or layer is built, before any delivery |
//! | [`StoreError`] | the store's operator | retries the delivery later (or, failing open, lets the tiers behind decide) |
//!
//! [`Error`] holds any of the three, for code that wants one error type (`?` converts each).
//! A duplicate is never an error: it is [`Outcome::Duplicate`](crate::Outcome::Duplicate).

use std::sync::Arc;

/// A boxed error from a store client or a user's service.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A delivery that can never be processed as it is: no usable key, a body too large, a
/// state the route does not know. Retrying cannot help, so the delivery is dead-lettered
/// with this error as the reason's detail.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InputError {
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
    /// A value is read from the body (a key, an entity, a fingerprint field), but the body
    /// is not JSON (or not UTF-8 JSON).
    #[error("body is not JSON: {source}")]
    BodyNotJson {
        /// The parser's error, with line and column; shared, because the body is parsed
        /// once per delivery and every reader sees the same failure.
        #[source]
        source: Arc<serde_json::Error>,
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
    /// A delivery names a state the route's state machine does not declare.
    #[error("unknown state {state:?}")]
    UnknownState {
        /// The state name as read from the delivery.
        state: String,
    },
}

/// A route, layer or store configured wrongly. Returned by the constructors that validate
/// their configuration, so it shows when the route is built, never per delivery.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key template could not be parsed.
    #[error("invalid key template {template:?}: {reason}")]
    InvalidTemplate {
        /// The template as given.
        template: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A state machine definition is inconsistent.
    #[error("invalid state machine: {reason}")]
    InvalidStateMachine {
        /// What is wrong with it.
        reason: String,
    },
    /// A schema, table or column name is not a plain SQL identifier.
    #[error(
        "invalid SQL identifier {identifier:?}: use 1 to 63 lowercase letters, digits and underscores, not starting with a digit"
    )]
    InvalidIdentifier {
        /// The name as given.
        identifier: String,
    },
    /// A fingerprint policy names no field, or a field that is not a JSON pointer.
    #[error("invalid fingerprint policy: {reason}")]
    InvalidFingerprint {
        /// What is wrong with it.
        reason: String,
    },
    /// A pre-filter was sized with an impossible expected item count or false-positive rate.
    #[error("invalid pre-filter: {reason}")]
    InvalidPreFilter {
        /// What is wrong with it.
        reason: String,
    },
    /// A layer needs a tier that its stack lacks, such as stored responses without the
    /// transactional record to write them in. Found when the first request comes, where
    /// only a request can tell: nothing runs until the stack is fixed.
    #[error("{layer} needs {needed} in its tiers")]
    MissingTier {
        /// The layer or store that needs it.
        layer: String,
        /// What it needs, and where to put it.
        needed: String,
    },
    /// A table oncely needs does not exist: its migration was not run.
    #[error("table {table} does not exist: {fix}")]
    MissingTable {
        /// The table, as qualified in statements.
        table: String,
        /// How to create it.
        fix: String,
    },
}

/// A store failed: what every backend of every tier returns. It names no tier — the tier
/// that called the store adds that when it reports the failure — and holds no delivery
/// error, so a backend cannot turn a store failure into a dead letter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The client failed: the store is unreachable, timed out, or answered with an error.
    #[error("store failed: {source}")]
    Failed {
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The store answered with data that oncely did not write: an unknown record status, a
    /// malformed fingerprint or marker. Someone else wrote to oncely's keys or tables.
    #[error("store holds unexpected data: {what}")]
    Malformed {
        /// What was found.
        what: String,
    },
}

impl StoreError {
    /// Wraps a store client's error; backends of your own use this (or `?`, for the clients
    /// that convert by themselves).
    pub fn new(source: impl Into<BoxError>) -> Self {
        StoreError::Failed {
            source: source.into(),
        }
    }

    /// The store holds `what`, which oncely did not write.
    pub fn malformed(what: impl Into<String>) -> Self {
        StoreError::Malformed { what: what.into() }
    }
}

#[cfg(feature = "redis")]
impl From<redis::RedisError> for StoreError {
    fn from(error: redis::RedisError) -> Self {
        StoreError::new(error)
    }
}

#[cfg(feature = "postgres")]
impl From<deadpool_postgres::tokio_postgres::Error> for StoreError {
    fn from(error: deadpool_postgres::tokio_postgres::Error) -> Self {
        StoreError::new(error)
    }
}

#[cfg(feature = "postgres")]
impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(error: deadpool_postgres::PoolError) -> Self {
        StoreError::new(error)
    }
}

#[cfg(feature = "mysql")]
impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        StoreError::new(error)
    }
}

/// Any of oncely's errors, for code that wants one type; `?` converts each.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The delivery is unusable; see [`InputError`].
    #[error(transparent)]
    Input(#[from] InputError),
    /// The configuration is wrong; see [`ConfigError`].
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A store failed; see [`StoreError`].
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Error {
    /// True when the same delivery may succeed if tried again later (a store failure).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Store(_) => true,
            Error::Input(_) | Error::Config(_) => false,
        }
    }

    /// True when the delivery itself is unusable and must be dead-lettered: retrying it can
    /// never succeed.
    pub fn is_poison(&self) -> bool {
        match self {
            Error::Input(_) => true,
            Error::Config(_) | Error::Store(_) => false,
        }
    }

    /// True when the error is in the route's configuration, not in a delivery.
    pub fn is_config(&self) -> bool {
        match self {
            Error::Config(_) => true,
            Error::Input(_) | Error::Store(_) => false,
        }
    }
}
