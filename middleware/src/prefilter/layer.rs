use std::sync::Arc;

use tower_layer::Layer;

use super::store::{PreFilter, Verdict};
use crate::envelope::{BusinessKey, Envelope};
use crate::error::StoreError;
use crate::outcome::Outcome;
use crate::tier::{Enter, Tier, TierDecision, TierService};

/// Puts a [`PreFilter`] in front of the tiers it wraps; see the [module docs](crate::prefilter).
///
/// Holds the filter behind an `Arc`: every clone of the layer and of its services shares
/// one filter.
#[derive(Debug)]
pub struct PreFilterLayer<F> {
    pub(super) filter: Arc<F>,
}

impl<F: PreFilter> PreFilterLayer<F> {
    /// A layer around `filter`.
    pub fn new(filter: F) -> Self {
        PreFilterLayer {
            filter: Arc::new(filter),
        }
    }

    /// The shared filter, e.g. to fill it from the durable tier's records on start.
    pub fn filter(&self) -> &Arc<F> {
        &self.filter
    }
}

impl<F> Clone for PreFilterLayer<F> {
    fn clone(&self) -> Self {
        PreFilterLayer {
            filter: self.filter.clone(),
        }
    }
}

impl<S, F> Layer<S> for PreFilterLayer<F> {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}

impl<F: PreFilter> TierDecision for PreFilterLayer<F> {
    /// The key, remembered once the tiers behind settled it.
    type Ticket = BusinessKey;
    const TIER: Tier = Tier::PreFilter;

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<BusinessKey>, StoreError> {
        let verdict = self.filter.check(envelope.key());
        let label = match verdict {
            Verdict::CertainlyNew => {
                envelope.mark_certainly_new();
                "certainly_new"
            }
            Verdict::MaybeSeen => "maybe_seen",
        };
        crate::telemetry::count_verdict(envelope, label);
        Ok(Enter::Proceed(envelope.key().clone()))
    }

    async fn exit(&self, key: BusinessKey, outcome: Outcome) -> Result<Outcome, StoreError> {
        // Only after the tiers behind settled the key: remembering it earlier would let a
        // copy skip lookups while the first delivery might still fail.
        if outcome.is_settled() {
            self.filter.remember(&key);
        }
        Ok(outcome)
    }
}
