//! What the SQL stores share, written once: the operator's view of a record table and its
//! statements (`admin.rs`), how a record row reads back, what a claim
//! that finds a row it may not take answers, the three-step store's claim coalescing
//! (`coalesce.rs`), the pre-filter's rebuild from a record table (`prefilter.rs`), and the
//! batched transactional mode (`batched/`), which runs on any
//! store's transactional record. Each SQL store (`postgres/`, `mysql/`) keeps its own
//! statements and plumbing and calls these.

pub(crate) mod admin;
pub(crate) mod batched;
pub(crate) mod coalesce;
pub(crate) mod deferred;
#[cfg(feature = "prefilter")]
pub(crate) mod prefilter;

use std::time::Duration;

use crate::envelope::{BusinessKey, Envelope};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, RecordStatus, fencing_token};

/// One key to claim.
#[derive(Clone, Debug)]
pub(crate) struct ClaimRequest {
    pub(crate) key: BusinessKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) fencing_token: Option<u64>,
    /// `None`: no lease (the transactional mode's rows are never `PROCESSING`).
    pub(crate) lease: Option<Duration>,
}

/// What a transactional record tier claims for `envelope`: its key, with no lease.
pub(crate) fn claim_request(envelope: &Envelope) -> ClaimRequest {
    ClaimRequest {
        key: envelope.key().clone(),
        fingerprint: envelope.fingerprint(),
        fencing_token: fencing_token(envelope),
        lease: None,
    }
}

/// A record row as a claim finds it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FoundRecord {
    pub(crate) status: RecordStatus,
    pub(crate) fingerprint: Fingerprint,
    /// A `PROCESSING` row whose lease still runs.
    pub(crate) leased: bool,
    pub(crate) fencing_token: Option<i64>,
}

/// What a claim of `fingerprint` with `fencing_token` answers on `found`, or `None` when it
/// may take the row over (a `FAILURE` row, or a `PROCESSING` one past its lease, with the
/// same payload and a fencing token no older than the recorded one).
pub(crate) fn refused_claim(
    found: &FoundRecord,
    fingerprint: Fingerprint,
    fencing_token: Option<u64>,
) -> Option<Begin> {
    let stale_fence =
        matches!((fencing_token, found.fencing_token), (Some(ours), Some(theirs)) if to_i64(ours) < theirs);
    if !fingerprint.matches(found.fingerprint) {
        Some(Begin::Conflict {
            recorded: found.fingerprint,
        })
    } else if found.status == RecordStatus::Success {
        Some(Begin::Done)
    } else if found.status == RecordStatus::Processing && found.leased {
        Some(Begin::InProgress)
    } else if stale_fence {
        Some(Begin::Fenced)
    } else {
        None
    }
}

/// Whether `name` is a plain SQL name: 1 to `max_len` lowercase ASCII letters, digits and
/// underscores, not starting with a digit — safe to quote into SQL, since names cannot be
/// bound parameters.
pub(crate) fn is_plain_name(name: &str, max_len: usize) -> bool {
    (1..=max_len).contains(&name.len())
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// A status column's text as a [`RecordStatus`].
pub(crate) fn parse_status(status: &str) -> Result<RecordStatus, StoreError> {
    match status {
        "PROCESSING" => Ok(RecordStatus::Processing),
        "SUCCESS" => Ok(RecordStatus::Success),
        "FAILURE" => Ok(RecordStatus::Failure),
        other => Err(StoreError::malformed(format!("unknown record status {other:?}"))),
    }
}

/// A fingerprint column's 32 hex digits as a [`Fingerprint`].
pub(crate) fn parse_fingerprint(hex: &str) -> Result<Fingerprint, StoreError> {
    u128::from_str_radix(hex, 16)
        .map(Fingerprint::from_u128)
        .map_err(|_| StoreError::malformed(format!("malformed payload fingerprint {hex:?}")))
}

/// The `retry_count` column of `attempt` (attempt = retry_count + 1), saturating.
pub(crate) fn retry_count(attempt: u32) -> i32 {
    i32::try_from(attempt.saturating_sub(1)).unwrap_or(i32::MAX)
}

/// `duration` in microseconds, as the SQL stores add it to their clocks; saturating.
pub(crate) fn micros(duration: Duration) -> i64 {
    to_i64(u64::try_from(duration.as_micros()).unwrap_or(u64::MAX))
}

/// SQL has no unsigned 64-bit integer that both stores share; fencing tokens and leases
/// beyond `i64::MAX` saturate, which keeps their order.
pub(crate) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::to_i64;

    #[test]
    fn tokens_beyond_i64_saturate_in_order() {
        assert_eq!(to_i64(7), 7);
        assert_eq!(to_i64(u64::MAX), i64::MAX);
    }
}
