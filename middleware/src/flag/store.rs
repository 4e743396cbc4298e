use std::future::Future;
use std::time::Duration;

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::token::Token;

/// What a claim found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The key had no marker; it is now in flight under the caller's token.
    Won,
    /// Another claim of the key is in flight and its lease has not run out.
    InFlight,
    /// The key is done; the payload it was done with has this fingerprint.
    Done(Fingerprint),
}

/// A backend for the [flag tier](crate::flag).
///
/// Implementations must make [`claim`](FlagStore::claim) atomic: of any number of concurrent
/// claims of one key without a marker, exactly one wins. `complete` and `release` must act
/// only when the marker still holds the caller's token.
pub trait FlagStore: Clone + Send + Sync + 'static {
    /// The fingerprint `key` is done with; `None` when it has no marker or is in flight.
    /// Reads only: what a flag with a record behind it asks
    /// ([`FlagLayer::with_record_behind`](crate::flag::FlagLayer::with_record_behind)).
    fn look(&self, key: &BusinessKey)
    -> impl Future<Output = Result<Option<Fingerprint>, StoreError>> + Send;

    /// Marks `key` in flight under `token` for `lease`, if it has no marker.
    fn claim(
        &self,
        key: &BusinessKey,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Turns the in-flight marker held by `token` into "done with `fingerprint`", kept for
    /// `retention`. Returns false (and changes nothing) when the marker is not `token`'s.
    fn complete(
        &self,
        key: &BusinessKey,
        token: Token,
        fingerprint: Fingerprint,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Marks `key` "done with `fingerprint`" for `retention` without a claim, replacing any
    /// marker: for a delivery the durable tier behind has settled, with a flag that claims
    /// nothing ([`FlagLayer::with_record_behind`](crate::flag::FlagLayer::with_record_behind)).
    fn mark_done(
        &self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the in-flight marker held by `token`. Returns false (and changes nothing) when
    /// the marker is not `token`'s.
    fn release(
        &self,
        key: &BusinessKey,
        token: Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}
