use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;

use crate::envelope::{BusinessKey, Envelope};
use crate::error::StoreError;
use crate::flag::{FlagLayer, FlagTicket, Found, RedisFlagStore};
use crate::lock::{LockLayer, LockStore, LockTicket, RedisLockStore};
use crate::outcome::Outcome;
use crate::store::redis::RedisConnection;
use crate::store::redis::flag_lock::{JointClaim, RedisFlagLock};
use crate::tier::{Enter, FailurePolicy, Tier, TierDecision};
use crate::token::Token;

/// The joint tier's decision: the flag's and the lock's, two round trips per delivery.
pub(super) struct Joint<C> {
    pub(super) flag: FlagLayer<RedisFlagStore<C>>,
    pub(super) lock: Arc<LockLayer<RedisLockStore<C>>>,
    pub(super) store: RedisFlagLock<C>,
}

impl<C: Clone> Clone for Joint<C> {
    fn clone(&self) -> Self {
        Joint {
            flag: self.flag.clone(),
            lock: self.lock.clone(),
            store: self.store.clone(),
        }
    }
}

/// What the joint tier holds for one envelope: the flag's ticket and the lock's.
#[derive(Debug)]
pub(super) struct FlagLockTicket {
    flag: FlagTicket,
    lock: LockTicket,
}

impl<C: RedisConnection> Joint<C> {
    /// A delivery without an entity: the lock answers a dead letter, after the flag in
    /// front of it decided, as the two tiers one after the other would.
    async fn flag_alone(
        &self,
        envelope: &mut Envelope,
        dead_letter: Outcome,
    ) -> Result<Enter<FlagLockTicket>, StoreError> {
        let ticket = match self.flag.enter(envelope).await {
            Ok(Enter::Proceed(ticket)) => ticket,
            Ok(Enter::Stop(outcome)) => return Ok(Enter::Stop(outcome)),
            Err(error) => {
                self.flag_failed(envelope.key(), error)?;
                return Ok(Enter::Stop(dead_letter));
            }
        };
        Ok(Enter::Stop(self.flag.exit(ticket, dead_letter).await?))
    }

    /// A flag marker oncely did not write: the flag's store failed, so the delivery goes on
    /// to the lock without a claim where the flag fails open (the script stopped before the
    /// lock), as the two tiers would; the lock's fencing token, `None` when it is busy.
    async fn without_the_flag(
        &self,
        key: &BusinessKey,
        malformed: StoreError,
        entity: &str,
        lock_token: Token,
    ) -> Result<Option<u64>, StoreError> {
        self.flag_failed(key, malformed)?;
        self.lock.store.acquire(entity, lock_token, self.lock.lease).await
    }

    /// The flag's store failed for `key`: `Ok` where the flag fails open (logged, as a tier
    /// failing open is), the error where it fails closed.
    fn flag_failed(&self, key: &BusinessKey, error: StoreError) -> Result<(), StoreError> {
        match self.flag.failure_policy {
            FailurePolicy::FailOpen => {
                tracing::warn!(tier = %Tier::Flag, %key, %error, "store failed; passing to the tiers behind");
                Ok(())
            }
            FailurePolicy::FailClosed => Err(error),
        }
    }
}

impl<C: RedisConnection> TierDecision for Joint<C> {
    type Ticket = FlagLockTicket;
    const TIER: Tier = Tier::FlagLock;

    /// One script fails both steps: closed if either tier is.
    fn failure_policy(&self) -> FailurePolicy {
        match (self.flag.failure_policy, self.lock.failure_policy) {
            (FailurePolicy::FailOpen, FailurePolicy::FailOpen) => FailurePolicy::FailOpen,
            _ => FailurePolicy::FailClosed,
        }
    }

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<FlagLockTicket>, StoreError> {
        let entity = match self.lock.entity_of(envelope) {
            Ok(entity) => entity,
            Err(dead_letter) => return self.flag_alone(envelope, dead_letter).await,
        };
        let ask = self.flag.ask(envelope);
        let (lock_token, asked_at) = (Token::random(), Instant::now());
        let found = (self.store)
            .claim_and_acquire(JointClaim {
                key: envelope.key(),
                flag: ask,
                entity: &entity,
                lock_token,
            })
            .await?;
        let (found, fence) = match found.flag {
            Ok(flag) => (flag, found.fence),
            Err(malformed) => (
                Found::Nothing,
                self.without_the_flag(envelope.key(), malformed, &entity, lock_token)
                    .await?,
            ),
        };
        let flag = match self.flag.decide(envelope, found) {
            Enter::Proceed(flag) => flag,
            Enter::Stop(outcome) => {
                // The script tries the lock only where the flag lets the delivery on.
                debug_assert!(fence.is_none(), "the lock was taken for a stopped delivery");
                return Ok(Enter::Stop(outcome));
            }
        };
        // Where the lock is busy the script took no claim: there is nothing to release.
        Ok(match fence {
            Some(fence) => Enter::Proceed(FlagLockTicket {
                flag,
                lock: self.lock.hold(envelope, entity, (lock_token, asked_at), fence),
            }),
            None => Enter::Stop(self.lock.busy(&entity)),
        })
    }

    fn keep_alive(&self, ticket: &FlagLockTicket) -> impl Future<Output = ()> + Send {
        self.lock.renew_while_held(&ticket.lock)
    }

    async fn exit(&self, ticket: FlagLockTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let FlagLockTicket { flag, lock } = ticket;
        // The watchdog stopped when the tiers behind answered. The script settles the flag
        // as for a retry when it finds the lock no longer ours.
        let lost = lock.lease.is_lost();
        let update = flag.update(outcome.is_settled() && !lost);
        let answered = (self.store)
            .release_and_settle(&lock.entity, lock.token, &flag.key, update, flag.fingerprint)
            .await;
        let (released, updated) = match &answered {
            Ok((ours, updated)) => (Ok(*ours), Ok(*updated)),
            Err(error) => (Err(error), Err(error)),
        };
        let outcome = lock.settle(lost, released, outcome);
        self.flag
            .report(&flag.key, flag.update(outcome.is_settled()), updated);
        Ok(outcome)
    }
}
