//! The RocketMQ adapter against a real name server and broker (the Rust ones, started by
//! `services.sh rocketmq`), Redis and PostgreSQL: duplicates by KEYS and by producer
//! re-send, orderly state events behind the state guard, dead letters the producer or the
//! broker refuses, and a batch sharing the record's transaction. Each test has its own
//! topic, consumer group, dead-letter topic, key prefix and schema. What every adapter
//! promises (retries, poison, crashes, the drain's report) is in `adapter_contract.rs`.

use std::time::Duration;

use integration_tests::outcomes::OutcomeLog;
use integration_tests::postgres::{ScratchSchema, pool, schema_pool};
use integration_tests::rocketmq::{ScratchRocketMq, property};
use integration_tests::{redis_connection, redis_url, unique, wait_until};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::state_guard::{PgStateStore, StateGuardLayer, StateMachine};
use oncely::{BusinessKey, Envelope, HandlerError, KeyExtractor, Outcome, Route, handler_fn};
use oncely_rocketmq::rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use oncely_rocketmq::{ConcurrentListener, OrderlyListener};
use tokio::runtime::Handle;
use tower::ServiceBuilder;

/// What a payment message carries; the points are its amount.
fn payment_body(order: usize) -> Vec<u8> {
    format!(
        r#"{{"orderId":"order_{order}","userId":"user_{}","amount":{order}}}"#,
        order % 7
    )
    .into_bytes()
}

/// A schema with the points ledger. No unique index on `order_id`, so that an order
/// credited twice would show as two rows.
async fn points_schema() -> ScratchSchema {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE points (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, attempt INTEGER NOT NULL)")
        .await;
    schema
}

/// The points route: keyed by the message's KEYS, through the Redis flag and the PostgreSQL
/// record in transactional mode, logging outcomes, to a handler that credits the points in
/// the record's transaction.
async fn points_route(
    schema: &ScratchSchema,
    log: &OutcomeLog,
) -> Route<
    impl tower::Service<Envelope, Response = Outcome, Error = std::convert::Infallible, Future: Send>
    + Clone
    + Send
    + Sync
    + use<>,
> {
    let flags = RedisFlagStore::new(redis_connection(&redis_url()).await).with_prefix(unique("oncely-test"));
    let handler = handler_fn(move |envelope: Envelope| async move {
        let attempt = envelope.delivery().attempt();
        let tx = envelope
            .extensions()
            .get::<PgTransaction>()
            .expect("the record tier")
            .clone();
        tx.client()
            .execute(
                "INSERT INTO points (order_id, attempt) VALUES ($1, $2)",
                &[
                    &envelope.key().as_str(),
                    &i32::try_from(attempt).unwrap_or(i32::MAX),
                ],
            )
            .await?;
        Ok::<(), HandlerError>(())
    });
    let stack = ServiceBuilder::new()
        .layer(log.clone())
        .layer(FlagLayer::new(flags, Duration::from_secs(600)).with_lease(Duration::from_secs(5)))
        .layer(PgTransactionalLayer::new(
            schema_pool(schema.name(), 4),
            schema.records(),
        ))
        .service(handler);
    Route::new("credit_points", KeyExtractor::broker_key(), stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_by_keys_and_producer_resends_credit_each_order_once() {
    const ORDERS: usize = 30;
    let schema = points_schema().await;
    let log = OutcomeLog::new();
    let mut rocketmq = ScratchRocketMq::new("duplicates").await;

    // Each order three times: the original, a producer re-send of it (the same UNIQ_KEY, as
    // the client's own send retry makes), and a re-sent order (a new id, the same KEYS).
    for order in 0..ORDERS {
        let key = format!("order_{order}");
        let mut original = rocketmq.message(Some(&key), &payment_body(order));
        MessageClientIDSetter::set_uniq_id(&mut original);
        rocketmq.send(original.clone()).await;
        rocketmq.send(original).await;
        rocketmq
            .send(rocketmq.message(Some(&key), &payment_body(order)))
            .await;
    }

    let route = points_route(&schema, &log).await;
    let listener = ConcurrentListener::new(route, Handle::current(), rocketmq.dead_letters());
    let (topic, group) = (rocketmq.topic.clone(), rocketmq.group.clone());
    rocketmq.consume_concurrently(&topic, &group, listener).await;

    // A copy handled while its original is still in flight is retried by the broker (10 s),
    // and comes back as a duplicate.
    wait_until(Duration::from_secs(90), || async {
        log.count(Outcome::is_settled) >= 3 * ORDERS
    })
    .await;
    assert_eq!(log.count(|outcome| *outcome == Outcome::Processed), ORDERS);
    assert_eq!(
        log.count(|outcome| !outcome.is_settled()),
        log.count(|outcome| matches!(outcome.retry_reason(), Some(oncely::RetryReason::InFlight(_)))),
        "the only retries are copies that met their original in flight: {:?}",
        log.entries()
    );
    assert_eq!(
        log.count(|outcome| matches!(outcome, Outcome::Duplicate { .. })),
        2 * ORDERS,
        "every copy answered as a duplicate and acknowledged: {:?}",
        log.entries()
    );
    assert_eq!(schema.count("SELECT count(*) FROM points").await, ORDERS as i64);
    assert_eq!(
        schema.count("SELECT count(DISTINCT order_id) FROM points").await,
        ORDERS as i64
    );
    assert_eq!(
        schema
            .count("SELECT count(*) FROM consumption_record WHERE status = 'SUCCESS'")
            .await,
        ORDERS as i64
    );
    rocketmq.shutdown().await;
}

const LIFECYCLE: [&str; 4] = ["Created", "Paid", "Shipped", "Completed"];

/// The `n`-th of the 24 orders of the four lifecycle states (factorial number system).
fn shuffled_lifecycle(mut n: usize) -> Vec<&'static str> {
    let mut left = LIFECYCLE.to_vec();
    let mut order = Vec::with_capacity(LIFECYCLE.len());
    for radix in (1..=LIFECYCLE.len()).rev() {
        order.push(left.remove(n % radix));
        n /= radix;
    }
    order
}

/// What a forward-only guard applies of `events`, taken in order: each event that moves
/// past every state applied before it.
fn forward_subsequence(events: &[&'static str]) -> Vec<&'static str> {
    let rank = |state: &str| LIFECYCLE.iter().position(|known| *known == state);
    let mut applied: Vec<&'static str> = Vec::new();
    for event in events {
        if applied.last().is_none_or(|last| rank(event) > rank(last)) {
            applied.push(event);
        }
    }
    applied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orderly_listener_applies_only_forward_transitions_and_acknowledges_stale_ones() {
    const SHIPMENTS: usize = 24;
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE transitions (id BIGSERIAL PRIMARY KEY, shipment TEXT NOT NULL, state TEXT NOT NULL)")
        .await;
    let log = OutcomeLog::new();
    let mut rocketmq = ScratchRocketMq::new("orderly").await;

    let mut expected = Vec::new();
    for shipment in 0..SHIPMENTS {
        let events = shuffled_lifecycle(shipment);
        for state in &events {
            let body = format!(r#"{{"shipment":"s-{shipment}","state":"{state}"}}"#);
            rocketmq
                .send_to_queue(rocketmq.message(None, body.as_bytes()), shipment)
                .await;
        }
        expected.push(forward_subsequence(&events));
    }

    let pool = schema_pool(schema.name(), 4);
    let handler = handler_fn({
        let pool = pool.clone();
        move |envelope: Envelope| {
            let pool = pool.clone();
            async move {
                let event: serde_json::Value =
                    serde_json::from_slice(envelope.delivery().body()).map_err(HandlerError::permanent)?;
                let client = pool.get().await?;
                client
                    .execute(
                        "INSERT INTO transitions (shipment, state) VALUES ($1, $2)",
                        &[&event["shipment"].as_str(), &event["state"].as_str()],
                    )
                    .await?;
                Ok::<(), HandlerError>(())
            }
        }
    });
    let guard = StateGuardLayer::new(
        PgStateStore::new(pool, schema.table("entity_state")),
        StateMachine::forward_only(LIFECYCLE).unwrap(),
        KeyExtractor::json_pointer("/shipment"),
        KeyExtractor::json_pointer("/state"),
    );
    let stack = ServiceBuilder::new()
        .layer(log.clone())
        .layer(guard)
        .service(handler);
    let route = Route::new(
        "shipments",
        KeyExtractor::template("{/shipment}:{/state}").unwrap(),
        stack,
    );
    let listener = OrderlyListener::new(route, Handle::current(), rocketmq.dead_letters());
    let (topic, group) = (rocketmq.topic.clone(), rocketmq.group.clone());
    rocketmq.consume_orderly(&topic, &group, listener).await;

    let events = SHIPMENTS * LIFECYCLE.len();
    wait_until(Duration::from_secs(60), || async { log.len() >= events }).await;
    let applied: usize = expected.iter().map(Vec::len).sum();
    assert_eq!(log.count(|outcome| *outcome == Outcome::Processed), applied);
    assert_eq!(
        log.count(|outcome| matches!(outcome, Outcome::Stale { .. })),
        events - applied,
        "every backward event acknowledged as stale"
    );
    for (shipment, expected) in expected.iter().enumerate() {
        let client = schema_pool(schema.name(), 1).get().await.unwrap();
        let states: Vec<String> = client
            .query(
                "SELECT state FROM transitions WHERE shipment = $1 ORDER BY id",
                &[&format!("s-{shipment}")],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(
            states, *expected,
            "shipment s-{shipment} applied in queue order, forward only"
        );
    }
    rocketmq.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_too_big_for_its_producer_is_cut_to_fit_not_retried_forever() {
    let mut rocketmq = ScratchRocketMq::new("oversize").await;
    let dead_letters = rocketmq.collect_dead_letters().await;
    // 6 MiB that compress to almost nothing: a producer allowed 8 MiB sends it, the broker
    // stores it compressed, and the route refuses it as oversize. The dead-letter producer
    // takes at most the client's default of 4 MiB.
    let mut big = rocketmq.producer_for_bodies_up_to(8 << 20).await;
    let body = vec![b'7'; 6 << 20];
    big.send(rocketmq.message(Some("order_1"), &body)).await.unwrap();
    let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
    let route = Route::new("oversize", KeyExtractor::broker_key(), handler).with_max_body_len(1 << 20);
    let listener = ConcurrentListener::new(route, Handle::current(), rocketmq.dead_letters());
    let (topic, group) = (rocketmq.topic.clone(), rocketmq.group.clone());
    rocketmq.consume_concurrently(&topic, &group, listener).await;
    wait_until(Duration::from_secs(60), || async {
        !dead_letters.lock().unwrap().is_empty()
    })
    .await;
    // Time for the copies a retry would have written (the broker's first retry is at 10 s).
    tokio::time::sleep(Duration::from_secs(12)).await;
    let dead = dead_letters.lock().unwrap().clone();
    assert_eq!(dead.len(), 1, "dead-lettered once, at its first delivery");
    assert_eq!(
        property(&dead[0], oncely::dead_letter::REASON).as_deref(),
        Some("oversize")
    );
    let cut = property(&dead[0], oncely::dead_letter::BODY_CUT).expect("the copy says its body was cut");
    assert!(
        cut.contains(&format!("first {} of {} bytes", 4 << 20, 6 << 20)),
        "{cut}"
    );
    assert_eq!(dead[0].body().as_deref(), Some(&body[..4 << 20]));
    big.shutdown().await;
    rocketmq.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_broker_does_not_store_is_retried_not_acknowledged() {
    let log = OutcomeLog::new();
    let mut rocketmq = ScratchRocketMq::new("unstored").await;
    rocketmq
        .send(rocketmq.message(Some("order_1"), &payment_body(1)))
        .await;

    let attempts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler = handler_fn({
        let attempts = attempts.clone();
        move |envelope: Envelope| {
            attempts.lock().unwrap().push(envelope.delivery().attempt());
            async { Err::<(), _>(HandlerError::permanent("unprocessable")) }
        }
    });
    let route = Route::new(
        "rejects",
        KeyExtractor::broker_key(),
        ServiceBuilder::new().layer(log.clone()).service(handler),
    );
    // A topic name RocketMQ refuses, so that every dead-letter send fails.
    let unstorable =
        oncely_rocketmq::DeadLetterTopic::new((*rocketmq.producer()).clone(), "no spaces allowed");
    let listener = ConcurrentListener::new(route, Handle::current(), unstorable);
    let (topic, group) = (rocketmq.topic.clone(), rocketmq.group.clone());
    rocketmq.consume_concurrently(&topic, &group, listener).await;

    // The broker's first retry level is 10 s.
    wait_until(Duration::from_secs(90), || async { log.len() >= 2 }).await;
    assert_eq!(
        attempts.lock().unwrap()[..2],
        [1, 2],
        "the rejected message came back"
    );
    assert!(
        log.entries()
            .iter()
            .all(|(_, outcome)| outcome.dead_letter_reason() == Some(oncely::DeadLetterReason::Rejected))
    );
    rocketmq.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_listeners_batch_shares_the_batched_records_transaction() {
    const ORDERS: usize = 64;
    const BATCH: u32 = 16;
    let schema = points_schema().await;
    let mut rocketmq = ScratchRocketMq::new("batched").await.with_batch_size(BATCH);
    // One queue: the listener gets full batches of what is waiting.
    rocketmq.create_topics(1).await;
    for order in 0..ORDERS {
        let key = format!("order_{order}");
        rocketmq
            .send(rocketmq.message(Some(&key), &payment_body(order)))
            .await;
        if order % 8 == 0 {
            // A re-sent order: its copy is in the same batch or the next.
            rocketmq
                .send(rocketmq.message(Some(&key), &payment_body(order)))
                .await;
        }
    }
    let credit = |tx: PgTransaction, key: BusinessKey| async move {
        tx.execute(
            "INSERT INTO points (order_id, attempt) VALUES ($1, 1)",
            &[&key.as_str()],
        )
        .await?;
        Ok::<(), HandlerError>(())
    };
    let records = PgTransactionalLayer::new(schema_pool(schema.name(), 8), schema.records()).batched();
    let route = Route::new(
        "credit_points",
        KeyExtractor::broker_key(),
        records.handler(credit),
    );
    let listener = ConcurrentListener::new(route, Handle::current(), rocketmq.dead_letters());
    let (topic, group) = (rocketmq.topic.clone(), rocketmq.group.clone());
    rocketmq.consume_concurrently(&topic, &group, listener).await;

    wait_until(Duration::from_secs(90), || async {
        schema.count("SELECT count(*) FROM points").await >= ORDERS as i64
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        schema.count("SELECT count(DISTINCT order_id) FROM points").await,
        ORDERS as i64
    );
    assert_eq!(
        schema.count("SELECT count(*) FROM points").await,
        ORDERS as i64,
        "every order credited once"
    );
    let commits = schema
        .count("SELECT count(DISTINCT xmin::text) FROM consumption_record WHERE status = 'SUCCESS'")
        .await;
    assert!(
        commits <= 2 * (ORDERS as i64) / i64::from(BATCH),
        "{ORDERS} orders in batches of {BATCH} took {commits} commits"
    );
    rocketmq.shutdown().await;
}
