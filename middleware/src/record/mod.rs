//! The record tier: the durable consumption record per business key.
//!
//! Before the tiers behind run, the tier *begins* the key's record:
//!
//! | the key's record | outcome |
//! |---|---|
//! | none | inserted as `PROCESSING` with a lease: the tiers behind run |
//! | another payload's fingerprint ([`FingerprintPolicy`](crate::FingerprintPolicy)) | [`DeadLetter`](crate::Outcome::DeadLetter): key reused with a different payload |
//! | `SUCCESS` | [`Duplicate`](crate::Outcome::Duplicate) from [`Tier::Record`](crate::Tier::Record) |
//! | `PROCESSING`, lease running | [`RetryLater`](crate::Outcome::RetryLater): in flight elsewhere |
//! | `PROCESSING` past its lease, or `FAILURE` | taken over (attempt + 1): the tiers behind run |
//! | written under a newer lock fencing token | [`RetryLater`](crate::Outcome::RetryLater) (`LeaseLost`): this delivery's lock is stale |
//!
//! Afterwards a settled answer (processed, duplicate, stale) marks the record `SUCCESS`; any
//! other answer marks it `FAILURE` with the error text, so the retry takes it over. Only the
//! attempt that began the record may settle it: an attempt that was taken over after its
//! lease ran out changes nothing.
//!
//! # What it guarantees alone, and what it relies on
//! The record is the final word on "was this key processed". With a backend whose record
//! and business write commit together (the transactional modes on PostgreSQL and MySQL), every
//! effect is applied exactly once. With separate steps, as here, a crash between the
//! handler's effect and `SUCCESS` leaves the record `PROCESSING`: after the lease a retry
//! takes over and the handler runs again, unless a reconciler or an idempotent handler
//! resolves it. The lease must therefore outlast the slowest handler run.
//!
//! The record tier always fails closed: when its store is down, the outcome is
//! [`RetryLater`](crate::Outcome::RetryLater), because no tier stands behind it.

mod decision;
mod layer;
mod reconciler;
mod retention;
mod safe;
mod store;

#[cfg(feature = "memory")]
pub use crate::store::memory::record::MemoryRecordStore;
#[cfg(feature = "mysql")]
pub use crate::store::mysql::admin::MysqlRecordAdmin;
#[cfg(feature = "mysql")]
pub use crate::store::mysql::claims::MAX_KEY_BYTES as MYSQL_MAX_KEY_BYTES;
#[cfg(feature = "mysql")]
pub use crate::store::mysql::commit_rows::MysqlCommitRows;
#[cfg(feature = "mysql")]
pub use crate::store::mysql::record::{
    MysqlBatchHandlerService, MysqlBatchedLayer, MysqlBatchedService, MysqlRecordStore, MysqlRetentionRunner,
    MysqlTransactionalLayer, MysqlTransactionalTicket,
};
#[cfg(feature = "mysql")]
pub use crate::store::mysql::transaction::MysqlTransaction;
#[cfg(feature = "postgres")]
pub use crate::store::postgres::admin::PgRecordAdmin;
#[cfg(feature = "postgres")]
pub use crate::store::postgres::record::{
    CommitRows, PgBatchHandlerService, PgBatchedLayer, PgBatchedService, PgRecordStore, PgRetentionRunner,
    PgTransaction, PgTransactionalLayer, PgTransactionalTicket,
};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use crate::store::sql::admin::{RecordRow, RecordStats, ResponseRow, StuckReport};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use crate::store::sql::batched::{
    BatchAnswer, BatchHandler, BatchHandlerService, BatchLanes, BatchedLayer, BatchedService,
    DEFAULT_BATCH_HANDLER_LANES, DEFAULT_BATCH_HANDLER_MAX_BATCH, DEFAULT_LANES, DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LINGER,
};
pub use decision::RecordTicket;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use decision::fencing_token;
pub use layer::RecordLayer;
pub use reconciler::{EffectCheck, ReconcileReport, Reconciler, StuckRecords};
pub use retention::{DEFAULT_BATCH_ROWS, Retention, RetentionPass, RetentionRunner, RetentionStore};
pub use safe::{AssertTransactionSafe, TransactionSafe};
pub use store::{Begin, ConsumptionRecord, RecordStatus, RecordStore};
