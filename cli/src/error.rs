//! What can go wrong, each with its exit code, and the helpers that turn a store's or a
//! broker's silence into an error naming it.

use std::future::Future;
use std::time::Duration;

use oncely::BoxError;

/// Why a command did not do all it was asked. `main` prints it with its sources and exits
/// with [`CliError::exit_code`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum CliError {
    /// A store or broker did not answer within `--timeout`: unreachable, or overloaded.
    #[error("{service} at {url} did not answer within {}", crate::output::duration(*.timeout))]
    Timeout {
        /// `PostgreSQL`, `MySQL`, `Redis`, `RabbitMQ` or `RocketMQ`.
        service: &'static str,
        /// Its address, without a password.
        url: String,
        /// The `--timeout` that ran out.
        timeout: Duration,
    },
    /// A store or broker refused the connection or answered with an error.
    #[error("{service} at {url} failed")]
    Service {
        /// `PostgreSQL`, `MySQL`, `Redis`, `RabbitMQ` or `RocketMQ`.
        service: &'static str,
        /// Its address, without a password.
        url: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The queue a `dlq` command names (or its dead-letter queue) does not exist. Nothing
    /// was declared.
    #[error("queue {queue:?} does not exist on {url}")]
    QueueNotFound {
        /// The missing queue.
        queue: String,
        /// The broker's address, without a password.
        url: String,
    },
    /// The dead-letter topic a `dlq` command names has no route on the name server: it does
    /// not exist (or the name server knows no broker). Nothing was written.
    #[error("topic {topic:?} does not exist on {namesrv}")]
    TopicNotFound {
        /// The missing topic.
        topic: String,
        /// The name server's address.
        namesrv: String,
    },
    /// The TLS settings (`--ca-cert`, `--client-cert`, `--client-key`) could not be used: a
    /// file missing or not PEM. A certificate a server refuses, or one of the server's this
    /// tool refuses, is the service's error ([`CliError::Service`]).
    #[error("TLS settings")]
    Tls(#[from] oncely::tls::TlsError),
    /// A schema or table name is not a plain SQL identifier.
    #[error("invalid --schema or --table")]
    Config(#[from] oncely::ConfigError),
    /// The key, or the dead letter asked for, is not there.
    #[error("{0}")]
    NotFound(String),
    /// The row or dead letter is not in a state the action applies to; nothing was changed.
    #[error("{0}")]
    Refused(String),
    /// Some of the answer is missing (a store could not be read) or some of the work was left
    /// undone on purpose (dead letters that are not oncely's); what was done is reported.
    #[error("{0}")]
    Incomplete(String),
    /// Another retention runner holds the retention lock; nothing was purged.
    #[error("another retention runner holds the lock; nothing was purged")]
    Busy,
    /// The operator answered no at the confirmation prompt; nothing was changed.
    #[error("declined: nothing was changed")]
    Declined,
    /// Reading the prompt's answer or writing the report failed.
    #[error("terminal input or output failed")]
    Io(#[from] std::io::Error),
}

impl CliError {
    /// The process's exit code for this error (documented in the crate's doc and `--help`).
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            CliError::Timeout { .. }
            | CliError::Service { .. }
            | CliError::QueueNotFound { .. }
            | CliError::TopicNotFound { .. }
            | CliError::Refused(_)
            | CliError::Incomplete(_)
            | CliError::Io(_) => 1,
            CliError::Config(_) | CliError::Tls(_) => 2,
            CliError::NotFound(_) => 3,
            CliError::Busy => 4,
            CliError::Declined => 5,
        }
    }
}

/// `error` with its sources, joined by `: `: how errors are printed. A source whose text
/// its error already shows (`store failed: {source}`) is not repeated.
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A service and its address, for errors that name where they came from.
#[derive(Clone, Debug)]
pub(crate) struct Remote {
    /// `PostgreSQL`, `MySQL`, `Redis`, `RabbitMQ` or `RocketMQ`.
    pub(crate) service: &'static str,
    /// The address, without a password.
    pub(crate) url: String,
    /// How long each call may take.
    pub(crate) timeout: Duration,
}

impl Remote {
    /// `service` at `url` (shown without its password), with calls bounded by `timeout`.
    pub(crate) fn new(service: &'static str, url: &str, timeout: Duration) -> Self {
        Remote {
            service,
            url: redact(url),
            timeout,
        }
    }

    /// `call`'s answer, or an error naming this service if it failed or took longer than
    /// the timeout: a service that does not answer is an error, never a hang.
    pub(crate) async fn call<T, E: Into<BoxError>>(
        &self,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, CliError> {
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(CliError::Timeout {
                service: self.service,
                url: self.url.clone(),
                timeout: self.timeout,
            }),
            Ok(answer) => answer.map_err(|error| self.failed(error)),
        }
    }

    /// The timeout for a client's own timers: a second past the tool's, so that the tool's
    /// timer ([`Remote::call`]) is the one that fires on a silent server, reported as not
    /// answering, rather than the client's, whose error reads as some other failure (a
    /// pool timeout, a topic with no route). The client's timers stay a backstop for work
    /// the tool does not wait on.
    pub(crate) fn backstop(&self) -> Duration {
        self.timeout + Duration::from_secs(1)
    }

    /// `error`, as this service's failure.
    pub(crate) fn failed(&self, error: impl Into<BoxError>) -> CliError {
        CliError::Service {
            service: self.service,
            url: self.url.clone(),
            source: error.into(),
        }
    }
}

/// `url` with its password, if any, replaced by `***`: errors and reports are pasted into
/// tickets and chats.
fn redact(url: &str) -> String {
    let url = redact_password_parameters(url);
    let Some((scheme, rest)) = url.split_once("://") else {
        return url;
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url;
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url,
    }
}

/// `password=…` hidden, as PostgreSQL's key-value strings (`host=db password=s3cret`) and
/// URL query parameters (`?password=s3cret`) carry it: the value up to the next space or `&`.
fn redact_password_parameters(text: &str) -> String {
    let mut redacted = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(found) = rest.find("password=") {
        let value = found + "password=".len();
        redacted.push_str(&rest[..value]);
        redacted.push_str("***");
        let end = rest[value..]
            .find([' ', '&'])
            .map_or(rest.len(), |end| value + end);
        rest = &rest[end..];
    }
    redacted.push_str(rest);
    redacted
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redact("host=db password=s3cret user=app"),
            "host=db password=*** user=app"
        );
        assert_eq!(
            redact("postgres://app@db/shop?sslmode=disable&password=s3cret"),
            "postgres://app@db/shop?sslmode=disable&password=***"
        );
        assert_eq!(
            redact("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact("postgres://postgres@127.0.0.1:5432/test"),
            "postgres://postgres@127.0.0.1:5432/test"
        );
        assert_eq!(redact("redis://:secret@host:6379"), "redis://:***@host:6379");
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}
