//! A handler's failure, and the classification that turns `?` into a retry or a dead letter.

use std::fmt;
use std::time::Duration;

use crate::dead_letter::DeadLetterReason;
use crate::error::BoxError;
use crate::outcome::{Outcome, RetryReason};

/// Whether trying a delivery again can change a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// It may pass on a later try: a store that is busy or down, a timeout, a lost
    /// connection. The delivery is retried.
    Transient,
    /// It fails the same way on every try: a body that does not parse, a value out of range,
    /// a required field missing. The delivery is dead-lettered at once.
    Permanent,
}

/// How an error type is classified when a handler returns it with `?`.
///
/// Every error type a handler returns with `?` implements this trait (that is what makes
/// `?` convert it into a [`HandlerError`]). oncely implements it for the errors handlers
/// commonly meet:
///
/// | error | class |
/// |---|---|
/// | `serde_json::Error` | permanent (the input is not what the schema says), except an I/O failure while reading |
/// | `std::num::ParseIntError`, `ParseFloatError`, `TryFromIntError`, `std::str::Utf8Error`, `std::string::FromUtf8Error` | permanent |
/// | [`InputError`](crate::InputError) | permanent |
/// | `tokio_postgres::Error` (feature `postgres`) | permanent for SQLSTATE class 22 (data exception: a number out of range, text that is not a number or date) and 23502 (a `NOT NULL` column left empty); transient otherwise: connection, serialization failure, deadlock, lock timeout, 42 (a bug a deploy fixes), and the other integrity violations, which depend on what the data is now and may pass later (23505 unique: a concurrent writer; 23514 check, such as `balance >= 0`: a credit not yet applied; 23503 foreign key: a row not yet written) |
/// | `std::io::Error`, `tokio::time::error::Elapsed`, [`StoreError`](crate::StoreError), [`ConfigError`](crate::ConfigError) (a deploy fixes it), `deadpool_postgres::PoolError`, `redis::RedisError` | transient |
/// | [`oncely::Error`](crate::Error) | permanent for bad input, transient otherwise |
/// | [`BoxError`] | as its concrete type above, when it is one of them; transient otherwise |
///
/// For an error type of your own, implement it: the default is transient, the safe side (a
/// transient failure is retried until the route's attempts run out, then dead-lettered as
/// `attempts_exhausted`; a permanent one is dead-lettered at once as `rejected`).
///
/// ```
/// use oncely::{Classify, ErrorClass};
///
/// #[derive(Debug, thiserror::Error)]
/// enum PayoutError {
///     #[error("no wallet for user {0}")]
///     UnknownUser(String),
///     #[error("ledger unavailable")]
///     LedgerDown(#[source] std::io::Error),
/// }
///
/// impl Classify for PayoutError {
///     fn class(&self) -> ErrorClass {
///         match self {
///             PayoutError::UnknownUser(_) => ErrorClass::Permanent,
///             PayoutError::LedgerDown(_) => ErrorClass::Transient,
///         }
///     }
/// }
/// ```
///
/// The orphan rule keeps you from implementing it for another crate's error type
/// (`reqwest::Error`, `anyhow::Error`): classify such a result at the call with
/// [`ResultExt`] (`client.get(url).send().await.transient()?`), or convert the error into a
/// [`BoxError`] first. [`HandlerError::permanent`] and [`HandlerError::transient`] decide
/// explicitly for one error, whatever its type says.
pub trait Classify: Into<BoxError> {
    /// Whether trying again can change this failure; transient unless overridden.
    fn class(&self) -> ErrorClass {
        ErrorClass::Transient
    }
}

/// A handler's failure: transient (retry later) or permanent (dead-letter).
///
/// Any error whose type implements [`Classify`] converts into a `HandlerError` with `?`,
/// classified by what it is. Use [`HandlerError::permanent`] for a delivery that can never
/// succeed (e.g. an order id that does not exist), so it is dead-lettered at once instead of
/// retried until attempts run out, and [`HandlerError::transient`] for one that may.
pub struct HandlerError {
    source: BoxError,
    class: ErrorClass,
    retry_after: Option<Duration>,
}

impl HandlerError {
    /// A failure of class `class`.
    pub fn new(source: impl Into<BoxError>, class: ErrorClass) -> Self {
        HandlerError {
            source: source.into(),
            class,
            retry_after: None,
        }
    }

    /// A failure that may pass if the delivery is tried again (database busy, timeout).
    pub fn transient(source: impl Into<BoxError>) -> Self {
        HandlerError::new(source, ErrorClass::Transient)
    }

    /// A failure that will happen again on every retry: the delivery is dead-lettered.
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        HandlerError::new(source, ErrorClass::Permanent)
    }

    /// Suggests how long to wait before the retry (ignored for permanent failures).
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// The failure's class.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// True for a permanent failure.
    pub fn is_permanent(&self) -> bool {
        self.class == ErrorClass::Permanent
    }

    /// The outcome this failure gives: [`Outcome::RetryLater`] with
    /// [`RetryReason::HandlerFailed`], or [`Outcome::DeadLetter`] with
    /// [`DeadLetterReason::Rejected`].
    pub fn into_outcome(self) -> Outcome {
        match self.class {
            ErrorClass::Permanent => {
                Outcome::dead_letter(DeadLetterReason::Rejected, self.source.to_string())
            }
            ErrorClass::Transient => Outcome::retry_later(
                RetryReason::HandlerFailed,
                self.source.to_string(),
                self.retry_after,
            ),
        }
    }
}

impl<E: Classify> From<E> for HandlerError {
    fn from(source: E) -> Self {
        let class = source.class();
        HandlerError::new(source, class)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("source", &self.source)
            .field("class", &self.class)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.class {
            ErrorClass::Permanent => "permanent",
            ErrorClass::Transient => "transient",
        };
        write!(f, "{kind} handler failure: {}", self.source)
    }
}

/// The outcome of a handler's answer: processed, or what its error says.
pub(super) fn outcome_of<E: Into<HandlerError>>(answer: Result<(), E>) -> Outcome {
    match answer {
        Ok(()) => Outcome::Processed,
        Err(error) => error.into().into_outcome(),
    }
}

/// Classifies a result's error at the call: for error types that do not implement
/// [`Classify`] (another crate's), or to decide against what their type says.
///
/// ```
/// use oncely::{HandlerError, ResultExt};
///
/// fn parse_amount(text: &str) -> Result<u64, HandlerError> {
///     let amount = text.trim().parse::<u64>().permanent()?;
///     Ok(amount)
/// }
/// # assert!(parse_amount("x").unwrap_err().is_permanent());
/// ```
pub trait ResultExt<T> {
    /// The error, if any, as a transient failure: the delivery is retried.
    fn transient(self) -> Result<T, HandlerError>;
    /// The error, if any, as a permanent failure: the delivery is dead-lettered.
    fn permanent(self) -> Result<T, HandlerError>;
}

impl<T, E: Into<BoxError>> ResultExt<T> for Result<T, E> {
    fn transient(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::transient)
    }

    fn permanent(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::permanent)
    }
}

/// Calls `$then!` with the errors that say the input is wrong: the same input fails the same
/// way every time. One list for their `Classify` impls and the boxed error's downcasts.
macro_rules! with_input_errors {
    ($then:ident) => {
        $then! {
            std::num::ParseIntError,
            std::num::ParseFloatError,
            std::num::TryFromIntError,
            std::str::Utf8Error,
            std::string::FromUtf8Error,
            crate::InputError,
        }
    };
}

macro_rules! permanent {
    ($($error:ty),* $(,)?) => {
        $(impl Classify for $error {
            fn class(&self) -> ErrorClass {
                ErrorClass::Permanent
            }
        })*
    };
}

with_input_errors!(permanent);

impl Classify for std::io::Error {}
impl Classify for tokio::time::error::Elapsed {}
impl Classify for crate::StoreError {}
impl Classify for crate::ConfigError {}

impl Classify for crate::Error {
    fn class(&self) -> ErrorClass {
        match self {
            crate::Error::Input(_) => ErrorClass::Permanent,
            crate::Error::Config(_) | crate::Error::Store(_) => ErrorClass::Transient,
        }
    }
}

/// A boxed error is classified as its concrete type, when that is one of the types above.
impl Classify for BoxError {
    fn class(&self) -> ErrorClass {
        macro_rules! as_one_of {
            ($($error:ty),* $(,)?) => {
                $(if let Some(error) = self.downcast_ref::<$error>() {
                    return error.class();
                })*
            };
        }
        with_input_errors!(as_one_of);
        as_one_of!(serde_json::Error, crate::Error);
        #[cfg(feature = "postgres")]
        as_one_of!(deadpool_postgres::tokio_postgres::Error);
        #[cfg(feature = "mysql")]
        as_one_of!(sqlx::Error);
        ErrorClass::Transient
    }
}

impl Classify for serde_json::Error {
    fn class(&self) -> ErrorClass {
        match self.classify() {
            serde_json::error::Category::Io => ErrorClass::Transient,
            serde_json::error::Category::Syntax
            | serde_json::error::Category::Data
            | serde_json::error::Category::Eof => ErrorClass::Permanent,
        }
    }
}

#[cfg(feature = "redis")]
impl Classify for redis::RedisError {}

#[cfg(feature = "postgres")]
impl Classify for deadpool_postgres::PoolError {}

#[cfg(feature = "postgres")]
impl Classify for deadpool_postgres::tokio_postgres::Error {
    fn class(&self) -> ErrorClass {
        let Some(state) = self.code() else {
            return ErrorClass::Transient;
        };
        let code = state.code();
        if code.starts_with("22") || code == "23502" {
            ErrorClass::Permanent
        } else {
            ErrorClass::Transient
        }
    }
}

/// A statement the server refused for its data (SQLSTATE class 22: a value out of range, too
/// long, not a number) fails the same way every time; anything else may pass later.
#[cfg(feature = "mysql")]
impl Classify for sqlx::Error {
    fn class(&self) -> ErrorClass {
        match self {
            sqlx::Error::Database(error) if error.code().is_some_and(|code| code.starts_with("22")) => {
                ErrorClass::Permanent
            }
            _ => ErrorClass::Transient,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class_of<E: Into<HandlerError>>(error: E) -> ErrorClass {
        error.into().class()
    }

    #[test]
    fn input_errors_are_permanent_and_io_errors_transient() {
        let bad_json = serde_json::from_slice::<serde_json::Value>(b"{").unwrap_err();
        assert_eq!(class_of(bad_json), ErrorClass::Permanent);
        let wrong_shape = serde_json::from_str::<u8>("300").unwrap_err();
        assert_eq!(class_of(wrong_shape), ErrorClass::Permanent);
        assert_eq!(
            class_of(u32::try_from(-1_i64).unwrap_err()),
            ErrorClass::Permanent
        );
        assert_eq!(class_of("x".parse::<i64>().unwrap_err()), ErrorClass::Permanent);
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(class_of(io), ErrorClass::Transient);
        assert_eq!(class_of(crate::StoreError::malformed("x")), ErrorClass::Transient);
        let boxed: BoxError = Box::new("x".parse::<u8>().unwrap_err());
        assert_eq!(class_of(boxed), ErrorClass::Permanent);
        let boxed: BoxError = "a message".into();
        assert_eq!(class_of(boxed), ErrorClass::Transient);
    }

    #[test]
    fn the_class_decides_the_outcome() {
        let permanent = HandlerError::from(u8::try_from(256_u32).unwrap_err()).into_outcome();
        assert_eq!(permanent.dead_letter_reason(), Some(DeadLetterReason::Rejected));
        let transient = HandlerError::transient("busy").into_outcome();
        assert_eq!(transient.retry_reason(), Some(RetryReason::HandlerFailed));
    }
}
