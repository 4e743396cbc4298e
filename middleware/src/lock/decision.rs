use std::time::Duration;

use tokio::task::JoinHandle;
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

/// What the lock tier holds for one envelope: the lock, and the watchdog renewing its
/// lease. Dropped without being settled (the stack's future was dropped), the watchdog
/// stops and the lock expires with its lease.
#[derive(Debug)]
pub struct LockTicket {
    entity: String,
    token: Token,
    lease: LockLease,
    _watchdog: AbortOnDrop,
}

impl<St: LockStore> TierDecision for LockLayer<St> {
    type Ticket = LockTicket;
    const TIER: Tier = Tier::Lock;

    fn failure_policy(&self) -> FailurePolicy {
        self.failure_policy
    }

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<LockTicket>, StoreError> {
        let entity = match self.entity.extract(envelope.delivery()) {
            Ok(entity) => entity.to_string(),
            Err(error) => {
                return Ok(Enter::Stop(Outcome::dead_letter(
                    DeadLetterReason::InvalidKey,
                    format!("lock entity: {error}"),
                )));
            }
        };
        let token = Token::random();
        let Some(fencing_token) = self.store.acquire(&entity, token, self.lease).await? else {
            return Ok(Enter::Stop(Outcome::retry_later(
                RetryReason::LockBusy,
                format!("entity {entity} is locked by another delivery"),
                Some(self.busy_delay),
            )));
        };
        let lease = LockLease::new(fencing_token);
        envelope.extensions_mut().insert(lease.clone());
        let watchdog = AbortOnDrop(tokio::spawn(keep_alive(
            self.store.clone(),
            entity.clone(),
            token,
            self.lease,
            self.renew_every,
            lease.clone(),
        )));
        Ok(Enter::Proceed(LockTicket {
            entity,
            token,
            lease,
            _watchdog: watchdog,
        }))
    }

    async fn exit(&self, ticket: LockTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let LockTicket {
            entity,
            token,
            lease,
            _watchdog,
        } = ticket;
        drop(_watchdog);
        // A release that finds another token means the lease ran out under us even if the
        // watchdog had not noticed yet: someone else may have run meanwhile.
        let released = self.store.release(&entity, token).await;
        if let Err(error) = &released {
            tracing::warn!(%entity, %error, "lock release failed; the lock expires with its lease");
        }
        if lease.is_lost() || matches!(released, Ok(false)) {
            lease.mark_lost();
            return Ok(Outcome::retry_later(
                RetryReason::LeaseLost,
                format!("lock of entity {entity} was lost while the handler ran"),
                None,
            ));
        }
        Ok(outcome)
    }
}

/// Renews the lease every `every` until aborted. Marks the lease lost when the store says the
/// lock is no longer ours, or when renewals keep failing until the lease could have run out.
async fn keep_alive<St: LockStore>(
    store: St,
    entity: String,
    token: Token,
    lease_length: Duration,
    every: Duration,
    lease: LockLease,
) {
    let mut valid_until = Instant::now() + lease_length;
    loop {
        tokio::time::sleep(every).await;
        // Time the renewal from before it is sent: the store starts the new lease somewhere
        // after this instant, so this bound never overstates how long we hold the lock.
        let sent = Instant::now();
        match store.renew(&entity, token, lease_length).await {
            Ok(true) => valid_until = sent + lease_length,
            Ok(false) => {
                tracing::warn!(%entity, "lock lease lost: the lock is no longer ours");
                lease.mark_lost();
                return;
            }
            Err(error) if Instant::now() + every >= valid_until => {
                tracing::warn!(%entity, %error, "lock lease lost: renewals failed until the lease ran out");
                lease.mark_lost();
                return;
            }
            Err(error) => tracing::warn!(%entity, %error, "lock renewal failed; retrying"),
        }
    }
}

/// The watchdog's task, stopped when the ticket goes.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
