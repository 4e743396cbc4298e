//! A layer that records what the stack answered for each key, so a test can wait for every
//! delivery (duplicates included) and assert on the outcomes.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use oncely::{BoxFuture, Envelope, Outcome};
use tower::{Layer, Service};

/// The outcomes of the stack it wraps, as `(key, outcome)` in the order they were answered.
/// Outcomes the route decides before the stack (an unreadable key) are not in it.
#[derive(Clone, Debug, Default)]
pub struct OutcomeLog(Arc<Mutex<Vec<(String, Outcome)>>>);

impl OutcomeLog {
    /// An empty log.
    pub fn new() -> Self {
        OutcomeLog::default()
    }

    /// Everything recorded so far.
    pub fn entries(&self) -> Vec<(String, Outcome)> {
        self.0.lock().expect("not poisoned").clone()
    }

    /// How many outcomes were recorded.
    pub fn len(&self) -> usize {
        self.0.lock().expect("not poisoned").len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many recorded outcomes satisfy `matches`.
    pub fn count(&self, matches: impl Fn(&Outcome) -> bool) -> usize {
        let entries = self.0.lock().expect("not poisoned");
        entries.iter().filter(|(_, outcome)| matches(outcome)).count()
    }
}

impl<S> Layer<S> for OutcomeLog {
    type Service = Logged<S>;

    fn layer(&self, inner: S) -> Logged<S> {
        Logged {
            inner,
            log: self.clone(),
        }
    }
}

/// The service of [`OutcomeLog`].
#[derive(Clone, Debug)]
pub struct Logged<S> {
    inner: S,
    log: OutcomeLog,
}

impl<S> Service<Envelope> for Logged<S>
where
    S: Service<Envelope, Response = Outcome>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let key = envelope.key().to_string();
        let answer = self.inner.call(envelope);
        let log = self.log.clone();
        Box::pin(async move {
            let outcome = answer.await?;
            log.0.lock().expect("not poisoned").push((key, outcome.clone()));
            Ok(outcome)
        })
    }
}
