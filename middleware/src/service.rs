//! Plumbing shared by the tiers' services.

use std::future::Future;
use std::pin::Pin;

/// The future type of every tier's service: one allocation per envelope, negligible next to
/// the store round trips a tier makes.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Takes the service that `poll_ready` readied and leaves a clone in its place.
///
/// `poll_ready` reserves capacity in `inner` (a concurrency limit, a buffer slot); the clone
/// may not have it. Moving the readied one into the call's future keeps the reservation with
/// the request, as tower's documentation recommends.
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}
