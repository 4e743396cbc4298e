//! The MySQL / MariaDB store against a real server (`MYSQL_URL`; `services.sh mariadb`
//! starts or installs MariaDB): the record and state store suites, the
//! migration run by many consumers at once, and keys compared byte for byte. Each test has
//! a database of its own.

use integration_tests::mysql::{pool_on, scratch_database};
use oncely::mysql::{Table, migrate, migrate_state};
use oncely::record::{Begin, MysqlRecordStore, RecordStore};
use oncely::state_guard::MysqlStateStore;
use oncely::{BusinessKey, Fingerprint};

fn table() -> Table {
    Table::new("consumption_record").expect("a valid name")
}

async fn store() -> MysqlRecordStore {
    let pool = scratch_database(8).await;
    migrate(&pool, &table()).await.expect("migrate");
    MysqlRecordStore::new(pool, table())
}

oncely::store_suite!(record, store);

async fn state_store() -> MysqlStateStore {
    let pool = scratch_database(8).await;
    let table = Table::new("entity_state").expect("a valid name");
    migrate_state(&pool, &table).await.expect("migrate");
    MysqlStateStore::new(pool, table)
}

oncely::store_suite!(state, state_store);

/// Consumers that start together each run the migration: all succeed, and the table is
/// made once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_is_safe_when_many_consumers_start_at_once() {
    let pool = scratch_database(8).await;
    let migrations: Vec<_> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { migrate(&pool, &table()).await })
        })
        .collect();
    for migration in migrations {
        migration.await.unwrap().expect("every migration succeeds");
    }
    let store = MysqlRecordStore::new(pool, table());
    let key = BusinessKey::new("o-1");
    let lease = std::time::Duration::from_secs(30);
    assert_eq!(
        store
            .begin(&key, Fingerprint::of(b"x"), lease, None)
            .await
            .unwrap(),
        Begin::Started { attempt: 1 }
    );
}

/// Keys differ when their bytes differ: a PAD SPACE collation would take `k` and `k ` (or
/// `K`, under a case-insensitive one) for one key and answer the second as its duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_differ_in_case_or_trailing_spaces_are_different_keys() {
    let store = store().await;
    let lease = std::time::Duration::from_secs(30);
    for key in ["k", "k ", "K", "k\u{0}"] {
        assert_eq!(
            store
                .begin(&BusinessKey::new(key), Fingerprint::of(b"x"), lease, None)
                .await
                .unwrap(),
            Begin::Started { attempt: 1 },
            "{key:?} is a key of its own"
        );
    }
}

/// Consumers whose connections are set to different time zones read each other's leases
/// right: a claim made in UTC still holds the key for one in UTC+8, where a lease written
/// in one session's local time would read as hours past.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_hold_across_consumers_in_different_time_zones() {
    let utc = scratch_database(2).await;
    migrate(&utc, &table()).await.expect("migrate");
    let database: String = oncely::mysql::sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(&utc)
        .await
        .unwrap();
    let east = pool_on(&database, 2, Some("+08:00")).await;
    let west = pool_on(&database, 2, Some("-08:00")).await;
    let lease = std::time::Duration::from_secs(30);
    let (fingerprint, key) = (Fingerprint::of(b"x"), BusinessKey::new("o-1"));
    let first = MysqlRecordStore::new(west, table());
    assert_eq!(
        first.begin(&key, fingerprint, lease, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    for pool in [east, utc] {
        let other = MysqlRecordStore::new(pool, table());
        assert_eq!(
            other.begin(&key, fingerprint, lease, None).await.unwrap(),
            Begin::InProgress,
            "the lease still runs"
        );
    }
}
