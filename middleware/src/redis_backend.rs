//! What the Redis backends share: the connection bound, key names and scripts.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

use crate::error::Error;
use crate::outcome::Tier;

/// A Redis connection the Redis backends can use: any cloneable async connection, such as
/// `redis::aio::ConnectionManager` (reconnects by itself) or a Redis Cluster connection.
///
/// Every backend call clones it and sends one command or script, so it must be cheap to
/// clone and safe to use from many tasks: multiplexed connections are.
pub trait RedisConnection: ConnectionLike + Clone + Send + Sync + 'static {}

impl<T: ConnectionLike + Clone + Send + Sync + 'static> RedisConnection for T {}

/// The key prefix of the Redis backends unless configured otherwise.
pub const DEFAULT_REDIS_PREFIX: &str = "oncely";

/// `prefix:kind:{id}`. The braces make `id` the key's Redis Cluster hash tag, so every key
/// one script touches for an id lands in the same slot (the lock and its fencing counter).
pub(crate) fn tagged_key(prefix: &str, kind: &str, id: &str) -> String {
    format!("{prefix}:{kind}:{{{id}}}")
}

/// A duration in whole milliseconds for `PX`/`PEXPIRE`, at least 1: Redis rejects 0.
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX).max(1)
}

pub(crate) fn store_error(tier: Tier) -> impl Fn(redis::RedisError) -> Error {
    move |error| Error::store(tier, error)
}

/// Deletes `KEYS[1]` only if it still holds `ARGV[1]`: a holder can never delete what a
/// later holder wrote after its own lease ran out.
pub(crate) static COMPARE_AND_DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        if redis.call('GET', KEYS[1]) == ARGV[1] then
            return redis.call('DEL', KEYS[1])
        end
        return 0
        ",
    )
});
