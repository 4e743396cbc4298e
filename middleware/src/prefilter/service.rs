use std::sync::Arc;
use std::task::{Context, Poll};

use tower_service::Service;

use super::CertainlyNew;
use super::store::{PreFilter, Verdict};
use crate::envelope::Envelope;
use crate::outcome::Outcome;
use crate::service::{BoxFuture, take_ready};

/// The service made by [`PreFilterLayer`](super::PreFilterLayer): marks certainly new
/// envelopes, runs `inner`, and remembers the key once `inner` settled it.
#[derive(Debug)]
pub struct PreFilterService<S, F> {
    pub(super) inner: S,
    pub(super) filter: Arc<F>,
}

impl<S: Clone, F> Clone for PreFilterService<S, F> {
    fn clone(&self) -> Self {
        PreFilterService {
            inner: self.inner.clone(),
            filter: self.filter.clone(),
        }
    }
}

impl<S, F> Service<Envelope> for PreFilterService<S, F>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    F: PreFilter,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut envelope: Envelope) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        let filter = self.filter.clone();
        Box::pin(async move {
            let key = envelope.key().clone();
            let verdict = filter.check(&key);
            if verdict == Verdict::CertainlyNew {
                envelope.extensions_mut().insert(CertainlyNew);
            }
            crate::telemetry::count_prefilter_verdict(&envelope, verdict);
            let answer = inner.call(envelope).await;
            // Only after the tiers behind settled the key: remembering it earlier would let a
            // copy skip lookups while the first delivery might still fail.
            if matches!(&answer, Ok(outcome) if outcome.is_settled()) {
                filter.remember(&key);
            }
            answer
        })
    }
}
