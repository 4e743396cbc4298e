use std::future::Future;

use tokio::time::Instant;

use super::layer::LockLayer;
use super::lease::LockLease;
use super::store::LockStore;
use crate::dead_letter::DeadLetterReason;
use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::outcome::{Outcome, RetryReason};
use crate::tier::{Enter, FailurePolicy, Tier, TierDecision};
use crate::token::Token;

/// What the lock tier holds for one envelope: the lock and its lease, which the watchdog
/// renews while the tiers behind run ([`TierDecision::keep_alive`]). Dropped without being
/// settled (the stack's future was dropped), the lock expires with its lease.
#[derive(Debug)]
pub struct LockTicket {
    pub(crate) entity: String,
    pub(crate) token: Token,
    pub(crate) lease: LockLease,
    /// When the acquire was sent: the lease started somewhere after.
    asked_at: Instant,
}

impl<St: LockStore> LockLayer<St> {
    /// The entity `envelope` locks, or the dead letter when it has none.
    pub(crate) fn entity_of(&self, envelope: &Envelope) -> Result<String, Outcome> {
        match self.entity.extract(envelope.delivery()) {
            Ok(entity) => Ok(entity.to_string()),
            Err(error) => Err(Outcome::dead_letter(
                DeadLetterReason::InvalidKey,
                format!("lock entity: {error}"),
            )),
        }
    }

    /// The answer when another delivery holds `entity`'s lock.
    pub(crate) fn busy(&self, entity: &str) -> Outcome {
        Outcome::retry_later(
            RetryReason::LockBusy,
            format!("entity {entity} is locked by another delivery"),
            Some(self.busy_delay),
        )
    }

    /// The ticket of `entity`'s lock, acquired under `token` with `fencing_token` by an
    /// acquire sent at `asked_at`: hands the lease to the tiers behind.
    pub(crate) fn hold(
        &self,
        envelope: &mut Envelope,
        entity: String,
        (token, asked_at): (Token, Instant),
        fencing_token: u64,
    ) -> LockTicket {
        let lease = LockLease::new(fencing_token);
        envelope.extensions_mut().insert(lease.clone());
        LockTicket {
            entity,
            token,
            lease,
            asked_at,
        }
    }

    /// The watchdog: renews `ticket`'s lease every `renew_every` until dropped (the tiers
    /// behind answered, so the lock is about to be released). Ends when it marks the lease
    /// lost: when the store says the lock is no longer ours, when renewals kept failing
    /// until the lease could have run out, or when a renewal is still unanswered then.
    ///
    /// It runs in the task that runs the delivery, beside the tiers behind, rather than in a
    /// task of its own, which would cost a spawn, a wake-up and an abort per delivery. So a
    /// handler that blocks its thread without awaiting stalls its renewals with it.
    pub(crate) async fn renew_while_held(&self, ticket: &LockTicket) {
        let LockTicket {
            entity,
            token,
            lease,
            asked_at,
        } = ticket;
        // Counted from before the acquire was sent, as each renewal is from before it is
        // sent: the bound never overstates how long we hold the lock.
        let mut valid_until = *asked_at + self.lease;
        let mut next = *asked_at + self.renew_every;
        loop {
            tokio::time::sleep_until(next).await;
            // Time the renewal from before it is sent: the store starts the new lease
            // somewhere after this instant, so this bound never overstates how long we hold
            // the lock.
            let sent = Instant::now();
            // A renewal still unanswered when the lease may have run out (a store that went
            // silent) cannot keep the lock any more: waiting for it past that point would
            // leave the lease unmarked while someone else may take the lock.
            let renewed = tokio::time::timeout_at(valid_until, self.store.renew(entity, *token, self.lease));
            let Ok(renewed) = renewed.await else {
                tracing::warn!(%entity, "lock lease lost: a renewal went unanswered until the lease ran out");
                lease.mark_lost();
                return;
            };
            match renewed {
                // The next renewal is paced from this one's start, like the lease it renewed,
                // so a slow answer does not eat into the next renewal's margin.
                Ok(true) => {
                    valid_until = sent + self.lease;
                    next = sent + self.renew_every;
                    continue;
                }
                Ok(false) => {
                    tracing::warn!(%entity, "lock lease lost: the lock is no longer ours");
                    lease.mark_lost();
                    return;
                }
                Err(error) if Instant::now() + self.renew_every >= valid_until => {
                    tracing::warn!(%entity, %error, "lock lease lost: renewals failed until the lease ran out");
                    lease.mark_lost();
                    return;
                }
                Err(error) => tracing::warn!(%entity, %error, "lock renewal failed; retrying"),
            }
            next = Instant::now() + self.renew_every;
        }
    }
}

impl LockTicket {
    /// The tiers' `outcome` once the release answered `released` (whether the lock was
    /// still ours), `lost` telling whether the watchdog found the lease lost: a retry when
    /// the lease was lost, whatever the tiers behind answered.
    pub(crate) fn settle(self, lost: bool, released: Result<bool, &StoreError>, outcome: Outcome) -> Outcome {
        let LockTicket { entity, lease, .. } = self;
        if let Err(error) = released {
            tracing::warn!(%entity, %error, "lock release failed; the lock expires with its lease");
        }
        // A release that finds another token means the lease ran out under us even if the
        // watchdog had not noticed yet: someone else may have run meanwhile.
        if lost || matches!(released, Ok(false)) {
            lease.mark_lost();
            return Outcome::retry_later(
                RetryReason::LeaseLost,
                format!("lock of entity {entity} was lost while the handler ran"),
                None,
            );
        }
        outcome
    }
}

impl<St: LockStore> TierDecision for LockLayer<St> {
    type Ticket = LockTicket;
    const TIER: Tier = Tier::Lock;

    fn failure_policy(&self) -> FailurePolicy {
        self.failure_policy
    }

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<LockTicket>, StoreError> {
        let entity = match self.entity_of(envelope) {
            Ok(entity) => entity,
            Err(dead_letter) => return Ok(Enter::Stop(dead_letter)),
        };
        let (token, asked_at) = (Token::random(), Instant::now());
        Ok(match self.store.acquire(&entity, token, self.lease).await? {
            Some(fencing_token) => {
                Enter::Proceed(self.hold(envelope, entity, (token, asked_at), fencing_token))
            }
            None => Enter::Stop(self.busy(&entity)),
        })
    }

    fn keep_alive(&self, ticket: &LockTicket) -> impl Future<Output = ()> + Send {
        self.renew_while_held(ticket)
    }

    async fn exit(&self, ticket: LockTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let released = self.store.release(&ticket.entity, ticket.token).await;
        let lost = ticket.lease.is_lost();
        Ok(ticket.settle(lost, released.as_ref().copied(), outcome))
    }
}
