use std::task::{Context, Poll};

use tower_service::Service;

use super::layer::RecordLayer;
use super::store::{Begin, RecordStore};
use crate::envelope::Envelope;
use crate::lock::LockLease;
use crate::outcome::{DeadLetterReason, Outcome, RetryReason, Tier};
use crate::service::{BoxFuture, take_ready};

/// The service made by [`RecordLayer`]: begins the key's record, runs `inner`, then marks the
/// record `SUCCESS` or `FAILURE`.
#[derive(Clone, Debug)]
pub struct RecordService<S, St> {
    pub(super) inner: S,
    pub(super) config: RecordLayer<St>,
}

impl<S, St> Service<Envelope> for RecordService<S, St>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display + Send + 'static,
    St: RecordStore,
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
            let fencing_token = envelope
                .extensions()
                .get::<LockLease>()
                .map(LockLease::fencing_token);
            let attempt = match config
                .store
                .begin(&key, fingerprint, config.lease, fencing_token)
                .await
            {
                Ok(Begin::Started { attempt }) => attempt,
                Ok(Begin::Done) => return Ok(Outcome::Duplicate { tier: Tier::Record }),
                Ok(Begin::InProgress) => {
                    return Ok(Outcome::retry_later(
                        RetryReason::InFlight(Tier::Record),
                        format!("key {key} is PROCESSING in another delivery"),
                        Some(config.in_flight_delay),
                    ));
                }
                Ok(Begin::Fenced) => {
                    return Ok(Outcome::retry_later(
                        RetryReason::LeaseLost,
                        format!("key {key} was written under a newer lock than this delivery's"),
                        None,
                    ));
                }
                Ok(Begin::Conflict { recorded }) => {
                    return Ok(Outcome::dead_letter(
                        DeadLetterReason::PayloadMismatch,
                        format!("key {key} was recorded with payload {recorded}, this one is {fingerprint}"),
                    ));
                }
                Err(error) => {
                    return Ok(Outcome::retry_later(
                        RetryReason::StoreUnavailable(Tier::Record),
                        error.to_string(),
                        None,
                    ));
                }
            };

            let answer = inner.call(envelope).await;
            let settle = match &answer {
                Ok(outcome) if outcome.is_settled() => config.store.succeed(&key, attempt).await,
                Ok(outcome) => config.store.fail(&key, attempt, &outcome.to_string()).await,
                Err(error) => config.store.fail(&key, attempt, &error.to_string()).await,
            };
            // The answer stands either way. Turning a processed delivery into a retry here
            // would only make the retry wait out the lease and run the handler again.
            match settle {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(%key, attempt, "record was taken over before this attempt settled (lease too short?)")
                }
                Err(error) => {
                    tracing::warn!(%key, attempt, %error, "record store failed while settling; the record stays PROCESSING")
                }
            }
            answer
        })
    }
}
