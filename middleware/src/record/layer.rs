use std::time::Duration;

use tower_layer::Layer;

use crate::tier::TierService;

/// Adds the [record tier](crate::record) in front of a service.
#[derive(Clone, Debug)]
pub struct RecordLayer<St> {
    pub(super) store: St,
    pub(super) lease: Duration,
    pub(super) in_flight_delay: Duration,
}

impl<St> RecordLayer<St> {
    /// A record tier on `store`. Defaults: lease 60 s, retry delay for in-flight keys 1 s.
    pub fn new(store: St) -> Self {
        RecordLayer {
            store,
            lease: Duration::from_secs(60),
            in_flight_delay: Duration::from_secs(1),
        }
    }

    setters! {
        /// How long a `PROCESSING` record blocks other deliveries of its key before one may take
        /// it over. Make it longer than the slowest handler run.
        with_lease(lease: Duration);

        /// The delay suggested to the broker when the key is in flight elsewhere.
        with_in_flight_delay(in_flight_delay: Duration);
    }
}

impl<S, St: Clone> Layer<S> for RecordLayer<St> {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}
