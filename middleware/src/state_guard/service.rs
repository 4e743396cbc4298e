use std::task::{Context, Poll};

use tower_service::Service;

use super::layer::StateGuardLayer;
use super::store::StateStore;
use crate::envelope::Envelope;
use crate::outcome::{DeadLetterReason, Outcome, RetryReason, Tier};
use crate::service::{BoxFuture, take_ready};

/// The service made by [`StateGuardLayer`]: checks the transition, runs `inner`, then commits
/// the new state.
#[derive(Clone, Debug)]
pub struct StateGuardService<S, St> {
    pub(super) inner: S,
    pub(super) config: StateGuardLayer<St>,
}

impl<S, St> Service<Envelope> for StateGuardService<S, St>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: StateStore,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        let config = self.config.clone();
        Box::pin(async move {
            let read = |extractor: &crate::KeyExtractor, what: &str| {
                extractor
                    .extract(envelope.delivery())
                    .map(|value| value.to_string())
                    .map_err(|error| {
                        Outcome::dead_letter(DeadLetterReason::InvalidKey, format!("{what}: {error}"))
                    })
            };
            let (entity, target) = match (
                read(&config.entity, "entity id"),
                read(&config.target, "target state"),
            ) {
                (Ok(entity), Ok(target)) => (entity, target),
                (Err(dead), _) | (_, Err(dead)) => return Ok(dead),
            };
            let current = match config.store.current(&entity).await {
                Ok(current) => current,
                Err(error) => {
                    return Ok(Outcome::retry_later(
                        RetryReason::StoreUnavailable(Tier::StateGuard),
                        error.to_string(),
                        None,
                    ));
                }
            };
            match config.machine.allows(current.as_deref(), &target) {
                Ok(true) => {}
                Ok(false) => return Ok(Outcome::Stale { current, target }),
                Err(error) => {
                    return Ok(Outcome::dead_letter(
                        DeadLetterReason::UnknownState,
                        format!("entity {entity}: {error}"),
                    ));
                }
            }

            let answer = inner.call(envelope).await;
            if !matches!(answer, Ok(Outcome::Processed | Outcome::Duplicate { .. })) {
                return answer;
            }
            match config
                .store
                .compare_and_set(&entity, current.as_deref(), &target)
                .await
            {
                Ok(true) => answer,
                Ok(false) => Ok(Outcome::retry_later(
                    RetryReason::Conflict(Tier::StateGuard),
                    format!("entity {entity} changed state while this event was handled"),
                    None,
                )),
                Err(error) => Ok(Outcome::retry_later(
                    RetryReason::StoreUnavailable(Tier::StateGuard),
                    format!("state of {entity} not committed: {error}"),
                    None,
                )),
            }
        })
    }
}
