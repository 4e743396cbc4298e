use std::task::{Context, Poll};

use tower_service::Service;

use super::layer::FlagLayer;
use super::store::{Claim, FlagStore};
use crate::envelope::Envelope;
use crate::outcome::{DeadLetterReason, Outcome, RetryReason, Tier};
use crate::policy::FailurePolicy;
use crate::service::{BoxFuture, take_ready};
use crate::token::Token;

/// The service made by [`FlagLayer`]: claims the key, runs `inner`, then completes or
/// releases the claim.
#[derive(Clone, Debug)]
pub struct FlagService<S, St> {
    pub(super) inner: S,
    pub(super) config: FlagLayer<St>,
}

impl<S, St> Service<Envelope> for FlagService<S, St>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: FlagStore,
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
            let key = envelope.key().clone();
            let fingerprint = envelope.fingerprint();
            if config.skip_claim_when_certainly_new && certainly_new(&envelope) {
                let answer = inner.call(envelope).await;
                if matches!(&answer, Ok(outcome) if outcome.is_settled())
                    && let Err(error) = config.store.mark_done(&key, fingerprint, config.retention).await
                {
                    tracing::warn!(%key, %error, "flag store failed while marking a certainly new key done");
                }
                return answer;
            }
            let token = Token::random();
            match config.store.claim(&key, token, config.lease).await {
                Ok(Claim::Won) => {}
                Ok(Claim::InFlight) => {
                    return Ok(Outcome::retry_later(
                        RetryReason::InFlight(Tier::Flag),
                        format!("key {key} is being processed by another delivery"),
                        Some(config.in_flight_delay),
                    ));
                }
                Ok(Claim::Done(done)) if done == fingerprint => {
                    return Ok(Outcome::Duplicate { tier: Tier::Flag });
                }
                Ok(Claim::Done(done)) => {
                    return Ok(Outcome::dead_letter(
                        DeadLetterReason::PayloadMismatch,
                        format!("key {key} was processed with payload {done}, this one is {fingerprint}"),
                    ));
                }
                Err(error) => {
                    return match config.on_store_error {
                        FailurePolicy::FailOpen => {
                            tracing::warn!(%key, %error, "flag store failed; passing to the tiers behind");
                            crate::telemetry::count_store_error(&envelope, Tier::Flag);
                            inner.call(envelope).await
                        }
                        FailurePolicy::FailClosed => Ok(Outcome::retry_later(
                            RetryReason::StoreUnavailable(Tier::Flag),
                            error.to_string(),
                            None,
                        )),
                    };
                }
            }

            let answer = inner.call(envelope).await;
            // A failed update here costs speed, never correctness: a marker left in flight
            // expires with its lease, and a missing done marker sends the next duplicate on
            // to the durable tier behind.
            let settled = matches!(&answer, Ok(outcome) if outcome.is_settled());
            let update = if settled {
                config
                    .store
                    .complete(&key, token, fingerprint, config.retention)
                    .await
            } else {
                config.store.release(&key, token).await
            };
            match update {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(%key, settled, "flag claim was lost before it was settled (lease ran out?)")
                }
                Err(error) => {
                    tracing::warn!(%key, settled, %error, "flag store failed while settling the claim")
                }
            }
            answer
        })
    }
}

#[cfg(feature = "prefilter")]
fn certainly_new(envelope: &Envelope) -> bool {
    envelope
        .extensions()
        .get::<crate::prefilter::CertainlyNew>()
        .is_some()
}

/// Without the pre-filter tier nothing marks envelopes certainly new.
#[cfg(not(feature = "prefilter"))]
fn certainly_new(_: &Envelope) -> bool {
    false
}
