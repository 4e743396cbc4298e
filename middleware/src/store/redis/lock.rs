use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::{COMPARE_AND_DELETE, DEFAULT_REDIS_PREFIX, RedisConnection, millis, script, tagged_key};
use crate::error::StoreError;
use crate::lock::LockStore;
use crate::token::Token;

/// Lua: `acquire(lock, fence, token, lease_ms)` takes the lock if free and hands out the
/// next fencing token, in one step; false when another holder has it.
///
/// A missing counter (`INCR` answers 1) starts from the server's clock in microseconds, not
/// from 0: a counter lost with Redis (a flush, a restart without persistence) must not hand
/// out tokens older than those a business store already saw, and one entity is never locked
/// a million times a second. (Lua numbers are doubles, so the seed is built as a string.)
/// Seeding only then keeps the common acquire at two commands, and a new entity's at most
/// four. The clock is read once per script call: a joint script acquiring for many
/// deliveries (see [`flag_lock`](super::flag_lock)) seeds every new entity of the call from
/// one `TIME`, so a new entity after the first costs three (seeds of different entities
/// need not differ, and a second acquire of one entity finds its counter).
pub(super) const LUA_ACQUIRE: &str = r"
local seed = nil
local function acquire(lock, fence, token, lease)
    if redis.call('SET', lock, token, 'NX', 'PX', lease) then
        local next = redis.call('INCR', fence)
        if next == 1 then
            if not seed then
                local now = redis.call('TIME')
                seed = now[1] .. string.format('%06d', tonumber(now[2]))
            end
            next = redis.call('INCRBY', fence, seed)
        end
        return next
    end
    return false
end
";

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[LUA_ACQUIRE],
        "return acquire(KEYS[1], KEYS[2], ARGV[1], ARGV[2])",
    )
});

/// Extends the lease only while the caller still holds the lock.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        if redis.call('GET', KEYS[1]) == ARGV[1] then
            return redis.call('PEXPIRE', KEYS[1], ARGV[2])
        end
        return 0
        ",
    )
});

/// A [`LockStore`] on Redis, shared by every consumer process.
///
/// Per entity, two keys with the entity as Redis Cluster hash tag, so one script can touch
/// both: the lock `PREFIX:lock:{ENTITY}` holding the holder's token with the lease as expiry,
/// and the fencing counter `PREFIX:fence:{ENTITY}`, incremented on each acquisition. The
/// counter never expires — an expired counter would start again and could hand a new holder
/// a token older than a stale holder's — so it costs one small key per entity ever locked.
/// A counter lost anyway (a flush, a restart of a Redis without persistence) starts again
/// from the Redis server's clock in microseconds, above every token handed out before as
/// long as that clock did not go back.
///
/// This is a single-instance lock (no Redlock): if Redis fails over to a replica that had
/// not received the lock, two holders can overlap. The watchdog then usually reports the
/// lost lease, and fencing tokens let the business store reject the stale holder's writes.
pub struct RedisLockStore<C> {
    connection: C,
    prefix: Arc<str>,
}

impl<C: RedisConnection> RedisLockStore<C> {
    /// A store on `connection` with the key prefix `oncely`.
    pub fn new(connection: C) -> Self {
        RedisLockStore {
            connection,
            prefix: DEFAULT_REDIS_PREFIX.into(),
        }
    }

    /// Sets the key prefix, e.g. per application or environment.
    pub fn with_prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The Redis key holding `entity`'s lock.
    pub fn redis_key(&self, entity: &str) -> String {
        tagged_key(&self.prefix, "lock", entity)
    }

    pub(super) fn fence_key(&self, entity: &str) -> String {
        tagged_key(&self.prefix, "fence", entity)
    }

    /// `entity`'s lock holder, its lease left and the fencing counter, read without changing
    /// anything: for an operator (`oncely inspect --entity`).
    pub async fn inspect(&self, entity: &str) -> Result<LockView, StoreError> {
        let redis_key = self.redis_key(entity);
        // One transaction (both keys share the entity's hash tag): one moment's view.
        let (holder, ttl_ms, counter): (Option<String>, i64, Option<u64>) = redis::pipe()
            .atomic()
            .get(&redis_key)
            .pttl(&redis_key)
            .get(self.fence_key(entity))
            .query_async(&mut self.connection.clone())
            .await?;
        Ok(LockView {
            redis_key,
            ttl: holder
                .is_some()
                .then(|| u64::try_from(ttl_ms).ok().map(Duration::from_millis))
                .flatten(),
            holder,
            fencing_counter: counter,
        })
    }
}

/// One entity's lock, as [`RedisLockStore::inspect`] read it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockView {
    /// The Redis key holding the lock.
    pub redis_key: String,
    /// The token of the holder; `None` when the lock is free.
    pub holder: Option<String>,
    /// How long the holder's lease has left.
    pub ttl: Option<Duration>,
    /// The last fencing token handed out for the entity; `None` if it was never locked
    /// (or Redis lost the counter).
    pub fencing_counter: Option<u64>,
}

impl<C: Clone> Clone for RedisLockStore<C> {
    fn clone(&self) -> Self {
        RedisLockStore {
            connection: self.connection.clone(),
            prefix: self.prefix.clone(),
        }
    }
}

impl<C> fmt::Debug for RedisLockStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLockStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl<C: RedisConnection> LockStore for RedisLockStore<C> {
    async fn acquire(&self, entity: &str, token: Token, lease: Duration) -> Result<Option<u64>, StoreError> {
        ACQUIRE
            .key(self.redis_key(entity))
            .key(self.fence_key(entity))
            .arg(token.to_string())
            .arg(millis(lease))
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(StoreError::from)
    }

    async fn renew(&self, entity: &str, token: Token, lease: Duration) -> Result<bool, StoreError> {
        RENEW
            .key(self.redis_key(entity))
            .arg(token.to_string())
            .arg(millis(lease))
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(StoreError::from)
    }

    async fn release(&self, entity: &str, token: Token) -> Result<bool, StoreError> {
        COMPARE_AND_DELETE
            .key(self.redis_key(entity))
            .arg(token.to_string())
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(StoreError::from)
    }
}
