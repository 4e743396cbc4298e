//! The flag's and the lock's Redis steps of one delivery, two round trips instead of four:
//! the [joint tier](crate::flag_lock)'s backend. With coalescing, the steps of the
//! deliveries in flight at the same moment share one script call.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::{ErrorKind, RedisError, Script, ServerErrorKind};
use tokio::sync::{OnceCell, oneshot};

use super::flag::{IN_FLIGHT, LUA_COMPLETE, RedisFlagStore, done_marker, in_flight_marker, parse_marker};
use super::lock::{LUA_ACQUIRE, RedisLockStore};
use super::{LUA_COMPARE_AND_DELETE, RedisConnection, millis, script, tagged_key};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::flag::{Claim, FlagUpdate};
use crate::store::coalesce::{Batch, Coalescer, Waiter, answer_each, copy_error, still_waiting};
use crate::token::Token;

/// Lua: `claim_and_acquire(flag, lock, fence, claim, flag_lease, stops, token, lock_lease,
/// in_flight)` is the flag's claim, then the lock's acquire, as the two tiers would run
/// them one after the other: `claim` is the in-flight marker ('' to go on without a claim),
/// `stops` is '1' when a key in flight stops the delivery, `in_flight` the in-flight
/// marker prefix.
///
/// Answers whether the claim found a marker, the marker, and the fencing token (0 when
/// the lock was not taken). Where the flag stops the delivery the lock is not tried;
/// where the lock is busy the claim is not taken, which leaves Redis as the two tiers leave
/// it once the flag released its claim on the lock's busy answer.
const LUA_CLAIM_AND_ACQUIRE: &str = r"
local function claim_and_acquire(flag, lock, fence, claim, flag_lease, stops, token, lock_lease, in_flight)
    local previous = false
    if claim ~= '' then
        previous = redis.call('GET', flag)
        local is_in_flight = previous and string.sub(previous, 1, #in_flight) == in_flight
        if previous and (stops == '1' or not is_in_flight) then
            return {1, previous, 0}
        end
    end
    local found = previous and 1 or 0
    local fenced = acquire(lock, fence, token, lock_lease)
    if not fenced then
        return {found, previous or '', 0}
    end
    if claim ~= '' and not previous then
        redis.call('SET', flag, claim, 'PX', flag_lease)
    end
    return {found, previous or '', fenced}
end
";

/// Lua: `release_and_settle(flag, lock, token, update, claim, done, retention)` is the
/// lock's release, then the flag's `update` as if the lock was still held ('complete',
/// 'release', 'mark_done' or 'nothing') of the claim `claim`, with the done marker `done`.
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
    local updated = 1
    if update == 'complete' then
        updated = complete(flag, claim, done, retention)
    elseif update == 'release' then
        updated = compare_and_delete(flag, claim)
    elseif update == 'mark_done' then
        redis.call('SET', flag, done, 'PX', retention)
    end
    return {ours, updated, ''}
end
";

/// Lua: `failure(error)` is the text of an error `pcall` caught. Each delivery of a script
/// runs under `pcall`, so one delivery's error (a key of the wrong type) answers that
/// delivery only, not the others sharing the call.
const LUA_FAILURE: &str = r"
local function failure(error)
    if type(error) == 'table' then
        return error.err or 'script error'
    end
    return tostring(error)
end
";

/// Claim and acquire for each delivery. KEYS, per delivery: the flag, the lock, the fencing
/// counter. ARGV: the flag's lease, '1' when a key in flight stops the delivery, the lock's
/// lease, the in-flight marker prefix; then per delivery: the claim's marker, the lock's
/// token. Answers per delivery as `claim_and_acquire` does, or `{-1, error, 0}`.
static CLAIM_AND_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[LUA_ACQUIRE, LUA_CLAIM_AND_ACQUIRE, LUA_FAILURE],
        r"
        local answers = {}
        for i = 1, #KEYS / 3 do
            local k, a = 3 * i - 2, 2 * i + 3
            local ok, answer = pcall(claim_and_acquire, KEYS[k], KEYS[k + 1], KEYS[k + 2],
                ARGV[a], ARGV[1], ARGV[2], ARGV[a + 1], ARGV[3], ARGV[4])
            answers[i] = ok and answer or {-1, failure(answer), 0}
        end
        return answers
        ",
    )
});

/// Release and settle for each delivery. KEYS, per delivery: the flag, the lock. ARGV: the
/// retention; then per delivery: the lock's token, the flag's update, the claim's marker,
/// the done marker. Answers per delivery as `release_and_settle` does, or `{-1, 0, error}`.
static RELEASE_AND_SETTLE: LazyLock<Script> = LazyLock::new(|| {
    script(
        &[
            LUA_COMPARE_AND_DELETE,
            LUA_COMPLETE,
            LUA_RELEASE_AND_SETTLE,
            LUA_FAILURE,
        ],
        r"
        local answers = {}
        for i = 1, #KEYS / 2 do
            local k, a = 2 * i - 1, 4 * i - 2
            local ok, answer = pcall(release_and_settle, KEYS[k], KEYS[k + 1],
                ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[1])
            answers[i] = ok and answer or {-1, 0, failure(answer)}
        end
        return answers
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
    /// The entity to lock and the lock's token.
    pub(crate) entity: &'a str,
    pub(crate) lock_token: Token,
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

/// What the joint scripts take from the two tiers: the same for every delivery.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JointSettings {
    /// The flag claim's lease.
    pub(crate) flag_lease: Duration,
    /// Whether a key in flight stops the delivery (no record behind the flag).
    pub(crate) in_flight_stops: bool,
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
    claim: String,
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

/// The two scripts on one connection, over any number of deliveries.
struct Scripts<C> {
    connection: C,
    settings: JointSettings,
}

/// What the claim and acquire of one delivery found: whether a marker was there, the
/// marker, and the fencing token (0: the lock was not taken).
type Claimed = (bool, String, u64);

/// What the release and settle of one delivery found: whether the lock was ours, and
/// whether the flag's update found its claim.
type Settled = (bool, bool);

impl<C: RedisConnection> Scripts<C> {
    /// Answers each delivery, or the error it met; an error of the call fails every
    /// delivery.
    async fn claim_and_acquire(
        &self,
        deliveries: &[ClaimArgs],
    ) -> Result<Vec<Result<Claimed, StoreError>>, StoreError> {
        let settings = &self.settings;
        let mut invocation = CLAIM_AND_ACQUIRE.prepare_invoke();
        invocation
            .arg(millis(settings.flag_lease))
            .arg(if settings.in_flight_stops { "1" } else { "0" })
            .arg(millis(settings.lock_lease))
            .arg(IN_FLIGHT);
        for delivery in deliveries {
            invocation
                .key(&delivery.flag)
                .key(&delivery.lock)
                .key(&delivery.fence)
                .arg(&delivery.claim)
                .arg(&delivery.lock_token);
        }
        let answers: Vec<(i64, String, u64)> = invocation.invoke_async(&mut self.connection.clone()).await?;
        Ok(answers
            .into_iter()
            .map(|(found, previous, fence)| match found {
                // A delivery whose step failed: its marker field holds the error.
                -1 => Err(StoreError::new(previous)),
                _ => Ok((found == 1, previous, fence)),
            })
            .collect())
    }

    /// Answers each delivery, or the error it met; an error of the call fails every
    /// delivery.
    async fn release_and_settle(
        &self,
        deliveries: &[SettleArgs],
    ) -> Result<Vec<Result<Settled, StoreError>>, StoreError> {
        let mut invocation = RELEASE_AND_SETTLE.prepare_invoke();
        invocation.arg(millis(self.settings.retention));
        for delivery in deliveries {
            invocation
                .key(&delivery.flag)
                .key(&delivery.lock)
                .arg(&delivery.lock_token)
                .arg(delivery.update)
                .arg(&delivery.claim)
                .arg(&delivery.done);
        }
        let answers: Vec<(i64, i64, String)> = invocation.invoke_async(&mut self.connection.clone()).await?;
        Ok(answers
            .into_iter()
            .map(|(ours, updated, error)| match ours {
                -1 => Err(StoreError::new(error)),
                _ => Ok((ours == 1, updated == 1)),
            })
            .collect())
    }
}

/// Answers each of `replies` with its delivery's answer, or with the call's error.
fn answer_call<T>(
    replies: Vec<oneshot::Sender<Result<T, StoreError>>>,
    answers: Result<Vec<Result<T, StoreError>>, StoreError>,
) {
    match answers {
        Ok(answers) => answer_each(replies, answers),
        Err(error) => answer_each(replies, std::iter::repeat_with(|| Err(copy_error(&error)))),
    }
}

/// The claims of concurrent deliveries, in one script call.
struct Claims<C>(Arc<Scripts<C>>);

impl<C: RedisConnection> Batch for Claims<C> {
    type Request = ClaimArgs;
    type Answer = Claimed;

    async fn run(&self, waiters: Vec<Waiter<ClaimArgs, Claimed>>) {
        let (requests, replies): (Vec<_>, Vec<_>) = still_waiting(waiters).unzip();
        if !requests.is_empty() {
            answer_call(replies, self.0.claim_and_acquire(&requests).await);
        }
    }
}

/// The settles of concurrent deliveries, in one script call.
struct Settles<C>(Arc<Scripts<C>>);

impl<C: RedisConnection> Batch for Settles<C> {
    type Request = SettleArgs;
    type Answer = Settled;

    /// Every settle runs, its caller waiting or not: a claim and a lock left behind would
    /// hold their keys until their leases end.
    async fn run(&self, waiters: Vec<Waiter<SettleArgs, Settled>>) {
        let (requests, replies): (Vec<_>, Vec<_>) = waiters.into_iter().unzip();
        answer_call(replies, self.0.release_and_settle(&requests).await);
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
    scripts: Arc<Scripts<C>>,
    coalesced: Option<(Coalescer<ClaimArgs, Claimed>, Coalescer<SettleArgs, Settled>)>,
    fuses: Arc<OnceCell<bool>>,
}

impl<C: RedisConnection> RedisFlagLock<C> {
    /// The joint store of `flags` and `locks`, which must be on one Redis: the joint
    /// scripts run on the flag store's connection.
    pub(crate) fn new(flags: RedisFlagStore<C>, locks: RedisLockStore<C>, settings: JointSettings) -> Self {
        RedisFlagLock {
            scripts: Arc::new(Scripts {
                connection: flags.connection.clone(),
                settings,
            }),
            flags,
            locks,
            coalesced: None,
            fuses: Arc::default(),
        }
    }

    /// Runs the steps of concurrent deliveries together, up to `max_deliveries` per script
    /// call and `max_calls` calls of each script on the wire at once (see
    /// [`Coalescer::spawn`]). Starts two tasks on the current Tokio runtime.
    pub(crate) fn coalesced(mut self, max_deliveries: usize, max_calls: usize) -> Self {
        self.coalesced = Some((
            Coalescer::spawn(Claims(self.scripts.clone()), max_deliveries, max_calls),
            Coalescer::spawn(Settles(self.scripts.clone()), max_deliveries, max_calls),
        ));
        self
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
        let args = ClaimArgs {
            flag: self.flags.redis_key(ask.key),
            lock: self.locks.redis_key(ask.entity),
            fence: self.locks.fence_key(ask.entity),
            claim: ask.claim.map(in_flight_marker).unwrap_or_default(),
            lock_token: ask.lock_token.to_string(),
        };
        let (found, previous, fence) = match &self.coalesced {
            Some((claims, _)) => claims.ask(args).await?,
            None => alone(self.scripts.claim_and_acquire(&[args]).await)?,
        };
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
    ) -> Result<(bool, bool), StoreError> {
        let (update, claim) = match update {
            FlagUpdate::Complete(token) => ("complete", in_flight_marker(token)),
            FlagUpdate::Release(token) => ("release", in_flight_marker(token)),
            FlagUpdate::MarkDone => ("mark_done", String::new()),
            FlagUpdate::Nothing => ("nothing", String::new()),
        };
        let args = SettleArgs {
            flag: self.flags.redis_key(key),
            lock: self.locks.redis_key(entity),
            lock_token: lock_token.to_string(),
            update,
            claim,
            done: done_marker(fingerprint),
        };
        match &self.coalesced {
            Some((_, settles)) => settles.ask(args).await,
            None => alone(self.scripts.release_and_settle(&[args]).await),
        }
    }
}

/// The answer of a script called for one delivery.
fn alone<T>(answers: Result<Vec<Result<T, StoreError>>, StoreError>) -> Result<T, StoreError> {
    answers?
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(StoreError::malformed("a joint script answered no delivery")))
}

impl<C: Clone> Clone for RedisFlagLock<C> {
    fn clone(&self) -> Self {
        RedisFlagLock {
            flags: self.flags.clone(),
            locks: self.locks.clone(),
            scripts: self.scripts.clone(),
            coalesced: self.coalesced.clone(),
            fuses: self.fuses.clone(),
        }
    }
}
