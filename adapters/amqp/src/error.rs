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
    /// unroutable message stays unroutable until someone binds a queue for it.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Error::PublishGaveUp { .. } | Error::Unroutable { .. })
    }
}
