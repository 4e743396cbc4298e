//! The flag's and the lock's Redis steps of one delivery, two round trips instead of four:
//! the [joint tier](crate::flag_lock)'s backend. With coalescing, the steps of the
//! deliveries in flight at the same moment share one script call.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::{ErrorKind, RedisError, Script, ScriptInvocation, ServerErrorKind};
use tokio::sync::OnceCell;

use super::flag::{
    IN_FLIGHT, LUA_COMPLETE, LUA_SETTLE, RedisFlagStore, done_marker, in_flight_marker, parse_marker,
    settle_args,
};
use super::lock::{LUA_ACQUIRE, RedisLockStore};
use super::steps::{Runner, Step, per_delivery_script};
use super::{LUA_COMPARE_AND_DELETE, RedisConnection, millis, tagged_key};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::flag::{FlagAsk, FlagUpdate, Found};
use crate::token::Token;

/// Lua: `claim_and_acquire(flag, lock, fence, ask, flag_lease, token, lock_lease,
/// in_flight, look)` is the flag's claim or look, then the lock's acquire, as the two tiers
/// would run them one after the other: `ask` is the in-flight marker to claim the flag
/// with, `look` ([`LOOK`]) to read it without claiming, or '' to go on without the flag;
/// `in_flight` is the in-flight marker prefix.
///
/// Answers whether the flag found a marker, the marker, and the fencing token (0 when the
/// lock was not taken). Where the flag stops the delivery the lock is not tried; where the
/// lock is busy the claim is not taken, which leaves Redis as the two tiers leave it once
/// the flag released its claim on the lock's busy answer.
const LUA_CLAIM_AND_ACQUIRE: &str = r"
local function claim_and_acquire(flag, lock, fence, ask, flag_lease, token, lock_lease, in_flight, look)
    local previous = false
    if ask ~= '' then
        previous = redis.call('GET', flag)
        local passes = ask == look and previous and string.sub(previous, 1, #in_flight) == in_flight
        if previous and not passes then
            return {1, previous, 0}
        end
    end
    local found = previous and 1 or 0
    local fenced = acquire(lock, fence, token, lock_lease)
    if not fenced then
        return {found, previous or '', 0}
    end
    if ask ~= '' and ask ~= look then
        redis.call('SET', flag, ask, 'PX', flag_lease)
    end
    return {found, previous or '', fenced}
end
";

/// The `ask` of [`LUA_CLAIM_AND_ACQUIRE`] that reads the flag without claiming it: no
/// in-flight marker starts with it.
const LOOK: &str = "?";

/// Lua: `release_and_settle(flag, lock, token, update, claim, done, retention)` is the
/// lock's release, then the flag's `settle` as if the lock was still held.
///
/// A lock that is no longer ours turns the outcome into a retry (a lost lease), so the flag
/// then settles as for a retry: its claim is released and nothing is marked done. Answers
/// whether the lock was ours and whether the flag's update found its claim.
const LUA_RELEASE_AND_SETTLE: &str = r"
local function release_and_settle(flag, lock, token, update, claim, done, retention)
    local ours = compare_and_delete(lock, token)
    if ours == 0 and update == 'complete' then
        update = 'release'
    elseif ours == 0 and update == 'mark_done' then
        update = 'nothing'
    end
    return {ours, settle(flag, update, claim, done, retention)}
end
";

/// Claim and acquire for each delivery. KEYS, per delivery: the flag, the lock, the fencing
/// counter. ARGV: the flag's lease, the lock's lease, the in-flight marker prefix, [`LOOK`];
/// then per delivery: the flag's ask, the lock's token.
static CLAIM_AND_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    per_delivery_script(
        &[LUA_ACQUIRE, LUA_CLAIM_AND_ACQUIRE],
        3,
        4,
        2,
        "claim_and_acquire, KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], \
         ARGV[a + 1], ARGV[1], ARGV[a + 2], ARGV[2], ARGV[3], ARGV[4]",
    )
});

/// Release and settle for each delivery. KEYS, per delivery: the flag, the lock. ARGV: the
/// retention; then per delivery: the lock's token, the flag's update, the claim's marker,
/// the done marker.
static RELEASE_AND_SETTLE: LazyLock<Script> = LazyLock::new(|| {
    per_delivery_script(
        &[
            LUA_COMPARE_AND_DELETE,
            LUA_COMPLETE,
            LUA_SETTLE,
            LUA_RELEASE_AND_SETTLE,
        ],
        2,
        1,
        4,
        "release_and_settle, KEYS[k + 1], KEYS[k + 2], \
         ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[1]",
    )
});

/// What [`RedisFlagLock::claim_and_acquire`] asks for.
#[derive(Debug)]
pub(crate) struct JointClaim<'a> {
    /// The business key whose marker the flag reads.
    pub(crate) key: &'a BusinessKey,
    /// What the flag asks.
    pub(crate) flag: FlagAsk,
    /// The entity to lock and the lock's token.
    pub(crate) entity: &'a str,
    pub(crate) lock_token: Token,
}

/// What [`RedisFlagLock::claim_and_acquire`] found.
#[derive(Debug)]
pub(crate) struct JointFound {
    /// What the flag found; an error when the marker is not one oncely writes.
    pub(crate) flag: Result<Found, StoreError>,
    /// The fencing token, when the lock was taken: not when it is busy, nor when the flag
    /// stopped the delivery or found a marker it cannot read.
    pub(crate) fence: Option<u64>,
}

/// What the joint scripts take from the two tiers: the same for every delivery.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JointSettings {
    /// The flag claim's lease.
    pub(crate) flag_lease: Duration,
    /// The lock's lease.
    pub(crate) lock_lease: Duration,
    /// How long the flag's done marker stays.
    pub(crate) retention: Duration,
}

/// One delivery's claim and acquire, as the script takes it: keys and arguments.
struct ClaimArgs {
    flag: String,
    lock: String,
    fence: String,
    ask: String,
    lock_token: String,
}

/// One delivery's release and settle, as the script takes it.
struct SettleArgs {
    flag: String,
    lock: String,
    lock_token: String,
    update: &'static str,
    claim: String,
    done: String,
}

/// What the claim and acquire of one delivery found: whether a marker was there, the
/// marker, and the fencing token (0: the lock was not taken).
type Claimed = (bool, String, u64);

/// What the release and settle of one delivery found: whether the lock was ours, and
/// whether the flag's update found its claim.
type Settled = (bool, bool);

/// The claim and acquire of deliveries, with the two tiers' settings.
struct Claims(JointSettings);

impl Step for Claims {
    type Request = ClaimArgs;
    type Answer = Claimed;
    const RUNS_ABANDONED: bool = false;

    fn script(&self) -> &'static Script {
        &CLAIM_AND_ACQUIRE
    }

    fn add_shared(&self, invocation: &mut ScriptInvocation<'_>) {
        let settings = &self.0;
        invocation
            .arg(millis(settings.flag_lease))
            .arg(millis(settings.lock_lease))
            .arg(IN_FLIGHT)
            .arg(LOOK);
    }

    fn add(&self, invocation: &mut ScriptInvocation<'_>, delivery: &ClaimArgs) {
        invocation
            .key(&delivery.flag)
            .key(&delivery.lock)
            .key(&delivery.fence)
            .arg(&delivery.ask)
            .arg(&delivery.lock_token);
    }
}

/// The release and settle of deliveries, with the flag's retention.
struct Settles(Duration);

impl Step for Settles {
    type Request = SettleArgs;
    type Answer = Settled;
    const RUNS_ABANDONED: bool = true;

    fn script(&self) -> &'static Script {
        &RELEASE_AND_SETTLE
    }

    fn add_shared(&self, invocation: &mut ScriptInvocation<'_>) {
        invocation.arg(millis(self.0));
    }

    fn add(&self, invocation: &mut ScriptInvocation<'_>, delivery: &SettleArgs) {
        invocation
            .key(&delivery.flag)
            .key(&delivery.lock)
            .arg(&delivery.lock_token)
            .arg(delivery.update)
            .arg(&delivery.claim)
            .arg(&delivery.done);
    }
}

/// The flag and lock stores of one Redis, run together: each step of the two tiers that
/// can share a round trip does, and with [coalescing](RedisFlagLock::coalesced) the steps
/// of concurrent deliveries share one script call.
///
/// A joint script touches the flag's key and the lock's keys at once. On Redis Cluster
/// those are in different slots (their hash tags are the business key and the entity), and
/// Redis would refuse the script (`CROSSSLOT`): [`fuses`](RedisFlagLock::fuses) finds out
/// once, before the first delivery, and the tier then runs the flag and the lock one after
/// the other.
pub(crate) struct RedisFlagLock<C> {
    pub(crate) flags: RedisFlagStore<C>,
    pub(crate) locks: RedisLockStore<C>,
    claims: Runner<Claims, C>,
    settles: Runner<Settles, C>,
    fuses: Arc<OnceCell<bool>>,
}

impl<C: RedisConnection> RedisFlagLock<C> {
    /// The joint store of `flags` and `locks`, which must be on one Redis: the joint
    /// scripts run on the flag store's connection.
    pub(crate) fn new(flags: RedisFlagStore<C>, locks: RedisLockStore<C>, settings: JointSettings) -> Self {
        RedisFlagLock {
            claims: Runner::new(Claims(settings), flags.connection.clone()),
            settles: Runner::new(Settles(settings.retention), flags.connection.clone()),
            flags,
            locks,
            fuses: Arc::default(),
        }
    }

    /// Runs the steps of concurrent deliveries together, up to `max_deliveries` per script
    /// call and `max_calls` calls of each script on the wire at once (see
    /// [`Coalescer::spawn`](crate::store::coalesce::Coalescer::spawn)). Starts two tasks on
    /// the current Tokio runtime.
    pub(crate) fn coalesced(self, max_deliveries: usize, max_calls: usize) -> Self {
        RedisFlagLock {
            claims: self.claims.coalesced(max_deliveries, max_calls),
            settles: self.settles.coalesced(max_deliveries, max_calls),
            ..self
        }
    }

    /// Whether Redis takes a script over keys of two slots: false on Redis Cluster. Asked
    /// once, with a script that touches nothing (the first callers wait for its answer);
    /// an error (Redis down) is asked again by the next caller.
    pub(crate) async fn fuses(&self) -> Result<bool, StoreError> {
        let ask = || async {
            let answer: Result<i64, RedisError> = redis::cmd("EVAL")
                .arg("return 1")
                .arg(2)
                .arg(tagged_key(&self.flags.prefix, "probe", "a"))
                .arg(tagged_key(&self.flags.prefix, "probe", "b"))
                .query_async(&mut self.flags.connection.clone())
                .await;
            match answer {
                Ok(_) => Ok(true),
                Err(error) if matches!(error.kind(), ErrorKind::Server(ServerErrorKind::CrossSlot)) => {
                    tracing::info!(
                        "Redis Cluster: the flag and the lock run one after the other, not in joint scripts"
                    );
                    Ok(false)
                }
                Err(error) => Err(StoreError::from(error)),
            }
        };
        self.fuses.get_or_try_init(ask).await.copied()
    }

    /// The flag's claim or look, as asked, and the lock's acquire where the flag lets the
    /// delivery on.
    pub(crate) async fn claim_and_acquire(&self, ask: JointClaim<'_>) -> Result<JointFound, StoreError> {
        let args = ClaimArgs {
            flag: self.flags.redis_key(ask.key),
            lock: self.locks.redis_key(ask.entity),
            fence: self.locks.fence_key(ask.entity),
            ask: match ask.flag {
                FlagAsk::Skip => String::new(),
                FlagAsk::Look => LOOK.to_owned(),
                FlagAsk::Claim(token) => in_flight_marker(token),
            },
            lock_token: ask.lock_token.to_string(),
        };
        let (found, previous, fence) = self.claims.run(args).await?;
        let marker = found.then(|| parse_marker(&previous)).transpose();
        Ok(JointFound {
            flag: marker.map(|marker| ask.flag.found(marker)),
            fence: (fence != 0).then_some(fence),
        })
    }

    /// The lock's release and the flag's `update` of `key`: whether the lock was still ours,
    /// and whether the update found its claim.
    pub(crate) async fn release_and_settle(
        &self,
        entity: &str,
        lock_token: Token,
        key: &BusinessKey,
        update: FlagUpdate,
        fingerprint: Fingerprint,
    ) -> Result<(bool, bool), StoreError> {
        let (update, claim) = settle_args(update);
        let args = SettleArgs {
            flag: self.flags.redis_key(key),
            lock: self.locks.redis_key(entity),
            lock_token: lock_token.to_string(),
            update,
            claim,
            done: done_marker(fingerprint),
        };
        self.settles.run(args).await
    }
}

impl<C: Clone> Clone for RedisFlagLock<C> {
    fn clone(&self) -> Self {
        RedisFlagLock {
            flags: self.flags.clone(),
            locks: self.locks.clone(),
            claims: self.claims.clone(),
            settles: self.settles.clone(),
            fuses: self.fuses.clone(),
        }
    }
}
