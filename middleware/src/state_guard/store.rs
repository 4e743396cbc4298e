use std::future::Future;

use crate::error::StoreError;

/// A backend for the [state-machine guard](crate::state_guard): each entity's current state.
pub trait StateStore: Clone + Send + Sync + 'static {
    /// The current state of `entity`, `None` when it has none yet.
    fn current(&self, entity: &str) -> impl Future<Output = Result<Option<String>, StoreError>> + Send;

    /// Sets `entity` to `to` if its state is still `from` (`None`: no state), as one
    /// atomic step. False, changing nothing, when the state was something else.
    fn compare_and_set(
        &self,
        entity: &str,
        from: Option<&str>,
        to: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}
