//! Redis: the flag marker and the lock of `inspect`, read with the library's own key names
//! ([`RedisFlagStore::inspect`], [`RedisLockStore::inspect`]).

use std::time::Duration;

use oncely::BusinessKey;
use oncely::flag::{FlagState, FlagView, RedisFlagStore};
use oncely::lock::{LockView, RedisLockStore};
use oncely::redis::AsyncConnectionConfig;
use oncely::redis::aio::MultiplexedConnection;
use serde::Serialize;

use crate::Globals;
use crate::error::{CliError, Remote};
use crate::output::rounded;

/// The flag and lock stores of `--redis-url` and `--redis-prefix`.
pub(crate) struct RedisStores {
    flag: RedisFlagStore<MultiplexedConnection>,
    lock: RedisLockStore<MultiplexedConnection>,
    remote: Remote,
}

impl RedisStores {
    /// Connects to `url` within `--timeout`; every command is bounded by it too.
    pub(crate) async fn connect(globals: &Globals, url: &str) -> Result<Self, CliError> {
        let remote = Remote::new("Redis", url, globals.timeout);
        let client = oncely::tls::redis::client(url, &globals.tls()?).map_err(|error| match error {
            oncely::tls::redis::RedisTlsError::Settings(settings) => CliError::Tls(settings),
            other => remote.failed(other),
        })?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(remote.backstop()))
            .set_response_timeout(Some(remote.backstop()));
        let connection = remote
            .call(client.get_multiplexed_async_connection_with_config(&config))
            .await?;
        let prefix = globals.redis_prefix();
        Ok(RedisStores {
            flag: RedisFlagStore::new(connection.clone()).with_prefix(prefix),
            lock: RedisLockStore::new(connection).with_prefix(prefix),
            remote,
        })
    }

    /// `key`'s flag marker.
    pub(crate) async fn flag(&self, key: &str) -> Result<FlagReport, CliError> {
        let view = self
            .remote
            .call(self.flag.inspect(&BusinessKey::new(key)))
            .await?;
        Ok(FlagReport::from(view))
    }

    /// `entity`'s lock.
    pub(crate) async fn lock(&self, entity: &str) -> Result<LockReport, CliError> {
        let view = self.remote.call(self.lock.inspect(entity)).await?;
        Ok(LockReport::from(view))
    }
}

/// A flag marker in a report.
#[derive(Debug, Serialize)]
pub(crate) struct FlagReport {
    redis_key: String,
    /// `absent`, `in-flight` or `done`.
    pub(crate) state: &'static str,
    fingerprint: Option<String>,
    ttl_ms: Option<u64>,
}

impl From<FlagView> for FlagReport {
    fn from(view: FlagView) -> Self {
        let (state, fingerprint) = match view.state {
            FlagState::Absent => ("absent", None),
            FlagState::InFlight => ("in-flight", None),
            FlagState::Done { fingerprint } => ("done", Some(fingerprint.to_string())),
            // A state this tool does not know yet.
            _ => ("unknown", None),
        };
        FlagReport {
            redis_key: view.redis_key,
            state,
            fingerprint,
            ttl_ms: view.ttl.map(millis),
        }
    }
}

impl FlagReport {
    /// The marker's fields, for `inspect`.
    pub(crate) fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("redis key", self.redis_key.clone()),
            ("marker", self.state.to_owned()),
            (
                "fingerprint",
                self.fingerprint.clone().unwrap_or_else(|| "-".into()),
            ),
            ("expires in", ttl(self.ttl_ms)),
        ]
    }
}

/// A lock in a report.
#[derive(Debug, Serialize)]
pub(crate) struct LockReport {
    redis_key: String,
    holder: Option<String>,
    ttl_ms: Option<u64>,
    fencing_counter: Option<u64>,
}

impl From<LockView> for LockReport {
    fn from(view: LockView) -> Self {
        LockReport {
            redis_key: view.redis_key,
            holder: view.holder,
            ttl_ms: view.ttl.map(millis),
            fencing_counter: view.fencing_counter,
        }
    }
}

impl LockReport {
    /// The lock's fields, for `inspect`.
    pub(crate) fn fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("redis key", self.redis_key.clone()),
            (
                "holder",
                self.holder.clone().unwrap_or_else(|| "none (free)".into()),
            ),
            ("lease left", ttl(self.ttl_ms)),
            (
                "fencing counter",
                self.fencing_counter
                    .map_or("-".into(), |counter| counter.to_string()),
            ),
        ]
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn ttl(ms: Option<u64>) -> String {
    ms.map_or_else(|| "-".into(), |ms| rounded(Duration::from_millis(ms)))
}
