//! The flag's and the lock's Redis steps of one delivery, two round trips instead of four:
//! the [joint tier](crate::flag_lock)'s backend.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use tokio::sync::OnceCell;

use super::flag::{IN_FLIGHT, LUA_COMPLETE, RedisFlagStore, done_marker, in_flight_marker, parse_marker};
use super::lock::{LUA_ACQUIRE, RedisLockStore};
use super::{LUA_COMPARE_AND_DELETE, RedisConnection, millis, script, tagged_key};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::flag::{Claim, FlagUpdate};
use crate::token::Token;

/// The flag's claim, then the lock's acquire, as the two tiers would run them one after
/// the other, in one step. KEYS: the flag, the lock, the fencing counter. ARGV: the claim's
/// in-flight marker ('' to go on without a claim), the flag's lease, '1' when a key in
/// flight stops the delivery, the lock's token and lease, the in-flight marker prefix.
///
/// Answers whether the claim found a marker, the marker, and the fencing token (0 when
/// the lock was not taken). Where the flag stops the delivery the lock is not tried;
/// where the lock is busy the claim is not taken, which leaves Redis as the two tiers leave
/// it once the flag released its claim on the lock's busy answer.
static CLAIM_AND_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[LUA_ACQUIRE],
        r"
        local claim, previous = ARGV[1], false
        if claim ~= '' then
            previous = redis.call('GET', KEYS[1])
            local in_flight = previous and string.sub(previous, 1, #ARGV[6]) == ARGV[6]
            if previous and (ARGV[3] == '1' or not in_flight) then
                return {1, previous, 0}
            end
        end
        local found = previous and 1 or 0
        local fence = acquire(KEYS[2], KEYS[3], ARGV[4], ARGV[5])
        if not fence then
            return {found, previous or '', 0}
        end
        if claim ~= '' and not previous then
            redis.call('SET', KEYS[1], claim, 'PX', ARGV[2])
        end
        return {found, previous or '', fence}
        ",
    )
});

/// The lock's release, then the flag's update, in one step. KEYS: the flag, the lock.
/// ARGV: the lock's token, the flag's update as if the lock was still held ('complete',
/// 'release', 'mark_done' or 'nothing'), the claim's in-flight marker, the done marker, the
/// retention.
///
/// A lock that is no longer ours turns the outcome into a retry (a lost lease), so the flag
/// then settles as for a retry: its claim is released and nothing is marked done. Answers
/// whether the lock was ours and whether the flag's update found its claim.
static RELEASE_AND_SETTLE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[LUA_COMPARE_AND_DELETE, LUA_COMPLETE],
        r"
        local ours = compare_and_delete(KEYS[2], ARGV[1])
        local update = ARGV[2]
        if ours == 0 and update == 'complete' then
            update = 'release'
        elseif ours == 0 and update == 'mark_done' then
            update = 'nothing'
        end
        local updated = 1
        if update == 'complete' then
            updated = complete(KEYS[1], ARGV[3], ARGV[4], ARGV[5])
        elseif update == 'release' then
            updated = compare_and_delete(KEYS[1], ARGV[3])
        elseif update == 'mark_done' then
            redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
        end
        return {ours, updated}
        ",
    )
});

/// What [`RedisFlagLock::claim_and_acquire`] asks for.
#[derive(Debug)]
pub(crate) struct JointClaim<'a> {
    /// The business key whose marker the flag reads.
    pub(crate) key: &'a BusinessKey,
    /// The claim's token; `None` to go on without a claim.
    pub(crate) claim: Option<Token>,
    /// The flag claim's lease.
    pub(crate) flag_lease: Duration,
    /// Whether a key in flight stops the delivery (no record behind the flag).
    pub(crate) in_flight_stops: bool,
    /// The entity to lock, the lock's token and its lease.
    pub(crate) entity: &'a str,
    pub(crate) lock_token: Token,
    pub(crate) lock_lease: Duration,
}

/// What [`RedisFlagLock::claim_and_acquire`] found.
#[derive(Debug)]
pub(crate) struct JointFound {
    /// The marker the claim found, as the claim would answer; `None` when no claim was
    /// asked, an error when the marker is not one oncely writes.
    pub(crate) claim: Option<Result<Claim, StoreError>>,
    /// The fencing token, when the lock was taken: not when it is busy, nor when the flag
    /// stopped the delivery or found a marker it cannot read.
    pub(crate) fence: Option<u64>,
}

/// The flag and lock stores of one Redis, run together: each step of the two tiers that
/// can share a round trip does.
///
/// A joint script touches the flag's key and the lock's keys at once. On Redis Cluster
/// those are in different slots (their hash tags are the business key and the entity), and
/// Redis would refuse the script (`CROSSSLOT`): [`fuses`](RedisFlagLock::fuses) finds out
/// once, before the first delivery, and the tier then runs the flag and the lock one after
/// the other.
pub(crate) struct RedisFlagLock<C> {
    pub(crate) flags: RedisFlagStore<C>,
    pub(crate) locks: RedisLockStore<C>,
    fuses: Arc<OnceCell<bool>>,
}

impl<C: RedisConnection> RedisFlagLock<C> {
    /// The joint store of `flags` and `locks`, which must be on one Redis: the joint
    /// scripts run on the flag store's connection.
    pub(crate) fn new(flags: RedisFlagStore<C>, locks: RedisLockStore<C>) -> Self {
        RedisFlagLock {
            flags,
            locks,
            fuses: Arc::default(),
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

    /// The claim, if one is asked, and the lock's acquire where the flag lets the delivery
    /// on.
    pub(crate) async fn claim_and_acquire(&self, ask: JointClaim<'_>) -> Result<JointFound, StoreError> {
        let marker = ask.claim.map(in_flight_marker);
        let (found, previous, fence): (bool, String, u64) = CLAIM_AND_ACQUIRE
            .key(self.flags.redis_key(ask.key))
            .key(self.locks.redis_key(ask.entity))
            .key(self.locks.fence_key(ask.entity))
            .arg(marker.as_deref().unwrap_or(""))
            .arg(millis(ask.flag_lease))
            .arg(if ask.in_flight_stops { "1" } else { "0" })
            .arg(ask.lock_token.to_string())
            .arg(millis(ask.lock_lease))
            .arg(IN_FLIGHT)
            .invoke_async(&mut self.flags.connection.clone())
            .await?;
        let claim = match (ask.claim, found) {
            (None, _) => None,
            (Some(_), false) => Some(Ok(Claim::Won)),
            (Some(_), true) => Some(parse_marker(&previous)),
        };
        Ok(JointFound {
            claim,
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
        retention: Duration,
    ) -> Result<(bool, bool), StoreError> {
        let (update, claim) = match update {
            FlagUpdate::Complete(token) => ("complete", in_flight_marker(token)),
            FlagUpdate::Release(token) => ("release", in_flight_marker(token)),
            FlagUpdate::MarkDone => ("mark_done", String::new()),
            FlagUpdate::Nothing => ("nothing", String::new()),
        };
        RELEASE_AND_SETTLE
            .key(self.flags.redis_key(key))
            .key(self.locks.redis_key(entity))
            .arg(lock_token.to_string())
            .arg(update)
            .arg(claim)
            .arg(done_marker(fingerprint))
            .arg(millis(retention))
            .invoke_async(&mut self.flags.connection.clone())
            .await
            .map_err(StoreError::from)
    }
}

impl<C: Clone> Clone for RedisFlagLock<C> {
    fn clone(&self) -> Self {
        RedisFlagLock {
            flags: self.flags.clone(),
            locks: self.locks.clone(),
            fuses: self.fuses.clone(),
        }
    }
}
