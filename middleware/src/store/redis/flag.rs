use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::{COMPARE_AND_DELETE, DEFAULT_REDIS_PREFIX, RedisConnection, millis, script, tagged_key};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::flag::{Claim, FlagStore, FlagUpdate};
use crate::token::Token;

/// The prefix of an in-flight marker; a done marker's is `d:`.
pub(super) const IN_FLIGHT: &str = "i:";
const DONE: &str = "d:";

/// Lua: `complete(key, in_flight, done, retention_ms)` turns the caller's in-flight marker
/// into the done marker with a new expiry (1), or changes nothing when the marker is not the
/// caller's (0).
pub(super) const LUA_COMPLETE: &str = r"
local function complete(key, in_flight, done, retention)
    if redis.call('GET', key) == in_flight then
        redis.call('SET', key, done, 'PX', retention)
        return 1
    end
    return 0
end
";

static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[LUA_COMPLETE],
        "return complete(KEYS[1], ARGV[1], ARGV[2], ARGV[3])",
    )
});

/// Lua: `settle(key, update, in_flight, done, retention)` is the flag's `update` of the
/// claim `in_flight` ('complete', 'release', 'mark_done' or 'nothing', as [`settle_args`]
/// names them), with the done marker `done`: 1, or 0 when the update found the marker not
/// the caller's. Needs `complete` and `compare_and_delete`.
pub(super) const LUA_SETTLE: &str = r"
local function settle(key, update, in_flight, done, retention)
    if update == 'complete' then
        return complete(key, in_flight, done, retention)
    elseif update == 'release' then
        return compare_and_delete(key, in_flight)
    elseif update == 'mark_done' then
        redis.call('SET', key, done, 'PX', retention)
    end
    return 1
end
";

/// A [`FlagStore`] on Redis 7.0 or later, shared by every consumer process.
///
/// One string key per business key, `PREFIX:flag:{KEY}` (the braces are the Redis Cluster
/// hash tag), holding `i:TOKEN` while in flight and `d:FINGERPRINT` when done, each with its
/// expiry:
/// - claim is one command, `SET key i:TOKEN NX GET PX lease`: it sets the marker only if
///   there is none and returns what was there, so checking and claiming cannot race;
/// - complete and release are Lua scripts that compare the token first;
/// - look is one `GET`, and mark done one `SET key d:FINGERPRINT PX retention`: a flag with
///   a record behind it claims nothing, so it costs a read and a write per delivery.
///
/// Markers vanish when Redis loses its data (restart without persistence, `FLUSHALL`,
/// eviction under `maxmemory`): the flag then lets duplicates through to the tiers behind.
pub struct RedisFlagStore<C> {
    pub(super) connection: C,
    pub(super) prefix: Arc<str>,
}

impl<C: RedisConnection> RedisFlagStore<C> {
    /// A store on `connection` with the key prefix `oncely`.
    pub fn new(connection: C) -> Self {
        RedisFlagStore {
            connection,
            prefix: DEFAULT_REDIS_PREFIX.into(),
        }
    }

    /// Sets the key prefix, e.g. per application or environment.
    pub fn with_prefix(mut self, prefix: impl Into<Arc<str>>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The Redis key holding `key`'s marker.
    pub fn redis_key(&self, key: &BusinessKey) -> String {
        tagged_key(&self.prefix, "flag", key.as_str())
    }

    /// `key`'s marker and how long it has left, read without changing anything: for an
    /// operator (`oncely inspect`).
    pub async fn inspect(&self, key: &BusinessKey) -> Result<FlagView, StoreError> {
        let redis_key = self.redis_key(key);
        // One transaction: the marker and its expiry as of the same moment.
        let (marker, ttl_ms): (Option<String>, i64) = redis::pipe()
            .atomic()
            .get(&redis_key)
            .pttl(&redis_key)
            .query_async(&mut self.connection.clone())
            .await?;
        let state = match marker {
            None => FlagState::Absent,
            Some(marker) => match parse_marker(&marker)? {
                Claim::Done(fingerprint) => FlagState::Done { fingerprint },
                Claim::InFlight | Claim::Won => FlagState::InFlight,
            },
        };
        Ok(FlagView {
            redis_key,
            state,
            ttl: u64::try_from(ttl_ms).ok().map(Duration::from_millis),
        })
    }
}

/// One business key's flag marker, as [`RedisFlagStore::inspect`] read it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FlagView {
    /// The Redis key holding the marker.
    pub redis_key: String,
    /// The marker.
    pub state: FlagState,
    /// How long the marker has left; `None` when there is no marker (or it never expires,
    /// which oncely never writes).
    pub ttl: Option<Duration>,
}

/// What a flag marker says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FlagState {
    /// No marker: the key was never seen, or its marker expired or was lost with Redis.
    Absent,
    /// A delivery of the key holds it while it runs (until its lease).
    InFlight,
    /// The key was processed, with this payload's fingerprint.
    Done {
        /// The fingerprint of the payload that was processed.
        fingerprint: Fingerprint,
    },
}

impl<C: Clone> Clone for RedisFlagStore<C> {
    fn clone(&self) -> Self {
        RedisFlagStore {
            connection: self.connection.clone(),
            prefix: self.prefix.clone(),
        }
    }
}

impl<C> fmt::Debug for RedisFlagStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisFlagStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The marker of a key in flight under `token`.
pub(super) fn in_flight_marker(token: Token) -> String {
    format!("{IN_FLIGHT}{token}")
}

/// The marker of a key done with the payload `fingerprint`.
pub(super) fn done_marker(fingerprint: Fingerprint) -> String {
    format!("{DONE}{fingerprint}")
}

/// `update` as the joint settle script takes it: its name, and the in-flight marker of its
/// claim ('' when it has none).
pub(super) fn settle_args(update: FlagUpdate) -> (&'static str, String) {
    match update {
        FlagUpdate::Complete(token) => ("complete", in_flight_marker(token)),
        FlagUpdate::Release(token) => ("release", in_flight_marker(token)),
        FlagUpdate::MarkDone => ("mark_done", String::new()),
        FlagUpdate::Nothing => ("nothing", String::new()),
    }
}

/// What a marker says, as a claim that found it would answer.
pub(super) fn parse_marker(marker: &str) -> Result<Claim, StoreError> {
    if marker.starts_with(IN_FLIGHT) {
        return Ok(Claim::InFlight);
    }
    marker
        .strip_prefix(DONE)
        .and_then(|hex| u128::from_str_radix(hex, 16).ok())
        .map(|value| Claim::Done(Fingerprint::from_u128(value)))
        .ok_or_else(|| StoreError::malformed(format!("unexpected flag marker {marker:?}")))
}

impl<C: RedisConnection> FlagStore for RedisFlagStore<C> {
    async fn look(&self, key: &BusinessKey) -> Result<Option<Fingerprint>, StoreError> {
        let marker: Option<String> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut self.connection.clone())
            .await?;
        Ok(match marker.as_deref().map(parse_marker).transpose()? {
            Some(Claim::Done(fingerprint)) => Some(fingerprint),
            Some(Claim::InFlight | Claim::Won) | None => None,
        })
    }

    async fn claim(&self, key: &BusinessKey, token: Token, lease: Duration) -> Result<Claim, StoreError> {
        let previous: Option<String> = redis::cmd("SET")
            .arg(self.redis_key(key))
            .arg(in_flight_marker(token))
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(millis(lease))
            .query_async(&mut self.connection.clone())
            .await?;
        previous.map_or(Ok(Claim::Won), |marker| parse_marker(&marker))
    }

    async fn complete(
        &self,
        key: &BusinessKey,
        token: Token,
        fingerprint: Fingerprint,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        COMPLETE
            .key(self.redis_key(key))
            .arg(in_flight_marker(token))
            .arg(done_marker(fingerprint))
            .arg(millis(retention))
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(StoreError::from)
    }

    async fn mark_done(
        &self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        retention: Duration,
    ) -> Result<(), StoreError> {
        redis::cmd("SET")
            .arg(self.redis_key(key))
            .arg(done_marker(fingerprint))
            .arg("PX")
            .arg(millis(retention))
            .query_async(&mut self.connection.clone())
            .await
            .map_err(StoreError::from)
    }

    async fn release(&self, key: &BusinessKey, token: Token) -> Result<bool, StoreError> {
        COMPARE_AND_DELETE
            .key(self.redis_key(key))
            .arg(in_flight_marker(token))
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(StoreError::from)
    }
}
