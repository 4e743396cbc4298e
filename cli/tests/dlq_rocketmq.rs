//! `oncely dlq --topic` against a real RocketMQ name server and broker, on dead letters a
//! real listener wrote: listed (twice: reading changes nothing), replayed once the handler
//! is fixed (each then processed exactly once, under its original message id, with the
//! reason in its history, and sent exactly once), purged; dead letters left in place
//! between those handled are written again and listed exactly once; a message that is not
//! oncely's stays; a missing topic and a name server that refuses or never answers are clear
//! errors.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{args, assert_code, code, effects_of, effects_schema, json, oncely, reasons, stderr};
use integration_tests::rocketmq::{ScratchRocketMq, message, namesrv_addr};
use integration_tests::wait_until;
use oncely::dead_letter::{HISTORY, REASON};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{BusinessKey, Delivery, HandlerError, Json, KeyExtractor, Route};
use oncely_rocketmq::OrderlyListener;
use serde_json::Value;
use tokio::runtime::Handle;

#[derive(serde::Deserialize)]
struct Order {
    #[allow(dead_code)]
    qty: u32,
}

/// What the handler saw of each key's last delivery: its message id, its history property,
/// and whether it still carried a dead-letter reason.
type Seen = Arc<Mutex<HashMap<String, (Option<String>, Option<String>, bool)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_topic_are_listed_replayed_once_and_purged() {
    let (schema, pool) = effects_schema().await;
    let mut rocketmq = ScratchRocketMq::new("cli_dlq").await;
    // One queue and an orderly listener: the dead letters lie in the order sent, so that
    // those a replay leaves in place lie between those it handles.
    rocketmq.create_topics(1).await;
    let topic = rocketmq.dead_letter_topic.clone();

    let rejecting = Arc::new(Mutex::new(true));
    let seen: Seen = Arc::default();
    let handler = {
        let (rejecting, seen) = (rejecting.clone(), seen.clone());
        move |tx: PgTransaction, key: BusinessKey, delivery: Delivery, Json(_): Json<Order>| {
            let rejected = key.as_str().starts_with("r-") && *rejecting.lock().unwrap();
            let header = |name| {
                delivery
                    .headers()
                    .get(name)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            };
            seen.lock().unwrap().insert(
                key.to_string(),
                (
                    delivery.message_id().map(str::to_owned),
                    header(HISTORY),
                    header(REASON).is_some(),
                ),
            );
            async move {
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
    let route = Route::new("effects", KeyExtractor::broker_key(), stack);
    let listener = OrderlyListener::new(route, Handle::current(), rocketmq.dead_letters());
    let (work_topic, group) = (rocketmq.topic.clone(), rocketmq.group.clone());
    rocketmq.consume_orderly(&work_topic, &group, listener).await;

    // Dead letters in this order: r-0 b-0 r-1 b-1 r-2 r-3 r-4.
    let mut original_ids = HashMap::new();
    for (key, body) in [
        ("ok-0", &br#"{"qty":1}"#[..]),
        ("r-0", br#"{"qty":1}"#),
        ("b-0", b"not json"),
        ("r-1", br#"{"qty":1}"#),
        ("ok-1", br#"{"qty":1}"#),
        ("b-1", b"not json"),
        ("r-2", br#"{"qty":1}"#),
        ("r-3", br#"{"qty":1}"#),
        ("ok-2", br#"{"qty":1}"#),
        ("r-4", br#"{"qty":1}"#),
    ] {
        let id = rocketmq.send(rocketmq.message(Some(key), body)).await;
        original_ids.insert(key.to_owned(), id);
    }
    original_ids.retain(|key, _| key.starts_with("r-"));

    let list = |more: &[&str]| args(&["--json", "dlq", "list", "--topic", &topic], more);
    let read = |arguments: Vec<String>| async move {
        let output = oncely(&arguments).await;
        match code(&output) {
            0 => json(&output)["read"].as_u64().unwrap_or_default(),
            _ => 0,
        }
    };
    wait_until(Duration::from_secs(60), || async { read(list(&[])).await >= 7 }).await;
    let all = json(&oncely(&list(&[])).await);
    assert_eq!(
        reasons(&all),
        [
            "bad_body", "bad_body", "rejected", "rejected", "rejected", "rejected", "rejected"
        ],
        "listing twice shows the same: reading moves no offset"
    );
    assert_eq!(all["dead_letters"][0]["source"], work_topic.as_str());
    assert_eq!(
        reasons(&json(&oncely(&list(&["--reason", "rejected"])).await)).len(),
        5
    );
    assert_eq!(
        reasons(&json(
            &oncely(&list(&["--route", "effects", "--since", "1h"])).await
        ))
        .len(),
        7
    );
    assert_eq!(
        reasons(&json(&oncely(&list(&["--route", "other"])).await)).len(),
        0
    );
    let limited = json(&oncely(&list(&["--limit", "2"])).await);
    assert_eq!((reasons(&limited).len(), &limited["read"]), (2, &Value::from(2)));

    // A message put in the dead-letter topic by hand: not oncely's.
    rocketmq.send(message(&topic, None, b"by hand")).await;
    wait_until(Duration::from_secs(10), || async { read(list(&[])).await == 8 }).await;

    let replay = |more: &[&str]| args(&["--json", "dlq", "replay", "--topic", &topic], more);
    let dry = oncely(&replay(&["--reason", "rejected", "--dry-run"])).await;
    assert_code(&dry, 0);
    assert_eq!(json(&dry)["done"].as_array().unwrap().len(), 5);
    assert_code(&oncely(&replay(&["--reason", "rejected"])).await, 5);
    assert_eq!(json(&oncely(&list(&[])).await)["read"], 8, "nothing changed");

    // The handler is fixed: the rejected ones are replayed and each processed once.
    *rejecting.lock().unwrap() = false;
    let replayed = oncely(&replay(&["--reason", "rejected", "--yes"])).await;
    assert_code(&replayed, 0);
    let replayed = json(&replayed);
    assert_eq!(replayed["done"].as_array().unwrap().len(), 5);
    assert_eq!(
        replayed["written_again"], 2,
        "b-0 and b-1 lay between the rejected ones"
    );
    for (key, original_id) in &original_ids {
        wait_until(Duration::from_secs(60), || async {
            effects_of(&schema, key).await == 1
        })
        .await;
        let (message_id, history, had_reason) = seen.lock().unwrap()[key].clone();
        assert_eq!(
            message_id.as_ref(),
            Some(original_id),
            "the copy keeps the original's id"
        );
        let history = history.expect("the replayed copy carries the history");
        assert!(
            history.contains(" rejected: ") && history.contains("no such account"),
            "{history}"
        );
        assert!(!had_reason, "the dead-letter properties are not on the copy");
    }
    for key in ["ok-0", "ok-1", "ok-2", "b-0", "b-1"] {
        assert_eq!(effects_of(&schema, key).await, i64::from(key.starts_with("ok")));
    }
    // Those left in place are listed once each, wherever they lay between the replayed ones,
    // and a second replay finds nothing: the operator group's offsets were stored.
    assert_eq!(
        reasons(&json(&oncely(&list(&[])).await)),
        ["-", "bad_body", "bad_body"]
    );
    let again = oncely(&replay(&["--reason", "rejected", "--yes"])).await;
    assert_code(&again, 0);
    assert_eq!(json(&again)["done"].as_array().unwrap().len(), 0);
    // Each replayed once: the work topic holds the 10 originals and 5 copies, read whole by
    // the tool's own group on it.
    let work = oncely(&["--json", "dlq", "list", "--topic", &work_topic]).await;
    assert_eq!(json(&work)["read"], 15);

    // Without a filter, the message that is not oncely's is left in place and reported.
    let mixed = oncely(&replay(&["--dry-run"])).await;
    assert_code(&mixed, 1);
    assert_eq!(json(&mixed)["not_oncely"].as_array().unwrap().len(), 1);

    // Purge: the bad bodies go, the message by hand stays.
    let purge = args(
        &["--json", "dlq", "purge", "--topic", &topic],
        &["--reason", "bad_body", "--yes"],
    );
    let purged = oncely(&purge).await;
    assert_code(&purged, 0);
    assert_eq!(
        json(&purged)["written_again"],
        1,
        "the message by hand lay before them"
    );
    assert_eq!(reasons(&json(&oncely(&list(&[])).await)), ["-"]);
    let shown = oncely(&["--json", "dlq", "show", "--topic", &topic, "--position", "1"]).await;
    assert_code(&shown, 0);
    assert_eq!(json(&shown)["body"], "by hand");
    for key in ["b-0", "b-1"] {
        assert_eq!(effects_of(&schema, key).await, 0, "a purge replays nothing");
    }
    // Everything since, the second replay and the purge included, applied nothing twice.
    for key in original_ids
        .keys()
        .map(String::as_str)
        .chain(["ok-0", "ok-1", "ok-2"])
    {
        assert_eq!(effects_of(&schema, key).await, 1, "{key}");
    }

    rocketmq.shutdown().await;
}

#[tokio::test]
async fn a_missing_topic_and_an_unreachable_name_server_are_errors() {
    let missing = format!("oncely_cli_missing_{}", oncely::Token::random());
    let output = oncely(&["dlq", "list", "--topic", &missing]).await;
    assert_code(&output, 1);
    assert!(stderr(&output).contains("does not exist"), "{}", stderr(&output));
    assert!(stderr(&output).contains(&namesrv_addr()), "{}", stderr(&output));

    let started = Instant::now();
    let output = oncely(&[
        "--rocketmq-namesrv",
        "127.0.0.1:1",
        "--timeout",
        "2s",
        "dlq",
        "list",
        "--topic",
        &missing,
    ])
    .await;
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(
        error.contains("127.0.0.1:1") && !error.contains("does not exist"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(15));

    // A name server that takes the connection and never answers: not a missing topic,
    // also with a timeout longer than the client's own default (3 s).
    let silent = common::silent_server();
    let arguments = [
        "--rocketmq-namesrv",
        &silent,
        "--timeout",
        "4s",
        "dlq",
        "list",
        "--topic",
        &missing,
    ];
    common::assert_times_out(&arguments, "RocketMQ", &silent, Duration::from_secs(15)).await;
}
