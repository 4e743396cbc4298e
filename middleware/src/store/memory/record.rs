use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::Shared;
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus, RecordStore};

#[derive(Debug)]
struct Entry {
    record: ConsumptionRecord,
    lease_until: Instant,
}

/// An in-memory [`RecordStore`] for tests and the quickstart.
///
/// Not durable and not shared between processes; clones share one table. Records are kept
/// for the life of the store (there is no retention purge), so memory grows with the number
/// of distinct keys. Leases follow `tokio::time`.
#[derive(Clone, Debug, Default)]
pub struct MemoryRecordStore {
    records: Shared<HashMap<BusinessKey, Entry>>,
}

impl MemoryRecordStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn settle(&self, key: &BusinessKey, attempt: u32, status: RecordStatus, error: Option<&str>) -> bool {
        let mut records = self.records.lock();
        match records.get_mut(key) {
            Some(entry)
                if entry.record.status == RecordStatus::Processing && entry.record.attempts == attempt =>
            {
                entry.record.status = status;
                if let Some(error) = error {
                    entry.record.last_error = Some(error.to_owned());
                }
                entry.record.updated_at = SystemTime::now();
                true
            }
            _ => false,
        }
    }
}

impl RecordStore for MemoryRecordStore {
    async fn begin(
        &self,
        key: &BusinessKey,
        fingerprint: Fingerprint,
        lease: Duration,
        fencing_token: Option<u64>,
    ) -> Result<Begin, StoreError> {
        let mut records = self.records.lock();
        let now = Instant::now();
        let Some(entry) = records.get_mut(key) else {
            let created_at = SystemTime::now();
            let record = ConsumptionRecord {
                key: key.clone(),
                status: RecordStatus::Processing,
                attempts: 1,
                last_error: None,
                fingerprint,
                created_at,
                updated_at: created_at,
                fencing_token,
            };
            records.insert(
                key.clone(),
                Entry {
                    record,
                    lease_until: now + lease,
                },
            );
            return Ok(Begin::Started { attempt: 1 });
        };
        let record = &mut entry.record;
        if !fingerprint.matches(record.fingerprint) {
            return Ok(Begin::Conflict {
                recorded: record.fingerprint,
            });
        }
        let stale_fence =
            matches!((fencing_token, record.fencing_token), (Some(ours), Some(recorded)) if ours < recorded);
        match record.status {
            RecordStatus::Success => Ok(Begin::Done),
            RecordStatus::Processing if entry.lease_until > now => Ok(Begin::InProgress),
            RecordStatus::Processing | RecordStatus::Failure if stale_fence => Ok(Begin::Fenced),
            RecordStatus::Processing | RecordStatus::Failure => {
                record.status = RecordStatus::Processing;
                record.attempts += 1;
                record.updated_at = SystemTime::now();
                record.fencing_token = fencing_token.or(record.fencing_token);
                entry.lease_until = now + lease;
                Ok(Begin::Started {
                    attempt: record.attempts,
                })
            }
        }
    }

    async fn succeed(&self, key: &BusinessKey, attempt: u32) -> Result<bool, StoreError> {
        Ok(self.settle(key, attempt, RecordStatus::Success, None))
    }

    async fn fail(&self, key: &BusinessKey, attempt: u32, error: &str) -> Result<bool, StoreError> {
        Ok(self.settle(key, attempt, RecordStatus::Failure, Some(error)))
    }

    async fn get(&self, key: &BusinessKey) -> Result<Option<ConsumptionRecord>, StoreError> {
        Ok(self.records.lock().get(key).map(|entry| entry.record.clone()))
    }
}
