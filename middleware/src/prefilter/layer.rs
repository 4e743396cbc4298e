use std::sync::Arc;

use tower_layer::Layer;

use super::service::PreFilterService;
use super::store::PreFilter;

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
    type Service = PreFilterService<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        PreFilterService {
            inner,
            filter: self.filter.clone(),
        }
    }
}
