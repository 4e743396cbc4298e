//! Publishing with confirms, a stable message id and retries that consumers can remove.

use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::error::Error;
use crate::runner::publish_confirmed;

/// The header a [`Producer`] writes the business key to unless configured otherwise.
pub const DEFAULT_KEY_HEADER: &str = "x-business-key";

/// Publishes with publisher confirms, stamps every message with a `message_id` (UUIDv7) and
/// its business key header, and retries a publish whose confirm timed out or whose channel
/// was lost **with the same message id** — so the consumer side, keyed by message id or by
/// business key, removes the duplicates those retries create.
///
/// A retry opens a new channel on the same connection; when the connection itself is lost,
/// retries succeed only if lapin's auto-recovery brings it back
/// (`ConnectionProperties::enable_auto_recover`).
pub struct Producer {
    connection: Connection,
    channel: Mutex<Option<Channel>>,
    key_header: String,
    confirm_timeout: Duration,
    max_attempts: u32,
}

impl Producer {
    /// A producer on `connection`. Defaults: key header [`DEFAULT_KEY_HEADER`], 5 s per
    /// confirm, 5 attempts per message with 100 ms, 200 ms, … between them.
    pub fn new(connection: Connection) -> Self {
        Producer {
            connection,
            channel: Mutex::new(None),
            key_header: DEFAULT_KEY_HEADER.into(),
            confirm_timeout: Duration::from_secs(5),
            max_attempts: 5,
        }
    }

    /// Sets the header that carries the business key.
    pub fn with_key_header(mut self, header: impl Into<String>) -> Self {
        self.key_header = header.into();
        self
    }

    /// Sets how long a publish waits for its confirm before it is sent again.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Sets how many times one message is sent at most.
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// A new message id: a UUIDv7, which sorts by creation time.
    pub fn new_message_id() -> String {
        uuid::Uuid::now_v7().to_string()
    }

    /// Publishes `body` to `exchange` with `routing_key` under a new message id, which it
    /// returns once the broker confirmed the message. `business_key`, if given, goes into the
    /// key header.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        business_key: Option<&str>,
    ) -> Result<String, Error> {
        let message_id = Self::new_message_id();
        self.publish_with_id(&message_id, exchange, routing_key, body, business_key)
            .await?;
        Ok(message_id)
    }

    /// Publishes under `message_id`: use it to send a message again that an earlier call may
    /// or may not have delivered.
    pub async fn publish_with_id(
        &self,
        message_id: &str,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        business_key: Option<&str>,
    ) -> Result<(), Error> {
        let mut headers = FieldTable::default();
        if let Some(key) = business_key {
            headers.insert(self.key_header.as_str().into(), AMQPValue::LongString(key.into()));
        }
        let properties = BasicProperties::default()
            .with_message_id(message_id.into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let mut pause = Duration::from_millis(100);
        let mut attempt = 1;
        loop {
            let sent = async {
                let channel = self.channel().await?;
                publish_confirmed(
                    &channel,
                    exchange,
                    routing_key,
                    body,
                    properties.clone(),
                    self.confirm_timeout,
                )
                .await
            };
            match sent.await {
                Ok(()) => return Ok(()),
                Err(last) if !last.is_retryable() => return Err(last),
                Err(last) if attempt >= self.max_attempts => {
                    return Err(Error::PublishGaveUp {
                        attempts: attempt,
                        last: Box::new(last),
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, message_id, attempt, "publish not confirmed; sending again with the same id");
                    // The channel may be broken; the next attempt opens a fresh one.
                    *self.channel.lock().await = None;
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    attempt += 1;
                }
            }
        }
    }

    async fn channel(&self) -> Result<Channel, Error> {
        let mut slot = self.channel.lock().await;
        if let Some(channel) = slot.as_ref().filter(|channel| channel.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = self.connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        *slot = Some(channel.clone());
        Ok(channel)
    }
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("key_header", &self.key_header)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}
