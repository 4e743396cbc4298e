use std::time::Duration;

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::tier::BoxFuture;

/// A backend for the [delivery limit](crate::deliveries): per key, how many times a delivery
/// started without being settled. Shared by every consumer process of a route, so a crash
/// in one is seen by the next.
///
/// Object-safe (boxed futures), so a [`Route`](crate::Route) holds any counter without a
/// type parameter.
pub trait DeliveryCounter: Send + Sync + 'static {
    /// How many unsettled starts `key` has (0 when none).
    fn unsettled(&self, key: &BusinessKey) -> BoxFuture<Result<u32, StoreError>>;

    /// Marks `key` as started among others: its count becomes 1 if it has none, and stays
    /// as it is otherwise (kept for `ttl`). Several copies of one key that start at once
    /// leave one mark, not one count each — a crash among others is not any one's own.
    fn mark(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>>;

    /// Counts one more start of `key`, a suspect running alone, kept for `ttl` after the
    /// last one.
    fn start(&self, key: &BusinessKey, ttl: Duration) -> BoxFuture<Result<(), StoreError>>;

    /// Takes back one start of `key`: its suspect's delivery was answered with a wait.
    fn release(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>>;

    /// Forgets `key`'s starts: its delivery was answered.
    fn settle(&self, key: &BusinessKey) -> BoxFuture<Result<(), StoreError>>;
}
