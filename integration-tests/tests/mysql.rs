//! The MySQL / MariaDB store against a real server (`MYSQL_URL`; `services.sh mariadb`
//! starts or installs MariaDB): the record, reconcile, state and lock store suites, the
//! migration run by many consumers at once, keys compared byte for byte, leases across time
//! zones, the status helpers, and RabbitMQ consumers with their record on MariaDB (three-step,
//! transactional, batched). The handler faults are in `mysql_transactional.rs`. Each test
//! has a database of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use integration_tests::amqp::{Broker, ready_messages, start_runner, topology_with_orders};
use integration_tests::mysql::{StockDatabase, pool_on, scratch_database, stock_move};
use integration_tests::postgres::boxed;
use integration_tests::unique;
use oncely::lock::MysqlLockStore;
use oncely::mysql::sqlx;
use oncely::mysql::{StatusColumns, Table, migrate, migrate_lock, migrate_state};
use oncely::record::{
    Begin, MysqlRecordStore, MysqlTransaction, MysqlTransactionalLayer, RecordLayer, RecordStatus,
    RecordStore,
};
use oncely::state_guard::MysqlStateStore;
use oncely::{
    BusinessKey, Delivery, Envelope, Fingerprint, HandlerError, KeyExtractor, Outcome, Route, Source,
    handler_fn,
};
use oncely_amqp::{Producer, Runner};

fn table() -> Table {
    Table::new("consumption_record").expect("a valid name")
}

async fn store() -> MysqlRecordStore {
    let pool = scratch_database(8).await;
    migrate(&pool, &table()).await.expect("migrate");
    MysqlRecordStore::new(pool, table())
}

oncely::store_suite!(record, store);

oncely::store_suite!(reconcile, store);
// Each case on a database of its own: its purge deletes every old `SUCCESS` row.
oncely::store_suite!(retention, store);

async fn state_store() -> MysqlStateStore {
    let pool = scratch_database(8).await;
    let table = Table::new("entity_state").expect("a valid name");
    migrate_state(&pool, &table).await.expect("migrate");
    MysqlStateStore::new(pool, table)
}

oncely::store_suite!(state, state_store);

async fn lock_store() -> MysqlLockStore {
    let pool = scratch_database(8).await;
    let table = Table::new("entity_lock").expect("a valid name");
    migrate_lock(&pool, &table).await.expect("migrate");
    MysqlLockStore::new(pool, table)
}

oncely::store_suite!(lock, lock_store);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coalescing_record_store_passes_the_record_suite() {
    oncely::store_suite!(record, run: store().await.with_coalescing(64, 4));
}

/// Two consumer processes' coalescing stores claim the same keys at once — 32 keys, some
/// already done, each asked for 4 times by each store — while their batches race between
/// the read of the rows and the insert of the new keys: each key not done is started
/// exactly once, and a done key is never started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_claims_of_two_stores_start_each_key_once() {
    let pool = scratch_database(16).await;
    migrate(&pool, &table()).await.expect("migrate");
    let stores = [0, 1].map(|_| MysqlRecordStore::new(pool.clone(), table()).with_coalescing(64, 4));
    let lease = std::time::Duration::from_secs(30);
    let fingerprint = Fingerprint::of(b"x");
    let key = |n: usize| BusinessKey::new(format!("order-{n}"));
    for n in (0..32).step_by(4) {
        let done = &stores[0];
        assert_eq!(
            done.begin(&key(n), fingerprint, lease, None).await.unwrap(),
            Begin::Started { attempt: 1 }
        );
        assert!(done.succeed(&key(n), 1).await.unwrap());
    }
    let claims: Vec<_> = (0..256)
        .map(|i| {
            let (store, key) = (stores[i % 2].clone(), key(i / 2 % 32));
            tokio::spawn(async move { (key.clone(), store.begin(&key, fingerprint, lease, None).await) })
        })
        .collect();
    let mut started: HashMap<String, usize> = HashMap::new();
    for claim in claims {
        let (key, answer) = claim.await.unwrap();
        match answer.expect("every claim answers") {
            Begin::Started { attempt: 1 } => *started.entry(key.as_str().to_owned()).or_default() += 1,
            Begin::InProgress | Begin::Done => {}
            other => panic!("{key}: {other:?}"),
        }
    }
    let expected: HashMap<String, usize> = (0..32)
        .filter(|n| n % 4 != 0)
        .map(|n| (key(n).as_str().to_owned(), 1))
        .collect();
    assert_eq!(started, expected);
}

/// The pre-filter rebuilt from the MariaDB record table knows the keys settled as `SUCCESS`
/// within the window, read in pages of 10,000, and no key still processing, failed or
/// settled before the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_filter_rebuilt_from_the_records_knows_the_recent_successes_only() {
    use oncely::prefilter::{BitmapPreFilter, rebuild_from_mysql_records};

    let pool = scratch_database(2).await;
    migrate(&pool, &table()).await.expect("migrate");
    for first in (1..=25_000).step_by(5_000) {
        let mut insert = sqlx::QueryBuilder::new(
            "INSERT INTO consumption_record (message_key, status, payload_fingerprint) ",
        );
        insert.push_values(first..first + 5_000, |mut row, n: u32| {
            row.push_bind(n.to_string()).push_bind("SUCCESS").push_bind("f");
        });
        insert.build().execute(&pool).await.expect("insert the successes");
    }
    sqlx::raw_sql(
        "INSERT INTO consumption_record (message_key, status, payload_fingerprint, updated_at)
         VALUES ('25001', 'PROCESSING', 'f', UTC_TIMESTAMP(6)), ('25002', 'FAILURE', 'f', UTC_TIMESTAMP(6)),
                ('25003', 'SUCCESS', 'f', UTC_TIMESTAMP(6) - INTERVAL 2 HOUR)",
    )
    .execute(&pool)
    .await
    .expect("insert the others");

    let filter = BitmapPreFilter::new(0);
    let mut reported = Vec::new();
    let window = std::time::Duration::from_secs(3600);
    let read = rebuild_from_mysql_records(&filter, &pool, &table(), window, |so_far| reported.push(so_far))
        .await
        .unwrap();
    integration_tests::check_rebuilt_filter(&filter, read, &reported);
}

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

/// Publishes `ORDERS` orders to `queue`, a third of them twice (half under the same message
/// id, half under a new one); answers how many copies it sent.
async fn publish_orders_with_copies(producer: &Producer, queue: &str) -> u64 {
    let body = |order: usize| format!(r#"{{"orderId":"o-{order}"}}"#).into_bytes();
    let mut copies = 0;
    for order in 0..ORDERS {
        let id = producer.publish("", queue, &body(order), None).await.unwrap();
        if order % 3 == 0 {
            let again = match order % 2 {
                0 => producer.publish_with_id(&id, "", queue, &body(order), None).await,
                _ => producer.publish("", queue, &body(order), None).await.map(drop),
            };
            again.unwrap();
            copies += 1;
        }
    }
    copies
}

const ORDERS: usize = 300;

/// Consumes `name`'s queue on `broker` with `route` until it drains, after
/// [`publish_orders_with_copies`]; checks every order processed once, every copy answered a
/// duplicate and nothing dead-lettered.
async fn consume_orders_with_copies<S>(broker: Broker, name: &str, route: impl FnOnce() -> Route<S>)
where
    S: tower::Service<Envelope, Response = oncely::Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    let (topology, channel) = topology_with_orders(broker, name, &[]).await;
    let producer = Producer::new(broker.connect().await);
    let copies = publish_orders_with_copies(&producer, topology.queue()).await;
    let runner = Runner::new(route(), topology.clone()).with_drain(Duration::from_millis(500));
    let (_, running) = start_runner(runner, broker.address(), &unique("oncely-test-mysql"));
    let report = tokio::time::timeout(Duration::from_secs(120), running)
        .await
        .expect("drained within two minutes")
        .unwrap()
        .unwrap();
    assert_eq!(report.processed, ORDERS as u64, "{report}");
    assert_eq!(report.duplicates.values().sum::<u64>(), copies, "{report}");
    assert_eq!(ready_messages(&channel, topology.dead_letter_queue()).await, 0);
    topology.delete(&channel).await.unwrap();
}

/// The path a user runs: RabbitMQ delivers orders, a third of them twice (the same id or a
/// new one), to a runner whose route has the three-step record tier on MariaDB — each
/// order's effect once, every record `SUCCESS`, the copies answered as duplicates, nothing
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_consumer_with_the_record_on_mariadb_applies_each_order_once() {
    let records = store().await;
    let effects = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let applied = effects.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        *applied
            .lock()
            .unwrap()
            .entry(envelope.key().to_string())
            .or_default() += 1;
        async { Ok::<(), HandlerError>(()) }
    });
    let stack = tower::Layer::layer(&RecordLayer::new(records.clone()), handler);
    consume_orders_with_copies(Broker::Rabbit3, "mysql-record", || {
        Route::new("mysql-orders", KeyExtractor::json_pointer("/orderId"), stack)
    })
    .await;
    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), ORDERS);
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    for order in 0..ORDERS {
        let key = BusinessKey::new(format!("o-{order}"));
        let record = records.get(&key).await.unwrap().expect("a record");
        assert_eq!(record.status, RecordStatus::Success, "o-{order}");
    }
}

/// The same with the transactional record, per delivery and batched, on RabbitMQ 3.10 and
/// 4.0: the handler writes its stock move in the record's XA transaction on MariaDB — one
/// row per order in the business table, each order's record `SUCCESS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_consumer_with_the_transactional_record_on_mariadb_writes_each_order_once() {
    for (broker, batched) in [(Broker::Rabbit3, false), (Broker::Rabbit4, true)] {
        let database = StockDatabase::new().await;
        let records = MysqlTransactionalLayer::new(database.pool(16).await, StockDatabase::records());
        let stack = match batched {
            false => boxed(records.handler(stock_move)),
            true => boxed(records.batched().handler(stock_move)),
        };
        consume_orders_with_copies(broker, "mysql-transactional", || {
            Route::new("mysql-orders", KeyExtractor::json_pointer("/orderId"), stack)
        })
        .await;
        assert_eq!(database.all_moves().await, ORDERS as i64, "{broker:?}");
        for order in 0..ORDERS {
            let order = format!("o-{order}");
            assert_eq!(database.moves_of(&order).await, 1, "{broker:?} {order}");
            assert_eq!(
                database.status_of(&order).await.as_deref(),
                Some("SUCCESS"),
                "{broker:?} {order}"
            );
        }
    }
}

/// The status and version helpers, in the transactional record's transaction as a payment
/// callback uses them: a retried callback changes nothing, a stale version changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_version_helpers_change_a_row_only_from_the_expected_state() {
    let database = StockDatabase::new().await;
    sqlx::raw_sql(
        "CREATE TABLE orders (id VARCHAR(32) PRIMARY KEY, status VARCHAR(16) NOT NULL, version BIGINT NOT NULL DEFAULT 1);
         INSERT INTO orders (id, status) VALUES ('o-1', 'UNPAID')",
    )
    .execute(&database.pool)
    .await
    .unwrap();
    let orders = StatusColumns::new(Table::new("orders").unwrap(), "id", "status", "version").unwrap();
    let records = MysqlTransactionalLayer::new(database.pool(2).await, StockDatabase::records());
    let paid = Arc::new(Mutex::new(Vec::new()));
    let seen = paid.clone();
    let pay = records.handler(move |tx: MysqlTransaction, order: BusinessKey| {
        let (orders, seen) = (orders.clone(), seen.clone());
        async move {
            let changed = orders
                .transition(&tx, order.as_str(), &["UNPAID"], "PAID")
                .await?;
            seen.lock().unwrap().push(changed);
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("pay", KeyExtractor::json_pointer("/orderId"), pay);
    let callback = |id: &str| Delivery::new(Source::new("callbacks"), format!(r#"{{"orderId":"{id}"}}"#));
    assert_eq!(route.handle(callback("o-1")).await, Outcome::Processed);
    // The provider's retry under another notification id: the record does not know it, the
    // state guard in the row does.
    let orders = StatusColumns::new(Table::new("orders").unwrap(), "id", "status", "version").unwrap();
    assert!(
        !orders
            .transition(&database.pool, "o-1", &["UNPAID"], "PAID")
            .await
            .unwrap()
    );
    assert_eq!(*paid.lock().unwrap(), vec![true]);
    assert!(
        !orders
            .compare_and_set(&database.pool, "o-1", 1, "REFUNDED")
            .await
            .unwrap(),
        "version 1 is stale"
    );
    assert!(
        orders
            .compare_and_set(&database.pool, "o-1", 2, "REFUNDED")
            .await
            .unwrap()
    );
    let (status, version): (String, i64) =
        sqlx::query_as("SELECT status, version FROM orders WHERE id = 'o-1'")
            .fetch_one(&database.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), version), ("REFUNDED", 3));
    assert!(
        !orders
            .transition(&database.pool, "o-1", &[], "PAID")
            .await
            .unwrap()
    );
}
