//! The adapter's one error type.

/// What can go wrong in the adapter itself. Outcomes of the stack are never errors here:
/// they are settled with the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The AMQP client failed: connection or channel lost, broker refused an operation.
    #[error("AMQP: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker answered a publish with a negative confirm (it could not store it).
    #[error("the broker refused the message (negative publisher confirm)")]
    Nacked,
    /// No queue is bound for the message: the broker returned it instead of storing it.
    #[error("no queue takes messages for exchange {exchange:?} and routing key {routing_key:?}")]
    Unroutable {
        /// The exchange published to (empty: the default exchange).
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// The broker did not confirm a publish in time; it may or may not have stored it.
    #[error("no publisher confirm within {0:?}")]
    ConfirmTimeout(std::time::Duration),
    /// [`Runner::run_with_reconnect`](crate::Runner::run_with_reconnect) failed to connect,
    /// open a channel or declare its topology the configured number of times in a row.
    #[error("could not start consuming after {attempts} attempts in a row: {last}")]
    ConnectGaveUp {
        /// How many attempts failed.
        attempts: u32,
        /// The last failure.
        last: Box<Error>,
    },
    /// A publish was retried the configured number of times without a confirm.
    #[error("publish failed after {attempts} attempts: {last}")]
    PublishGaveUp {
        /// How many times the message was sent.
        attempts: u32,
        /// The last failure.
        last: Box<Error>,
    },
}

impl Error {
    /// True when trying again (after reconnecting, for a lost connection) may succeed. An
    /// unroutable message stays unroutable until someone binds a queue for it; refused
    /// credentials, a refused virtual host or a refused declaration stay refused until
    /// someone changes the configuration.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Amqp(error) => !refused_for_good(error),
            Error::Nacked | Error::ConfirmTimeout(_) => true,
            Error::Unroutable { .. } | Error::PublishGaveUp { .. } | Error::ConnectGaveUp { .. } => false,
        }
    }
}

/// Errors a reconnect cannot fix: the broker refused the credentials (`ACCESS_REFUSED`),
/// the virtual host (`NOT_ALLOWED`, `INVALID_PATH`) or a declaration whose arguments differ
/// from the existing queue's (`PRECONDITION_FAILED`); the broker speaks another protocol.
fn refused_for_good(error: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED) => true,
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED | AMQPHardError::INVALIDPATH) => true,
            AMQPErrorKind::Soft(_) | AMQPErrorKind::Hard(_) => false,
        },
        lapin::ErrorKind::InvalidProtocolVersion(_) | lapin::ErrorKind::AuthProviderError(_) => true,
        _ => false,
    }
}
