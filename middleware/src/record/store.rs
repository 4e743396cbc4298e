use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::outcome::{Outcome, RetryReason};
use crate::tier::{Tier, in_flight, payload_mismatch};

/// The status of a consumption record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordStatus {
    /// An attempt is running (or crashed; its lease tells which).
    Processing,
    /// The key is done for good.
    Success,
    /// The last attempt failed; the next delivery takes it over.
    Failure,
}

impl RecordStatus {
    /// The status as stored: `PROCESSING`, `SUCCESS` or `FAILURE`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordStatus::Processing => "PROCESSING",
            RecordStatus::Success => "SUCCESS",
            RecordStatus::Failure => "FAILURE",
        }
    }
}

impl fmt::Display for RecordStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One key's consumption record, as a store reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumptionRecord {
    /// The business key.
    pub key: BusinessKey,
    /// Where the key stands.
    pub status: RecordStatus,
    /// How many attempts have begun, the first included.
    pub attempts: u32,
    /// The last failure's text, if an attempt failed.
    pub last_error: Option<String>,
    /// The fingerprint of the payload the key was first seen with.
    pub fingerprint: Fingerprint,
    /// When the record was created.
    pub created_at: SystemTime,
    /// When the record last changed.
    pub updated_at: SystemTime,
    /// The fencing token of the lock the last attempt held, if a lock ran in front.
    pub fencing_token: Option<u64>,
}

/// What [`RecordStore::begin`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Begin {
    /// The caller owns attempt number `attempt` (1 for a new record); settle it with that
    /// number.
    Started {
        /// The attempt's number.
        attempt: u32,
    },
    /// Another attempt is `PROCESSING` within its lease.
    InProgress,
    /// The key is `SUCCESS`.
    Done,
    /// The key was recorded with another payload's fingerprint.
    Conflict {
        /// The fingerprint on record.
        recorded: Fingerprint,
    },
    /// The record was last written under a newer fencing token than the caller's: the
    /// caller's lock is stale, and it must not take the key over.
    Fenced,
}

impl Begin {
    /// The attempt this delivery owns, or the outcome when the tiers behind must not run:
    /// the one reading of a claim, for both record modes.
    pub(crate) fn into_attempt(
        self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        in_flight_delay: std::time::Duration,
    ) -> Result<u32, Outcome> {
        match self {
            Begin::Started { attempt } => Ok(attempt),
            Begin::Done => Err(Outcome::Duplicate { tier: Tier::Record }),
            Begin::InProgress => Err(in_flight(Tier::Record, key, in_flight_delay)),
            Begin::Fenced => Err(Outcome::retry_later(
                RetryReason::LeaseLost,
                format!("key {key} was written under a newer lock than this delivery's"),
                None,
            )),
            Begin::Conflict { recorded } => Err(payload_mismatch(key, recorded, fingerprint)),
        }
    }
}

/// A backend for the [record tier](crate::record).
///
/// `begin` must be atomic per key: of concurrent begins, at most one gets `Started` for a
/// given attempt. `succeed` and `fail` must act only when the record is still `PROCESSING`
/// under the given attempt number.
///
/// Fencing: `begin` stores the caller's lock fencing token (when a [lock](crate::lock) runs
/// in front) and refuses to take over a record written under a newer token
/// ([`Begin::Fenced`]). Since only the attempt that began a record can settle it, settling
/// is fenced by the same token.
pub trait RecordStore: Clone + Send + Sync + 'static {
    /// Begins an attempt for `key` carrying `fingerprint`, with a lease of `lease`, under the
    /// lock's `fencing_token` if any; see [`Begin`] for the answers and the
    /// [module docs](crate::record) for the rules.
    fn begin(
        &self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        lease: Duration,
        fencing_token: Option<u64>,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// Marks attempt `attempt` of `key` `SUCCESS`. False when that attempt no longer owns it.
    fn succeed(
        &self,
        key: &BusinessKey,
        attempt: u32,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Marks attempt `attempt` of `key` `FAILURE` with `error`. False when that attempt no
    /// longer owns it.
    fn fail(
        &self,
        key: &BusinessKey,
        attempt: u32,
        error: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The record of `key`, if any.
    fn get(
        &self,
        key: &BusinessKey,
    ) -> impl Future<Output = Result<Option<ConsumptionRecord>, StoreError>> + Send;
}
