use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use super::{DEFAULT_REDIS_PREFIX, RedisConnection, millis, tagged_key};
use crate::deliveries::DeliveryCounter;
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::tier::BoxFuture;

/// Takes back one start, deleting the counter at zero so no empty keys linger.
static RELEASE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new("if redis.call('DECR', KEYS[1]) <= 0 then redis.call('DEL', KEYS[1]) end return 0")
});

/// A [`DeliveryCounter`] on Redis 7.0 or later, shared by every consumer process: one
/// counter per key, `PREFIX:deliveries:{KEY}`, counted with `INCR` and `PEXPIRE` in one
/// round trip, taken back with a script (`DECR`) and cleared with `DEL`.
///
/// A count lost with Redis's data (a restart without persistence, `FLUSHALL`) lets a
/// crashing message run up to the limit again; it never stops a healthy one.
pub struct RedisDeliveryCounter<C> {
    connection: C,
    prefix: Arc<str>,
}

impl<C: RedisConnection> RedisDeliveryCounter<C> {
    /// A counter on `connection` with the key prefix `oncely`.
    pub fn new(connection: C) -> Self {
        RedisDeliveryCounter {
            connection,
            prefix: DEFAULT_REDIS_PREFIX.into(),
        }
    }

    /// Sets the key prefix, e.g. per application or environment.
    pub fn with_prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    fn redis_key(&self, key: &BusinessKey) -> String {
        tagged_key(&self.prefix, "deliveries", key.as_str())
    }
}

impl<C> fmt::Debug for RedisDeliveryCounter<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisDeliveryCounter")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl<C: RedisConnection> DeliveryCounter for RedisDeliveryCounter<C> {
    fn unsettled(&self, key: &BusinessKey) -> BoxFuture<Result<u32, StoreError>> {
        let (mut connection, key) = (self.connection.clone(), self.redis_key(key));
        Box::pin(async move {
            let count: Option<u32> = redis::cmd("GET")
                .arg(key)
                .query_async(&mut connection)
                .await
                .map_err(StoreError::from)?;
            Ok(count.unwrap_or(0))
        })
    }

    fn start(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>> {
        let (mut connection, key) = (self.connection.clone(), self.redis_key(key));
        Box::pin(async move {
            redis::pipe()
                .atomic()
                .incr(&key, 1)
                .ignore()
                .pexpire(&key, i64::try_from(millis(ttl)).unwrap_or(i64::MAX))
                .ignore()
                .query_async::<()>(&mut connection)
                .await
                .map_err(StoreError::from)
        })
    }

    fn mark(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>> {
        let (mut connection, key) = (self.connection.clone(), self.redis_key(key));
        Box::pin(async move {
            redis::cmd("SET")
                .arg(key)
                .arg(1)
                .arg("NX")
                .arg("PX")
                .arg(millis(ttl))
                .query_async::<()>(&mut connection)
                .await
                .map_err(StoreError::from)
        })
    }

    fn release(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>> {
        let (mut connection, key) = (self.connection.clone(), self.redis_key(key));
        Box::pin(async move {
            RELEASE
                .key(key)
                .invoke_async::<()>(&mut connection)
                .await
                .map_err(StoreError::from)
        })
    }

    fn settle(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>> {
        let (mut connection, key) = (self.connection.clone(), self.redis_key(key));
        Box::pin(async move {
            redis::cmd("DEL")
                .arg(key)
                .query_async::<()>(&mut connection)
                .await
                .map_err(StoreError::from)
        })
    }
}
