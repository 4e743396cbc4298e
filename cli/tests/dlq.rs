//! `oncely dlq` against a real RabbitMQ, on dead letters a real runner wrote: listed,
//! filtered, replayed once the handler is fixed (each then processed exactly once), purged;
//! a message that is not oncely's is left in place; a missing queue and a broker that refuses
//! or never answers are clear errors.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{args, assert_code, effects_of, effects_schema, json, oncely, reasons, stderr};
use integration_tests::amqp::{
    amqp_addr, connect, ready_messages, scratch_topology, start_runner, stop_runner,
};
use integration_tests::wait_until;
use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use oncely::dead_letter::{HISTORY, REASON};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{BusinessKey, Delivery, HandlerError, Json, KeyExtractor, Route};
use oncely_amqp::{Producer, Runner};

#[derive(serde::Deserialize)]
struct Order {
    #[allow(dead_code)]
    qty: u32,
}

/// What the handler saw of a replayed copy: its history header, whether it still carried
/// a dead-letter reason, and its attempt number.
type Seen = Arc<Mutex<HashMap<String, (Option<String>, bool, u32)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_replayed_once_and_purged() {
    let (schema, pool) = effects_schema().await;
    let topology = scratch_topology("cli-dlq");
    let queue = topology.queue().to_owned();
    let dlq = topology.dead_letter_queue().to_owned();
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();

    // r-0…r-4 are rejected (dead-lettered at once); t-0 fails, for now, on every attempt
    // (dead-lettered when its attempts run out, on attempt 2).
    let rejecting: Arc<Mutex<HashSet<String>>> = Arc::new(Mutex::new(
        (0..5)
            .map(|i| format!("r-{i}"))
            .chain(["t-0".to_owned()])
            .collect(),
    ));
    let seen: Seen = Arc::default();
    let handler = {
        let (rejecting, seen) = (rejecting.clone(), seen.clone());
        move |tx: PgTransaction, key: BusinessKey, delivery: Delivery, Json(_): Json<Order>| {
            let rejected = rejecting.lock().unwrap().contains(key.as_str());
            let header = |name| {
                delivery
                    .headers()
                    .get(name)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            };
            seen.lock().unwrap().insert(
                key.to_string(),
                (header(HISTORY), header(REASON).is_some(), delivery.attempt()),
            );
            let fails_for_now = key.as_str().starts_with("t-");
            async move {
                if rejected && fails_for_now {
                    return Err(HandlerError::transient("the ledger is down"));
                }
                if rejected {
                    return Err(HandlerError::permanent("no such account"));
                }
                tx.execute("INSERT INTO effects (order_id) VALUES ($1)", &[&key.as_str()])
                    .await?;
                Ok(())
            }
        }
    };
    let stack = PgTransactionalLayer::new(pool, schema.records()).handler(handler);
    let route = Route::new("effects", KeyExtractor::json_pointer("/orderId"), stack).with_max_attempts(2);
    let (shutdown, running) = start_runner(
        Runner::new(route, topology.clone()),
        amqp_addr(),
        "oncely-cli-dlq",
    );

    let producer = Producer::new(connect().await.unwrap());
    let bodies = (0..3)
        .map(|i| format!(r#"{{"orderId":"ok-{i}","qty":1}}"#))
        .chain((0..5).map(|i| format!(r#"{{"orderId":"r-{i}","qty":1}}"#)))
        .chain([r#"{"orderId":"t-0","qty":1}"#.to_owned()])
        .chain((0..2).map(|i| format!(r#"{{"orderId":"b-{i}"}}"#)));
    for body in bodies {
        producer.publish("", &queue, body.as_bytes(), None).await.unwrap();
    }
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, &dlq).await == 8
    })
    .await;

    let list = |more: &[&str]| args(&["--json", "dlq", "list", "--queue", &queue], more);
    let all = json(&oncely(&list(&[])).await);
    assert_eq!(
        reasons(&all),
        [
            "attempts_exhausted",
            "bad_body",
            "bad_body",
            "rejected",
            "rejected",
            "rejected",
            "rejected",
            "rejected"
        ]
    );
    assert_eq!(
        reasons(&json(&oncely(&list(&["--reason", "rejected"])).await)).len(),
        5
    );
    assert_eq!(
        reasons(&json(
            &oncely(&list(&["--route", "effects", "--since", "1h"])).await
        ))
        .len(),
        8
    );
    assert_eq!(
        reasons(&json(&oncely(&list(&["--route", "other"])).await)).len(),
        0
    );
    assert_eq!(reasons(&json(&oncely(&list(&["--limit", "2"])).await)).len(), 2);
    assert_code(&oncely(&list(&["--reason", "panicked"])).await, 2);

    // A message put in the dead-letter queue by hand: not oncely's.
    let foreign = channel
        .basic_publish(
            "".into(),
            dlq.as_str().into(),
            BasicPublishOptions::default(),
            b"by hand",
            BasicProperties::default(),
        )
        .await
        .unwrap();
    foreign.await.unwrap();
    wait_until(Duration::from_secs(5), || async {
        ready_messages(&channel, &dlq).await == 9
    })
    .await;
    assert_eq!(reasons(&json(&oncely(&list(&[])).await))[0], "-");

    let replay = |more: &[&str]| args(&["--json", "dlq", "replay", "--queue", &queue], more);
    let dry = oncely(&replay(&["--reason", "rejected", "--dry-run"])).await;
    assert_code(&dry, 0);
    assert_eq!(json(&dry)["done"].as_array().unwrap().len(), 5);
    wait_until(Duration::from_secs(5), || async {
        ready_messages(&channel, &dlq).await == 9
    })
    .await;
    assert_code(&oncely(&replay(&["--reason", "rejected"])).await, 5);

    // The handler is fixed: the rejected ones are replayed and each processed once.
    rejecting.lock().unwrap().clear();
    let replayed = oncely(&replay(&["--reason", "rejected", "--yes"])).await;
    assert_code(&replayed, 0);
    assert_eq!(json(&replayed)["done"].as_array().unwrap().len(), 5);
    for i in 0..5 {
        let key = format!("r-{i}");
        wait_until(Duration::from_secs(30), || async {
            effects_of(&schema, &key).await == 1
        })
        .await;
        let (history, had_reason, _) = seen.lock().unwrap()[&key].clone();
        let history = history.expect("the replayed copy carries the history");
        assert!(
            history.contains(" rejected: ") && history.contains("no such account"),
            "{history}"
        );
        assert!(!had_reason, "the dead-letter headers are not on the copy");
    }
    for key in ["ok-0", "ok-1", "ok-2"] {
        assert_eq!(effects_of(&schema, key).await, 1);
    }
    assert_eq!(effects_of(&schema, "t-0").await, 0, "not replayed yet");

    // The one whose attempts ran out starts again from attempt 1, not from where it stopped
    // (with the route's 2 attempts, it would otherwise be dead-lettered again at once).
    wait_until(Duration::from_secs(5), || async {
        ready_messages(&channel, &dlq).await == 4
    })
    .await;
    let exhausted = oncely(&replay(&["--reason", "attempts_exhausted", "--yes"])).await;
    assert_code(&exhausted, 0);
    wait_until(Duration::from_secs(30), || async {
        effects_of(&schema, "t-0").await == 1
    })
    .await;
    let (history, _, attempt) = seen.lock().unwrap()["t-0"].clone();
    assert_eq!(attempt, 1, "the attempt counter was reset");
    assert!(history.unwrap().contains(" attempts_exhausted: "));
    wait_until(Duration::from_secs(5), || async {
        ready_messages(&channel, &dlq).await == 3
    })
    .await;
    assert_eq!(
        reasons(&json(&oncely(&list(&[])).await)),
        ["-", "bad_body", "bad_body"]
    );

    // Without a filter, the message that is not oncely's is left in place and reported.
    let mixed = oncely(&replay(&["--dry-run"])).await;
    assert_code(&mixed, 1);
    let mixed = json(&mixed);
    assert_eq!(mixed["done"].as_array().unwrap().len(), 2, "{mixed}");
    assert_eq!(mixed["not_oncely"].as_array().unwrap().len(), 1, "{mixed}");
    assert!(stderr(&oncely(&replay(&["--dry-run"])).await).contains("not oncely's"));

    // Purge: the bad bodies go, the message by hand stays.
    let purge = |more: &[&str]| args(&["--json", "dlq", "purge", "--queue", &queue], more);
    assert_eq!(
        json(&oncely(&purge(&["--reason", "bad_body", "--dry-run"])).await)["done"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_code(&oncely(&purge(&["--reason", "bad_body", "--yes"])).await, 0);
    wait_until(Duration::from_secs(5), || async {
        ready_messages(&channel, &dlq).await == 1
    })
    .await;
    let shown = oncely(&["--json", "dlq", "show", "--queue", &queue, "--position", "1"]).await;
    assert_code(&shown, 0);
    assert_eq!(json(&shown)["body"], "by hand");
    assert_code(
        &oncely(&["dlq", "show", "--queue", &queue, "--id", "no-such-id"]).await,
        3,
    );

    stop_runner(shutdown, running).await;
    topology.delete(&channel).await.unwrap();
}

#[tokio::test]
async fn a_missing_queue_and_an_unreachable_broker_are_errors() {
    let missing = format!("oncely-cli-missing-{}", oncely::Token::random());
    let output = oncely(&["dlq", "list", "--queue", &missing]).await;
    assert_code(&output, 1);
    assert!(stderr(&output).contains("does not exist"), "{}", stderr(&output));
    // Nothing declared: a passive declaration of the dead-letter queue still fails.
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare(
            format!("{missing}.dlq").as_str().into(),
            passive,
            Default::default(),
        )
        .await;
    assert!(declared.is_err(), "the tool declared {missing}.dlq");

    let started = Instant::now();
    let output = oncely(&[
        "--amqp-addr",
        "amqp://guest:guest@127.0.0.1:1/%2f",
        "--timeout",
        "2s",
        "dlq",
        "list",
        "--queue",
        &missing,
    ])
    .await;
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(
        error.contains("127.0.0.1:1") && !error.contains("guest:guest"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));

    // A broker that takes the connection and never answers the handshake.
    let silent = common::silent_server();
    let arguments = [
        "--amqp-addr",
        &format!("amqp://guest:guest@{silent}/%2f"),
        "--timeout",
        "1s",
        "dlq",
        "list",
        "--queue",
        &missing,
    ];
    common::assert_times_out(&arguments, "RabbitMQ", &silent, Duration::from_secs(8)).await;
}
