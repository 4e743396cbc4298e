//! A layer that records what the stack answered for each key, so a test can wait for every
//! delivery (duplicates included) and assert on the outcomes.

use std::sync::{Arc, Mutex};

use oncely::tier::{Enter, TierDecision, TierService};
use oncely::{Envelope, Outcome, StoreError, Tier};
use tower::Layer;

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
    type Service = TierService<S, OutcomeLog>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}

/// A tier of the tests' own: lets every envelope through and notes what the stack behind
/// answered for its key.
impl TierDecision for OutcomeLog {
    type Ticket = String;
    const TIER: Tier = Tier::Custom("outcome_log");

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<String>, StoreError> {
        Ok(Enter::Proceed(envelope.key().to_string()))
    }

    async fn exit(&self, key: String, outcome: Outcome) -> Result<Outcome, StoreError> {
        self.0.lock().expect("not poisoned").push((key, outcome.clone()));
        Ok(outcome)
    }
}
