//! The store suites against the in-memory backends.

use oncely::flag::MemoryFlagStore;
use oncely::lock::MemoryLockStore;
use oncely::record::MemoryRecordStore;
use oncely::state_guard::MemoryStateStore;

async fn flag_store() -> MemoryFlagStore {
    MemoryFlagStore::new()
}

async fn lock_store() -> MemoryLockStore {
    MemoryLockStore::new()
}

async fn record_store() -> MemoryRecordStore {
    MemoryRecordStore::new()
}

async fn state_store() -> MemoryStateStore {
    MemoryStateStore::new()
}

integration_tests::flag_store_suite!(flag_store);
integration_tests::lock_store_suite!(lock_store);
integration_tests::record_store_suite!(record_store);
integration_tests::state_store_suite!(state_store);
