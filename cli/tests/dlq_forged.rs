//! Dead-letter headers a producer forges: the runner drops a producer's on the way in (its
//! handler never sees them, its dead letter carries oncely's own), and `oncely dlq` never
//! takes a letter RabbitMQ dead-lettered itself for oncely's, whatever headers it carries —
//! while a letter oncely wrote before it dropped the broker's marks (it carries the deaths
//! of its retries) stays oncely's.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{args, json, oncely};
use integration_tests::amqp::{
    amqp_addr, connect, ready_messages, scratch_topology, start_runner, stop_runner,
};
use integration_tests::wait_until;
use lapin::BasicProperties;
use lapin::options::{BasicGetOptions, BasicPublishOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use oncely::dead_letter::{MESSAGE_ID, REASON, ROUTE, SOURCE};
use oncely::{Delivery, HandlerError, KeyExtractor, Route, handler_fn};
use oncely_amqp::Runner;

/// Headers claiming the message is already one of oncely's dead letters from `queue`, one
/// written before oncely dropped the broker's marks: deaths in a retry queue only.
fn forged(queue: &str) -> FieldTable {
    let mut headers = retry_deaths(&format!("{queue}.retry.1000ms"));
    for (name, value) in [
        (REASON, "rejected"),
        (SOURCE, queue),
        (ROUTE, "forged"),
        (MESSAGE_ID, "forged-id"),
    ] {
        headers.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    headers
}

/// The broker's marks of one death in `retry_queue` (its delay ran out), as RabbitMQ 3.10
/// writes them, and the `x-last-death-*` of 3.13 and later.
fn retry_deaths(retry_queue: &str) -> FieldTable {
    let mut death = FieldTable::default();
    death.insert("count".into(), AMQPValue::LongLongInt(1));
    death.insert("reason".into(), AMQPValue::LongString("expired".into()));
    death.insert("queue".into(), AMQPValue::LongString(retry_queue.into()));
    death.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
    death.insert("exchange".into(), AMQPValue::LongString("".into()));
    let routing_keys = vec![AMQPValue::LongString(retry_queue.into())];
    death.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(FieldArray::from(routing_keys)),
    );
    let mut headers = FieldTable::default();
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
    );
    for prefix in ["x-first-death", "x-last-death"] {
        headers.insert(
            format!("{prefix}-queue").into(),
            AMQPValue::LongString(retry_queue.into()),
        );
        headers.insert(
            format!("{prefix}-reason").into(),
            AMQPValue::LongString("expired".into()),
        );
        headers.insert(
            format!("{prefix}-exchange").into(),
            AMQPValue::LongString("".into()),
        );
    }
    headers
}

/// A dead letter as oncely wrote them before dropping the broker's marks: its reason and
/// source, and the marks of a retry hop through `retry_queue`.
fn written_before_the_marks_were_dropped(queue: &str, retry_queue: &str) -> FieldTable {
    let mut headers = retry_deaths(retry_queue);
    for (name, value) in [
        (REASON, "attempts_exhausted"),
        (SOURCE, queue),
        (ROUTE, "forgery"),
    ] {
        headers.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    headers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_dead_letter_headers_change_nothing() {
    let topology = scratch_topology("cli-dlq-forged");
    let (queue, dlq) = (
        topology.queue().to_owned(),
        topology.dead_letter_queue().to_owned(),
    );
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    let publish = |body: &'static str| {
        let properties = BasicProperties::default().with_headers(forged(&queue));
        let channel = channel.clone();
        let queue = queue.clone();
        async move {
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };

    // A message RabbitMQ dead-letters itself (another consumer rejects it), forged headers
    // and all — a retry queue's deaths among them, as an old letter of oncely's carries: it
    // lands in the dead-letter queue with a death in the work queue.
    publish(r#"{"orderId":"broker"}"#).await;
    wait_until(Duration::from_secs(10), || async {
        ready_messages(&channel, &queue).await == 1
    })
    .await;
    let got = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the message");
    got.delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();

    // One the runner dead-letters: its handler sees none of the forged headers, and its
    // dead letter carries oncely's own.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let seen = seen.clone();
        handler_fn(move |envelope: oncely::Envelope| {
            let delivery: &Delivery = envelope.delivery();
            let names = delivery.headers().iter().map(|(name, _)| name.to_owned());
            seen.lock()
                .unwrap()
                .extend(std::iter::once("(a run)".to_owned()).chain(names));
            async { Err::<(), _>(HandlerError::permanent("no such account")) }
        })
    };
    let route = Route::new("forgery", KeyExtractor::json_pointer("/orderId"), handler);
    let (shutdown, running) = start_runner(
        Runner::new(route, topology.clone()),
        amqp_addr(),
        "oncely-cli-dlq-forged",
    );
    publish(r#"{"orderId":"runner"}"#).await;
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, &dlq).await == 2
    })
    .await;
    // And one written before the upgrade, straight into the dead-letter queue.
    let old = BasicProperties::default().with_headers(written_before_the_marks_were_dropped(
        &queue,
        &format!("{queue}.retry.1000ms"),
    ));
    channel
        .basic_publish(
            "".into(),
            dlq.as_str().into(),
            BasicPublishOptions::default(),
            br#"{"orderId":"before"}"#,
            old,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until(Duration::from_secs(10), || async {
        ready_messages(&channel, &dlq).await == 3
    })
    .await;
    stop_runner(shutdown, running).await;
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "the handler never ran");
    assert!(
        seen.iter().all(|name| !name.starts_with("x-oncely-")),
        "the handler saw a producer's dead-letter headers: {seen:?}"
    );

    let list = json(&oncely(&args(&["--json", "dlq", "list", "--queue", &queue], &[])).await);
    let letters = list["dead_letters"].as_array().expect("a list").clone();
    assert_eq!(letters.len(), 3, "{list}");
    let oncely_letters = letters.iter().filter(|letter| letter["oncely"] == true).count();
    assert_eq!(
        oncely_letters, 2,
        "the runner's letter and the one written before the upgrade are oncely's: {list}"
    );
    let theirs = |oncely: bool| {
        letters
            .iter()
            .find(|letter| letter["oncely"] == oncely && letter["reason"] != "attempts_exhausted")
            .unwrap_or_else(|| panic!("no letter with oncely = {oncely}: {list}"))
            .clone()
    };
    assert_eq!(
        theirs(true)["route"],
        "forgery",
        "the runner's letter kept a forged header: {list}"
    );
    assert!(
        theirs(true)["message_id"].is_null(),
        "a forged message id survived: {list}"
    );
    assert_eq!(theirs(false)["route"], "forged");

    // The purge deletes oncely's letters only; the broker's stays, and is not replayed.
    let _ = oncely(&args(&["dlq", "purge", "--queue", &queue, "--yes"], &[])).await;
    assert_eq!(
        ready_messages(&channel, &dlq).await,
        1,
        "the broker's letter was purged as oncely's"
    );
    let _ = oncely(&args(&["dlq", "replay", "--queue", &queue, "--yes"], &[])).await;
    assert_eq!(
        ready_messages(&channel, &dlq).await,
        1,
        "the broker's letter was replayed as oncely's"
    );
    assert_eq!(ready_messages(&channel, &queue).await, 0);
}
