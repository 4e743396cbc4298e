//! The adapter's one error type.

use rocketmq_model::result::SendStatus;

/// What can go wrong in the adapter itself. Outcomes of the stack are never errors here:
/// they become listener statuses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The RocketMQ client failed: no route to the topic, broker unreachable, timeout.
    #[error("RocketMQ client: {0}")]
    Client(#[from] rocketmq_client_rust::ClientError),
    /// The broker answered a send with a status other than `SEND_OK`: the message may not be
    /// stored durably (flush or replica timeout, no replica).
    #[error("the broker did not store the message durably: {0:?}")]
    NotStored(SendStatus),
    /// The client returned no send result for a synchronous send.
    #[error("the client returned no send result")]
    NoSendResult,
    /// The RocketMQ client's runtime could not be built.
    #[error("RocketMQ client runtime: {0}")]
    Runtime(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// True when trying again may succeed: every failure here is about the broker or the
    /// connection, except a runtime that cannot be built.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Client(_) | Error::NotStored(_) | Error::NoSendResult => true,
            Error::Runtime(_) => false,
        }
    }
}
