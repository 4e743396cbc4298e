//! Claim coalescing for the three-step SQL stores: each store says how it claims many
//! distinct keys at once ([`ClaimMany`]), and may leave a key to its caller to claim on its
//! own; how a batch holding one key twice runs is the same on every SQL store.

use std::future::Future;

use crate::error::StoreError;
use crate::record::Begin;
use crate::store::coalesce::{Batch, Coalescer, Waiter, answer_each, copy_error, still_waiting};
use crate::store::sql::ClaimRequest;

/// A store's claim of many distinct keys as `PROCESSING`, in few round trips.
pub(crate) trait ClaimMany: Send + Sync + 'static {
    /// Claims `requests`, whose keys are distinct, and answers each in their order: `None`
    /// for a key the caller must claim on its own (the batch did not claim it). An error
    /// means no key was claimed.
    fn claim_many(
        &self,
        requests: &[ClaimRequest],
    ) -> impl Future<Output = Result<Vec<Option<Begin>>, StoreError>> + Send;
}

/// The coalescer of a store's claims: `None` answers a key the caller claims on its own.
pub(crate) type ClaimCoalescer = Coalescer<ClaimRequest, Option<Begin>>;

/// Starts the coalescer of `claims` (see [`Coalescer::spawn`]).
pub(crate) fn spawn(claims: impl ClaimMany, max_rows: usize, max_batches: usize) -> ClaimCoalescer {
    Coalescer::spawn(InRounds(claims), max_rows, max_batches)
}

/// A batch of claims run in rounds of distinct keys: a statement cannot claim one key
/// twice, so a later copy of a key runs in a later round and sees what the earlier one
/// left, as if it had come after it. Each round's claimers get their answers as soon as the
/// round ends: a lease starts when its answer leaves (see `mysql/claims.rs`).
struct InRounds<C>(C);

impl<C: ClaimMany> Batch for InRounds<C> {
    type Request = ClaimRequest;
    type Answer = Option<Begin>;

    async fn run(&self, waiters: Vec<Waiter<ClaimRequest, Option<Begin>>>) {
        let mut pending: Vec<_> = still_waiting(waiters).collect();
        while !pending.is_empty() {
            let mut round: Vec<Waiter<ClaimRequest, Option<Begin>>> = Vec::new();
            let mut later = Vec::new();
            for waiter in pending {
                if round.iter().any(|(request, _)| request.key == waiter.0.key) {
                    later.push(waiter);
                } else {
                    round.push(waiter);
                }
            }
            let (requests, replies): (Vec<_>, Vec<_>) = round.into_iter().unzip();
            match self.0.claim_many(&requests).await {
                Ok(answers) => answer_each(replies, answers.into_iter().map(Ok)),
                Err(error) => {
                    // This round claimed nothing, and the later ones do not run.
                    let replies = replies
                        .into_iter()
                        .chain(later.into_iter().map(|(_, reply)| reply));
                    return answer_each(replies, std::iter::repeat_with(|| Err(copy_error(&error))));
                }
            }
            pending = later;
        }
    }
}
