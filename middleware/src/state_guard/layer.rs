use tower_layer::Layer;

use super::machine::StateMachine;
use crate::key::KeyExtractor;
use crate::tier::TierService;

/// Adds the [state-machine guard](crate::state_guard) in front of a service.
#[derive(Clone, Debug)]
pub struct StateGuardLayer<St> {
    pub(super) store: St,
    pub(super) machine: StateMachine,
    pub(super) entity: KeyExtractor,
    pub(super) target: KeyExtractor,
}

impl<St> StateGuardLayer<St> {
    /// A guard keeping states in `store`, checking transitions against `machine`; `entity`
    /// reads the entity id and `target` the state each event moves it to.
    pub fn new(store: St, machine: StateMachine, entity: KeyExtractor, target: KeyExtractor) -> Self {
        StateGuardLayer {
            store,
            machine,
            entity,
            target,
        }
    }
}

impl<S, St: Clone> Layer<S> for StateGuardLayer<St> {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}
