//! The PostgreSQL backends against a real PostgreSQL: the store suites, the transactional
//! mode, the reconciler, the state guard and the state helpers. Each test works in a schema
//! of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use integration_tests::postgres::{
    BoxedStack, RecordMode, ScratchSchema, insert_stock_move, pool, schema_pool,
};
use oncely::lock::PgLockStore;
use oncely::postgres::StatusColumns;
use oncely::record::{PgRecordStore, PgTransaction, RecordStatus, RecordStore};
use oncely::state_guard::{PgStateStore, StateGuardLayer, StateMachine, StateStore};
use oncely::{
    BusinessKey, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, Source, Tier,
    handler_fn,
};
use tower::ServiceBuilder;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_store_passes_the_record_suite() {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    oncely::store_suite!(record, run: PgRecordStore::new(pool.clone(), schema.records()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coalescing_record_store_passes_the_record_suite() {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    oncely::store_suite!(record,
        run: PgRecordStore::new(pool.clone(), schema.records()).with_coalescing(64, 4)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_store_passes_the_state_suite() {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    oncely::store_suite!(state, run: PgStateStore::new(pool.clone(), schema.table("entity_state")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_store_passes_the_lock_suite() {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    let table = schema.table("entity_lock");
    oncely::postgres::migrate_lock(&pool, &table)
        .await
        .expect("migrate the lock table");
    oncely::store_suite!(lock, run: PgLockStore::new(pool.clone(), table.clone()));
}

fn order(id: &str) -> Delivery {
    Delivery::new(
        Source::new("orders"),
        format!(r#"{{"orderId":"{id}","sku":"sku-1"}}"#),
    )
}

/// A handler that writes one stock movement for the order in the record's transaction, and
/// then fails with a transient error on the calls `fail` says.
fn deduct_stock(
    fail: impl Fn(usize) -> bool + Clone + Send + Sync + 'static,
) -> impl tower::Service<Envelope, Response = Outcome, Error = std::convert::Infallible, Future: Send>
+ Clone
+ Send
+ oncely::record::TransactionSafe {
    let calls = Arc::new(AtomicUsize::new(0));
    handler_fn(move |envelope: Envelope| {
        let (fail, call) = (fail.clone(), calls.fetch_add(1, Ordering::SeqCst));
        async move {
            insert_stock_move(&envelope).await?;
            if fail(call) {
                return Err(HandlerError::transient("payment service timed out"));
            }
            Ok(())
        }
    })
}

/// The test's schema with a `stock_moves` business table, a pool whose connections search
/// that schema first (so handlers write unqualified), and the transactional route on them.
async fn transactional_route(
    mode: RecordMode,
    fail: impl Fn(usize) -> bool + Clone + Send + Sync + 'static,
) -> (ScratchSchema, deadpool_postgres::Pool, Route<BoxedStack>) {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE stock_moves (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)")
        .await;
    let pool = schema_pool(schema.name(), 32);
    let stack = mode.stack(&pool, schema.records(), deduct_stock(fail));
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    (schema, pool, route)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_deliveries_of_one_key_write_one_business_row() {
    for mode in RecordMode::ALL {
        let (schema, _pool, route) = transactional_route(mode, |_| false).await;
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let route = route.clone();
                tokio::spawn(async move { route.handle(order("o-1")).await })
            })
            .collect();
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
        assert_eq!(
            outcomes.iter().filter(|o| **o == Outcome::Processed).count(),
            1,
            "{outcomes:?}"
        );
        assert!(
            outcomes.iter().all(|o| o.is_settled()),
            "the others are duplicates: {outcomes:?}"
        );
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 1);
        assert_eq!(
            schema
                .count("SELECT count(*) FROM consumption_record WHERE status = 'SUCCESS'")
                .await,
            1
        );
    }
}

#[tokio::test]
async fn a_failed_handler_rolls_back_its_writes_with_the_record() {
    for mode in RecordMode::ALL {
        let (schema, pool, route) = transactional_route(mode, |call| call == 0).await;

        let failed = route.handle(order("o-1")).await;
        assert_eq!(failed.retry_reason(), Some(RetryReason::HandlerFailed));
        assert_eq!(
            schema.count("SELECT count(*) FROM stock_moves").await,
            0,
            "the business write rolled back"
        );
        let record = PgRecordStore::new(pool.clone(), schema.records());
        let noted = record
            .get(&BusinessKey::new("o-1"))
            .await
            .unwrap()
            .expect("the failure is noted");
        assert_eq!(noted.status, RecordStatus::Failure);
        assert!(noted.last_error.unwrap().contains("payment service timed out"));

        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 1);
        let done = record.get(&BusinessKey::new("o-1")).await.unwrap().unwrap();
        assert_eq!(
            (done.status, done.attempts),
            (RecordStatus::Success, 2),
            "the second attempt took the failed one over"
        );
    }
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_makes_the_redelivery_a_duplicate() {
    for mode in RecordMode::ALL {
        let (schema, _pool, route) = transactional_route(mode, |_| false).await;
        // The first answer is "lost" with the ack: the broker redelivers the same message.
        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        let redelivery = order("o-1").with_attempt(2).with_redelivered(true);
        assert_eq!(
            route.handle(redelivery).await,
            Outcome::Duplicate { tier: Tier::Record }
        );
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 1);
    }
}

#[tokio::test]
async fn the_same_key_with_another_payload_is_dead_lettered_by_the_record() {
    for mode in RecordMode::ALL {
        let (schema, _pool, route) = transactional_route(mode, |_| false).await;
        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        let reused = Delivery::new(Source::new("orders"), r#"{"orderId":"o-1","sku":"sku-2"}"#);
        let outcome = route.handle(reused).await;
        assert_eq!(
            outcome.dead_letter_reason(),
            Some(oncely::DeadLetterReason::PayloadMismatch)
        );
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 1);
    }
}

#[tokio::test]
async fn the_transactional_record_applies_the_routes_fingerprint_policy() {
    for mode in RecordMode::ALL {
        let (schema, _pool, route) = transactional_route(mode, |_| false).await;
        let sent = |id: &str, sku: &str, at: u32| {
            Delivery::new(
                Source::new("orders"),
                format!(r#"{{"orderId":"{id}","sku":"{sku}","sentAt":{at}}}"#),
            )
        };
        let fields = route.with_fingerprint(oncely::FingerprintPolicy::fields(["/sku"]).unwrap());
        assert_eq!(fields.handle(sent("o-1", "sku-1", 1)).await, Outcome::Processed);
        assert_eq!(
            fields.handle(sent("o-1", "sku-1", 2)).await,
            Outcome::Duplicate {
                tier: oncely::Tier::Record
            },
            "fields: sentAt is not compared"
        );
        assert_eq!(
            fields.handle(sent("o-1", "sku-2", 3)).await.dead_letter_reason(),
            Some(oncely::DeadLetterReason::PayloadMismatch)
        );
        let off = fields.with_fingerprint(oncely::FingerprintPolicy::off());
        assert_eq!(
            off.handle(sent("o-1", "sku-2", 4)).await,
            Outcome::Duplicate {
                tier: oncely::Tier::Record
            },
            "off: any payload of a recorded key is a duplicate"
        );
        assert_eq!(off.handle(sent("o-2", "sku-9", 5)).await, Outcome::Processed);
        assert_eq!(
            off.handle(sent("o-2", "sku-1", 6)).await,
            Outcome::Duplicate {
                tier: oncely::Tier::Record
            }
        );
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 2);
    }
}

#[tokio::test]
async fn a_connection_killed_mid_transaction_retries_later_and_leaves_no_partial_state() {
    for mode in RecordMode::ALL {
        let schema = ScratchSchema::new(&pool(2)).await;
        let pool = schema_pool(schema.name(), 4);
        schema
            .execute("CREATE TABLE stock_moves (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)")
            .await;
        let killer = pool.clone();
        let kill_first = Arc::new(AtomicUsize::new(0));
        let handler = handler_fn(move |envelope: Envelope| {
            let (killer, kill_first) = (killer.clone(), kill_first.clone());
            async move {
                let tx = envelope.extensions().get::<PgTransaction>().unwrap().clone();
                tx.client()
                    .execute(
                        "INSERT INTO stock_moves (order_id) VALUES ($1)",
                        &[&envelope.key().as_str()],
                    )
                    .await?;
                if kill_first.fetch_add(1, Ordering::SeqCst) == 0 {
                    let pid: i32 = tx
                        .client()
                        .query_one("SELECT pg_backend_pid()", &[])
                        .await?
                        .get(0);
                    let other = killer.get().await.map_err(HandlerError::transient)?;
                    other.execute("SELECT pg_terminate_backend($1)", &[&pid]).await?;
                }
                tx.client().execute("SELECT 1", &[]).await?;
                Ok::<(), HandlerError>(())
            }
        });
        let stack = mode.stack(&pool, schema.records(), handler);
        let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);

        let killed = route.handle(order("o-1")).await;
        assert!(matches!(killed, Outcome::RetryLater(_)), "{killed:?}");
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 0);
        assert_eq!(
            schema
                .count("SELECT count(*) FROM consumption_record WHERE status = 'SUCCESS'")
                .await,
            0
        );
        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        assert_eq!(schema.count("SELECT count(*) FROM stock_moves").await, 1);
    }
}

/// The reconciler suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_store_passes_the_reconcile_suite() {
    let pool = pool(8);
    let schema = ScratchSchema::new(&pool).await;
    oncely::store_suite!(reconcile, run: PgRecordStore::new(pool.clone(), schema.records()));
}

/// The retention suite, each case on a record table of its own (its purge deletes every old
/// `SUCCESS` row of the table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_store_passes_the_retention_suite() {
    let pool = pool(8);
    let mut schemas = Vec::new();
    oncely::store_suite!(retention, run: {
        let schema = ScratchSchema::new(&pool).await;
        let records = PgRecordStore::new(pool.clone(), schema.records());
        schemas.push(schema);
        records
    });
}

#[tokio::test]
async fn an_out_of_order_state_event_is_stale_and_changes_nothing() {
    let pool = pool(4);
    let schema = ScratchSchema::new(&pool).await;
    let states = PgStateStore::new(pool.clone(), schema.table("entity_state"));
    let applied = Arc::new(AtomicUsize::new(0));
    let handler = handler_fn({
        let applied = applied.clone();
        move |_: Envelope| {
            applied.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), HandlerError>(()) }
        }
    });
    let guard = StateGuardLayer::new(
        states.clone(),
        StateMachine::forward_only(["Created", "Assigned", "Departed", "Arrived"]).unwrap(),
        KeyExtractor::json_pointer("/shipment"),
        KeyExtractor::json_pointer("/state"),
    );
    let stack = ServiceBuilder::new().layer(guard).service(handler);
    let route = Route::new(
        "shipments",
        KeyExtractor::template("{/shipment}:{/state}").unwrap(),
        stack,
    );
    let event = |state: &str| {
        Delivery::new(
            Source::new("shipments"),
            format!(r#"{{"shipment":"s-1","state":"{state}"}}"#),
        )
    };
    assert_eq!(route.handle(event("Created")).await, Outcome::Processed);
    assert_eq!(route.handle(event("Departed")).await, Outcome::Processed);
    let stale = route.handle(event("Assigned")).await;
    assert!(matches!(stale, Outcome::Stale { .. }), "{stale:?}");
    assert_eq!(states.current("s-1").await.unwrap().as_deref(), Some("Departed"));
    assert_eq!(applied.load(Ordering::SeqCst), 2);
    assert_eq!(
        schema
            .count("SELECT version FROM entity_state WHERE entity_id = 's-1'")
            .await,
        2
    );
}

#[tokio::test]
async fn status_and_version_helpers_change_a_row_only_from_the_expected_state() {
    let pool = pool(2);
    let schema = ScratchSchema::new(&pool).await;
    schema
        .execute("CREATE TABLE orders (id TEXT PRIMARY KEY, status TEXT NOT NULL, version BIGINT NOT NULL DEFAULT 1);
                  INSERT INTO orders (id, status) VALUES ('o-1', 'UNPAID')")
        .await;
    let orders = StatusColumns::new(schema.table("orders"), "id", "status", "version").unwrap();
    let client = pool.get().await.unwrap();
    assert!(
        orders
            .transition(&client, &"o-1", &["UNPAID"], "PAID")
            .await
            .unwrap()
    );
    assert!(
        !orders
            .transition(&client, &"o-1", &["UNPAID"], "PAID")
            .await
            .unwrap(),
        "a retried callback changes nothing"
    );
    assert!(
        !orders
            .compare_and_set(&client, &"o-1", 1, "REFUNDED")
            .await
            .unwrap(),
        "version 1 is stale"
    );
    assert!(
        orders
            .compare_and_set(&client, &"o-1", 2, "REFUNDED")
            .await
            .unwrap()
    );
    assert_eq!(
        schema.count("SELECT version FROM orders WHERE id = 'o-1'").await,
        3
    );
}

#[tokio::test]
async fn a_pre_filter_rebuilt_from_the_records_knows_the_recent_successes_only() {
    use oncely::prefilter::{BitmapPreFilter, rebuild_from_records};

    let pool = pool(2);
    let schema = ScratchSchema::new(&pool).await;
    schema
        .execute(
            "INSERT INTO consumption_record (message_key, status, payload_fingerprint)
                 SELECT n::text, 'SUCCESS', 'f' FROM generate_series(1, 25000) n;
             INSERT INTO consumption_record (message_key, status, payload_fingerprint, updated_at)
                 VALUES ('25001', 'PROCESSING', 'f', now()), ('25002', 'FAILURE', 'f', now()),
                        ('25003', 'SUCCESS', 'f', now() - interval '2 hours');",
        )
        .await;

    let filter = BitmapPreFilter::new(0);
    let mut reported = Vec::new();
    let read = rebuild_from_records(
        &filter,
        &pool,
        &schema.records(),
        Duration::from_secs(3600),
        |so_far| reported.push(so_far),
    )
    .await
    .unwrap();
    integration_tests::check_rebuilt_filter(&filter, read, &reported);
}
