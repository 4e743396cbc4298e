use std::future::Future;
use std::time::Duration;

use crate::error::StoreError;
use crate::token::Token;

/// A backend for the [lock tier](crate::lock).
///
/// `acquire` must be atomic (at most one holder per entity at a time) and must hand out
/// fencing tokens that only grow for an entity. `renew` and `release` act only when the lock
/// is still held by the caller's token.
pub trait LockStore: Clone + Send + Sync + 'static {
    /// Takes the lock of `entity` under `token` for `lease` if it is free, returning a new
    /// fencing token; `None` when another holder has it.
    fn acquire(
        &self,
        entity: &str,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send;

    /// Extends the lease of the lock held by `token` to `lease` from now. False when the lock
    /// is no longer `token`'s.
    fn renew(
        &self,
        entity: &str,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Frees the lock held by `token`. False when it was no longer `token`'s.
    fn release(&self, entity: &str, token: Token) -> impl Future<Output = Result<bool, StoreError>> + Send;
}
