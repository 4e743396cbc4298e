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
    /// A queue of the topology exists with other arguments than oncely declares it with
    /// (a classic queue producers already publish to, say), and the broker refused the
    /// declaration (`PRECONDITION_FAILED`). RabbitMQ never changes a declared queue's
    /// arguments: consume it as it is
    /// ([`Topology::with_existing_work_queue`](crate::Topology::with_existing_work_queue)), or
    /// move onto oncely's own queues (README, "Moving onto a queue that already exists").
    #[error(
        "queue {queue:?} exists with other arguments than oncely's ({argument}): consume it as it is with \
         Topology::with_existing_work_queue, or move onto oncely's queues (README, \"Moving onto a queue \
         that already exists\"); the broker said: {said}"
    )]
    QueueMismatch {
        /// The queue.
        queue: String,
        /// The argument the broker named (`x-dead-letter-exchange`, `x-queue-type`, …), or
        /// "an argument" when it named none.
        argument: String,
        /// The broker's own words.
        said: String,
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
            Error::Unroutable { .. }
            | Error::PublishGaveUp { .. }
            | Error::ConnectGaveUp { .. }
            | Error::QueueMismatch { .. } => false,
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

impl Error {
    /// `error`, a failed declaration of `queue`, as [`Error::QueueMismatch`] when the broker
    /// refused it for arguments that differ from the existing queue's.
    pub(crate) fn declaring(queue: &str, error: lapin::Error) -> Self {
        use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
        let lapin::ErrorKind::ProtocolError(amqp) = error.kind() else {
            return Error::Amqp(error);
        };
        if !matches!(
            amqp.kind(),
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
        ) {
            return Error::Amqp(error);
        }
        let said = amqp.get_message().to_string();
        // "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue …"
        let argument = said
            .split_once("inequivalent arg '")
            .and_then(|(_, rest)| rest.split_once('\''))
            .map_or_else(|| "an argument".to_owned(), |(argument, _)| argument.to_owned());
        Error::QueueMismatch {
            queue: queue.to_owned(),
            argument,
            said,
        }
    }
}
