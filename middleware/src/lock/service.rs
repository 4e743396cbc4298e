use std::task::{Context, Poll};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_service::Service;

use super::layer::LockLayer;
use super::lease::LockLease;
use super::store::LockStore;
use crate::envelope::Envelope;
use crate::outcome::{DeadLetterReason, Outcome, RetryReason, Tier};
use crate::policy::FailurePolicy;
use crate::service::{BoxFuture, take_ready};
use crate::token::Token;

/// The service made by [`LockLayer`]: locks the entity, runs `inner` while a watchdog renews
/// the lease, then releases.
#[derive(Clone, Debug)]
pub struct LockService<S, St> {
    pub(super) inner: S,
    pub(super) config: LockLayer<St>,
}

impl<S, St> Service<Envelope> for LockService<S, St>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: LockStore,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut envelope: Envelope) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        let config = self.config.clone();
        Box::pin(async move {
            let entity = match config.entity.extract(envelope.delivery()) {
                Ok(entity) => entity.to_string(),
                Err(error) => {
                    return Ok(Outcome::dead_letter(
                        DeadLetterReason::InvalidKey,
                        format!("lock entity: {error}"),
                    ));
                }
            };
            let token = Token::random();
            let fencing_token = match config.store.acquire(&entity, token, config.lease).await {
                Ok(Some(fencing_token)) => fencing_token,
                Ok(None) => {
                    return Ok(Outcome::retry_later(
                        RetryReason::LockBusy,
                        format!("entity {entity} is locked by another delivery"),
                        Some(config.busy_delay),
                    ));
                }
                Err(error) => {
                    return match config.on_store_error {
                        FailurePolicy::FailOpen => {
                            tracing::warn!(%entity, %error, "lock store failed; running without the lock");
                            crate::telemetry::count_store_error(&envelope, Tier::Lock);
                            inner.call(envelope).await
                        }
                        FailurePolicy::FailClosed => Ok(Outcome::retry_later(
                            RetryReason::StoreUnavailable(Tier::Lock),
                            error.to_string(),
                            None,
                        )),
                    };
                }
            };

            let lease = LockLease::new(fencing_token);
            envelope.extensions_mut().insert(lease.clone());
            let watchdog = AbortOnDrop(tokio::spawn(keep_alive(
                config.store.clone(),
                entity.clone(),
                token,
                config.lease,
                config.renew_every,
                lease.clone(),
            )));
            let answer = inner.call(envelope).await;
            drop(watchdog);

            // A release that finds another token means the lease ran out under us even if the
            // watchdog had not noticed yet: someone else may have run meanwhile.
            let released = config.store.release(&entity, token).await;
            if let Err(error) = &released {
                tracing::warn!(%entity, %error, "lock release failed; the lock expires with its lease");
            }
            if lease.is_lost() || matches!(released, Ok(false)) {
                lease.mark_lost();
                return answer.map(|_| {
                    Outcome::retry_later(
                        RetryReason::LeaseLost,
                        format!("lock of entity {entity} was lost while the handler ran"),
                        None,
                    )
                });
            }
            answer
        })
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

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
