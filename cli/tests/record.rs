//! `oncely inspect`, `stuck`, `release`, `mark-done`, `stats` and `purge` against real
//! PostgreSQL and Redis, on stacks that really ran; each test in a schema and Redis prefix
//! of its own.

mod common;

use std::time::Duration;

use common::{assert_code, effects_of, effects_schema, json, oncely, stderr};
use deadpool_postgres::Pool;
use integration_tests::amqp::orders_route;
use integration_tests::postgres::stock_schema;
use integration_tests::{redis_connection, redis_url, unique};
use oncely::postgres::Table;
use oncely::record::{
    PgRecordStore, PgTransaction, PgTransactionalLayer, RecordLayer, RecordStore, RetentionRunner,
    RetentionStore,
};
use oncely::{
    BusinessKey, Delivery, Envelope, Fingerprint, HandlerError, KeyExtractor, Outcome, Route, Source,
};
use tower::ServiceBuilder;

fn order(id: &str) -> Delivery {
    Delivery::new(
        Source::new("orders"),
        format!(r#"{{"orderId":"{id}","sku":"sku-1"}}"#),
    )
}

/// The transactional record in front of a handler writing one `effects` row per key.
fn transactional_route(
    pool: Pool,
    records: Table,
) -> Route<impl integration_tests::RouteStack<std::convert::Infallible> + use<>> {
    async fn effect(tx: PgTransaction, key: BusinessKey) -> Result<(), HandlerError> {
        tx.execute("INSERT INTO effects (order_id) VALUES ($1)", &[&key.as_str()])
            .await?;
        Ok(())
    }
    let stack = PgTransactionalLayer::new(pool, records).handler(effect);
    Route::new("effects", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The three-step record (`store`) in front of a handler writing one `effects` row per key.
fn three_step_route(
    pool: Pool,
    store: PgRecordStore,
) -> Route<impl integration_tests::RouteStack<std::convert::Infallible> + use<>> {
    let handler = oncely::handler_fn(move |envelope: Envelope| {
        let pool = pool.clone();
        async move {
            pool.get()
                .await?
                .execute(
                    "INSERT INTO effects (order_id) VALUES ($1)",
                    &[&envelope.key().as_str()],
                )
                .await?;
            Ok::<(), HandlerError>(())
        }
    });
    let stack = ServiceBuilder::new()
        .layer(RecordLayer::new(store))
        .service(handler);
    Route::new("effects", KeyExtractor::json_pointer("/orderId"), stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_record_the_flag_and_the_lock_of_a_processed_key() {
    let (schema, pool) = stock_schema(4).await;
    let prefix = unique("oncely-cli");
    let route = orders_route(
        pool,
        schema.records(),
        redis_connection(&redis_url()).await,
        &prefix,
    );
    assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);

    let args = [
        "--json",
        "--schema",
        schema.name(),
        "--redis-prefix",
        &prefix,
        "inspect",
    ];
    let output = oncely(&[&args[..], &["o-1", "--entity", "sku-1"]].concat()).await;
    assert_code(&output, 0);
    let view = json(&output);
    assert_eq!(view["record"]["status"], "SUCCESS", "{view}");
    assert_eq!(view["record"]["attempts"], 1, "{view}");
    assert_eq!(view["flag"]["state"], "done", "{view}");
    assert!(view["flag"]["ttl_ms"].as_u64().unwrap() > 0, "{view}");
    assert!(view["lock"]["holder"].is_null(), "released after the run: {view}");
    assert!(view["lock"]["fencing_counter"].as_u64().unwrap() > 0, "{view}");

    let unknown = oncely(&[&args[..], &["o-unknown"]].concat()).await;
    assert_code(&unknown, 3);
    assert!(stderr(&unknown).contains("unknown"), "{}", stderr(&unknown));

    // A Redis that does not answer hides nothing PostgreSQL said, and the exit says so.
    let no_redis = [&args[..], &["o-1", "--redis-url", "redis://127.0.0.1:1"]].concat();
    let output = oncely(&no_redis).await;
    assert_code(&output, 1);
    let view = json(&output);
    assert_eq!(view["record"]["status"], "SUCCESS", "{view}");
    assert_eq!(view["unavailable"][0]["store"], "Redis", "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_keys_are_listed_then_released_or_marked_done() {
    let (schema, pool) = effects_schema().await;
    let store = PgRecordStore::new(pool.clone(), schema.records());
    // Two attempts whose consumers died: begun with a lease that runs out at once.
    for key in ["k-released", "k-done"] {
        let body = order(key).body().clone();
        store
            .begin(
                &BusinessKey::new(key),
                Fingerprint::of(&body),
                Duration::from_millis(1),
                None,
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let running = order("k-running").body().clone();
    store
        .begin(
            &BusinessKey::new("k-running"),
            Fingerprint::of(&running),
            Duration::from_secs(600),
            None,
        )
        .await
        .unwrap();
    let args = ["--json", "--schema", schema.name()];
    let run = |more: &[&str]| common::args(&args, more);

    let stuck = json(&oncely(&run(&["stuck"])).await);
    assert_eq!(stuck["total"], 2, "{stuck}");
    assert_eq!(
        stuck["rows"][0]["key"], "k-released",
        "oldest lease first: {stuck}"
    );
    assert_eq!(stuck["rows"][1]["key"], "k-done", "{stuck}");

    // No --yes and nobody to answer: declined, nothing changed.
    assert_code(&oncely(&run(&["release", "k-released"])).await, 5);
    assert_code(&oncely(&run(&["release", "k-running", "--yes"])).await, 1);
    assert_code(&oncely(&run(&["release", "k-unknown", "--yes"])).await, 3);

    assert_code(&oncely(&run(&["release", "k-released", "--yes"])).await, 0);
    assert_code(&oncely(&run(&["mark-done", "k-done", "--yes"])).await, 0);
    let released = json(&oncely(&run(&["inspect", "k-released"])).await);
    assert_eq!(released["record"]["status"], "FAILURE", "{released}");
    assert_eq!(json(&oncely(&run(&["stuck"])).await)["total"], 0);

    let route = three_step_route(pool, store);
    assert_eq!(route.handle(order("k-released")).await, Outcome::Processed);
    assert!(matches!(
        route.handle(order("k-done")).await,
        Outcome::Duplicate { .. }
    ));
    assert_eq!(effects_of(&schema, "k-released").await, 1, "run again once");
    assert_eq!(effects_of(&schema, "k-done").await, 0, "a duplicate now");

    // Settled rows: release refuses, mark-done has nothing to do.
    assert_code(&oncely(&run(&["release", "k-done", "--yes"])).await, 1);
    let again = oncely(&run(&["mark-done", "k-done", "--yes"])).await;
    assert_code(&again, 0);
    assert_eq!(json(&again)["changed"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_count_the_table() {
    let (schema, _pool) = effects_schema().await;
    schema
        .execute(
            "INSERT INTO consumption_record (message_key, status, payload_fingerprint, lease_until, updated_at)
             VALUES ('s1', 'SUCCESS', '0', NULL, now() - interval '3 days'),
                    ('s2', 'SUCCESS', '0', NULL, now()),
                    ('s3', 'SUCCESS', '0', NULL, now()),
                    ('f1', 'FAILURE', '0', NULL, now()),
                    ('f2', 'FAILURE', '0', NULL, now()),
                    ('p1', 'PROCESSING', '0', now() - interval '1 minute', now()),
                    ('p2', 'PROCESSING', '0', now() + interval '1 minute', now())",
        )
        .await;
    let output = oncely(&["--json", "--schema", schema.name(), "stats"]).await;
    assert_code(&output, 0);
    let stats = json(&output);
    assert_eq!(stats["success"], 3, "{stats}");
    assert_eq!(stats["failure"], 2, "{stats}");
    assert_eq!(stats["processing"], 2, "{stats}");
    assert_eq!(stats["stuck"], 1, "{stats}");
    assert!(stats["table_bytes"].as_u64().unwrap() > 0, "{stats}");
    let horizon = stats["retention_horizon"].as_str().unwrap();
    let horizon = humantime::parse_rfc3339(horizon).unwrap();
    let age = horizon.elapsed().unwrap();
    assert!(
        age > Duration::from_secs(3 * 86_400 - 60),
        "the oldest SUCCESS: {stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_old_successes_only_and_races_live_consumers_without_reapplying() {
    let (schema, pool) = effects_schema().await;
    let route = transactional_route(pool.clone(), schema.records());
    for i in 0..300 {
        assert_eq!(route.handle(order(&format!("old-{i}"))).await, Outcome::Processed);
    }
    for i in 0..10 {
        assert_eq!(
            route.handle(order(&format!("recent-{i}"))).await,
            Outcome::Processed
        );
    }
    schema
        .execute(
            "UPDATE consumption_record SET updated_at = now() - interval '40 days' WHERE message_key LIKE 'old-%';
             INSERT INTO consumption_record (message_key, status, payload_fingerprint, lease_until, updated_at)
             VALUES ('old-processing', 'PROCESSING', '0', now() - interval '40 days', now() - interval '40 days'),
                    ('old-failure', 'FAILURE', '0', NULL, now() - interval '40 days')",
        )
        .await;
    let args = [
        "--json",
        "--schema",
        schema.name(),
        "purge",
        "--older-than",
        "30d",
    ];
    assert_code(&oncely(&args).await, 5);
    // Under a day: refused without --force, nothing purged.
    let hasty = ["--schema", schema.name(), "purge", "--older-than", "1h", "--yes"];
    assert_code(&oncely(&hasty).await, 1);
    assert_eq!(
        schema
            .count("SELECT count(*) FROM consumption_record WHERE message_key LIKE 'old-%'")
            .await,
        302
    );

    // Another runner holds the retention lock: busy, nothing purged.
    let other = PgRecordStore::new(pool.clone(), schema.records())
        .lead()
        .await
        .unwrap();
    let busy = oncely(&[&args[..], &["--yes"]].concat()).await;
    assert_code(&busy, 4);
    other.expect("the lock was free").step_down().await.unwrap();

    // New keys, each delivered twice, while the purge runs in small batches.
    let consumer = tokio::spawn({
        let route = route.clone();
        async move {
            for i in 0..150 {
                let key = format!("new-{i}");
                assert_eq!(route.handle(order(&key)).await, Outcome::Processed);
                let again = route.handle(order(&key)).await;
                assert!(matches!(again, Outcome::Duplicate { .. }), "{again:?}");
            }
        }
    });
    let output = oncely(&[&args[..], &["--yes", "--batch-rows", "10"]].concat()).await;
    consumer.await.unwrap();
    assert_code(&output, 0);
    let report = json(&output);
    assert_eq!(report["rows"], 300, "{report}");
    assert!(report["batches"].as_u64().unwrap() >= 30, "{report}");

    let rows =
        |pattern: &str| format!("SELECT count(*) FROM consumption_record WHERE message_key LIKE '{pattern}'");
    assert_eq!(
        schema.count(&rows("old-%")).await,
        2,
        "PROCESSING and FAILURE stay"
    );
    assert_eq!(schema.count(&rows("recent-%")).await, 10);
    assert_eq!(schema.count(&rows("new-%")).await, 150);
    let reapplied = schema
        .count("SELECT count(*) FROM (SELECT order_id FROM effects GROUP BY order_id HAVING count(*) <> 1) AS twice")
        .await;
    assert_eq!(reapplied, 0, "every key applied exactly once");
    assert_eq!(
        schema
            .count("SELECT count(*) FROM effects WHERE order_id LIKE 'new-%'")
            .await,
        150
    );
}

#[tokio::test]
async fn a_database_that_does_not_answer_is_an_error_naming_it() {
    let started = std::time::Instant::now();
    let output = oncely(&[
        "--database-url",
        "postgres://postgres:secret@127.0.0.1:1/test",
        "--timeout",
        "2s",
        "stats",
    ])
    .await;
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(
        error.contains("127.0.0.1:1") && !error.contains("secret"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // A schema name that could not be one: a usage error, nothing run.
    assert_code(&oncely(&["--schema", "Bad-Name", "stats"]).await, 2);
}

/// The operator decided on the row as `stuck` showed it: a delivery that took the key over
/// meanwhile (a new attempt with a running lease) wins, and neither `release` nor
/// `mark-done` changes the row under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_taken_over_after_the_operator_looked_is_left_alone() {
    let (schema, pool) = effects_schema().await;
    let store = PgRecordStore::new(pool.clone(), schema.records());
    let admin = oncely::record::PgRecordAdmin::new(pool, schema.records());
    let key = BusinessKey::new("k-taken-over");
    let fingerprint = Fingerprint::of(order("k-taken-over").body());
    store
        .begin(&key, fingerprint, Duration::from_millis(1), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let seen = admin.inspect(key.as_str()).await.unwrap().expect("the stuck row");

    // The redelivery takes the key over while the operator reads the prompt.
    let took_over = store
        .begin(&key, fingerprint, Duration::from_secs(600), None)
        .await
        .unwrap();
    assert!(
        matches!(took_over, oncely::record::Begin::Started { .. }),
        "{took_over:?}"
    );
    assert!(!admin.release(&seen, false).await.unwrap());
    assert!(!admin.mark_done(&seen, false).await.unwrap());
    // Forced, the decision still applies to the attempt seen only.
    assert!(!admin.release(&seen, true).await.unwrap());
    let now = admin.inspect(key.as_str()).await.unwrap().unwrap();
    assert_eq!(
        (now.status, now.attempts),
        (oncely::record::RecordStatus::Processing, 2)
    );
}
