//! The Redis store: the flag, lock and delivery-limit backends on it, the flag and lock
//! run together, and what they share — the connection bound, key names and scripts.

pub(crate) mod deliveries;
pub(crate) mod flag;
pub(crate) mod flag_lock;
pub(crate) mod lock;
mod steps;

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

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
///
/// Redis takes the text between the first `{` and the first `}` after it as the tag. An id
/// holding `}` would cut the tag short, and one starting with `}` would leave it empty, so
/// the whole key would be hashed and a lock and its counter could land in different slots
/// (`CROSSSLOT`). Such an id gets a tag of its hash instead, with the id itself after it so
/// the key stays unique: `prefix:kind:{#hash}id`. A prefix must hold no braces.
pub(crate) fn tagged_key(prefix: &str, kind: &str, id: &str) -> String {
    if id.contains('}') {
        let hash = xxhash_rust::xxh3::xxh3_64(id.as_bytes());
        format!("{prefix}:{kind}:{{#{hash:016x}}}{id}")
    } else {
        format!("{prefix}:{kind}:{{{id}}}")
    }
}

/// A duration in whole milliseconds for `PX`/`PEXPIRE`, at least 1: Redis rejects 0.
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Lua: `compare_and_delete(key, value)` deletes `key` only if it still holds `value` (1
/// if it did, else 0): a holder can never delete what a later holder wrote after its own
/// lease ran out. Shared by the flag's release, the lock's release and their joint script.
pub(crate) const LUA_COMPARE_AND_DELETE: &str = r"
local function compare_and_delete(key, value)
    if redis.call('GET', key) == value then
        return redis.call('DEL', key)
    end
    return 0
end
";

/// [`LUA_COMPARE_AND_DELETE`] on `KEYS[1]` and `ARGV[1]`.
pub(crate) static COMPARE_AND_DELETE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[LUA_COMPARE_AND_DELETE],
        "return compare_and_delete(KEYS[1], ARGV[1])",
    )
});

/// A script of the Lua `functions` (snippets defining local functions) and `body` calling
/// them: each decision is written once in Lua, whether one store's script or a joint one
/// runs it.
pub(crate) fn script(functions: &[&str], body: &str) -> Script {
    Script::new(&format!("{}\n{body}", functions.concat()))
}

#[cfg(test)]
mod tests {
    use super::tagged_key;

    /// The hash tag as Redis Cluster reads it: `None` when the whole key is hashed.
    fn hash_tag(key: &str) -> Option<&str> {
        let open = key.find('{')?;
        let close = key[open + 1..].find('}')? + open + 1;
        (close > open + 1).then(|| &key[open + 1..close])
    }

    #[test]
    fn every_id_gets_one_nonempty_tag_for_all_its_keys() {
        for id in ["order_1", "}x", "a}b", "{x}", "}", "{", "a{b"] {
            let lock = tagged_key("oncely", "lock", id);
            let fence = tagged_key("oncely", "fence", id);
            assert!(hash_tag(&lock).is_some(), "{id:?}: {lock}");
            assert_eq!(hash_tag(&lock), hash_tag(&fence), "{id:?}");
        }
        assert_eq!(tagged_key("p", "lock", "order_1"), "p:lock:{order_1}");
        assert_ne!(tagged_key("p", "lock", "a}b"), tagged_key("p", "lock", "a}c"));
    }
}
