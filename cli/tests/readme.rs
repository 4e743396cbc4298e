//! The README's "Operating oncely" transcript is what the tool prints. Each `$ oncely …`
//! line of its console block runs against a stack that really ran — the README's keys, with
//! a schema, Redis prefix and queue of the test's own standing in for `shop` and `orders` —
//! and what it prints is compared with the README's lines below it, once the parts that
//! change from run to run are blanked on both sides: times, ids, fingerprints, fencing
//! tokens, sizes, and the width of table columns.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{effects_of, effects_schema, oncely};
use integration_tests::amqp::{
    amqp_addr, connect, ready_messages, scratch_topology, start_runner, stop_runner,
};
use integration_tests::{redis_connection, redis_url, wait_until};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::record::{PgRecordStore, PgTransaction, PgTransactionalLayer, RecordStore};
use oncely::{BusinessKey, Fingerprint, HandlerError, Json, KeyExtractor, Route};
use oncely_amqp::{Producer, Runner};
use regex::Regex;
use tower::ServiceBuilder;

#[derive(serde::Deserialize)]
struct Order {
    qty: u32,
}

/// The console block after the README's marker: (command, expected output) pairs.
fn transcript() -> Vec<(String, String)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let marker = readme
        .find("<!-- operating: the transcript below is checked by cli/tests/readme.rs -->")
        .expect("the README's marker");
    let block = &readme[marker..];
    let start = block.find("```console\n").expect("a console block") + "```console\n".len();
    let block = &block[start..start + block[start..].find("\n```").unwrap()];
    let mut steps: Vec<(String, String)> = Vec::new();
    for line in block.lines() {
        match (line.strip_prefix("$ "), steps.last_mut()) {
            (Some(command), _) => steps.push((command.to_owned(), String::new())),
            (None, Some((_, output))) => {
                output.push_str(line);
                output.push('\n');
            }
            (None, None) => panic!("output before the first command: {line}"),
        }
    }
    steps
}

/// `text` with what changes from run to run blanked, and column widths collapsed.
fn normalized(text: &str) -> String {
    let blanks = [
        (r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z", "<time>"),
        (r"\([0-9][^)]* ago\)", "(<ago>)"),
        (
            r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            "<id>",
        ),
        (r"[0-9a-f]{32}", "<hex>"),
        (r"[0-9]{10,}", "<number>"),
        (r"[0-9]+(\.[0-9]+)? (B|KiB|MiB|GiB)", "<size>"),
        (r"[0-9]+(\.[0-9]+)? ?(ms|s)(?-u:\b)", "<duration>"),
        (r"[0-9]+h [0-9]+m", "<duration>"),
        (r"[─═ ]+", " "),
    ];
    let mut text = text.to_owned();
    for (pattern, blank) in blanks {
        text = Regex::new(pattern)
            .unwrap()
            .replace_all(&text, blank)
            .into_owned();
    }
    text.lines().map(str::trim_end).collect::<Vec<_>>().join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_transcript_is_what_the_tool_prints() {
    let (schema, pool) = effects_schema().await;
    let topology = scratch_topology("readme");
    let (shop, orders) = (schema.name().to_owned(), topology.queue().to_owned());
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();

    // The README's stack: flag (record behind), lock per SKU, transactional record; a
    // handler that refuses quantities over 100 until the limit is raised.
    let limit_raised = Arc::new(Mutex::new(false));
    let handler = {
        let limit_raised = limit_raised.clone();
        move |tx: PgTransaction, key: BusinessKey, Json(order): Json<Order>| {
            let refused = order.qty > 100 && !*limit_raised.lock().unwrap();
            async move {
                if refused {
                    return Err(HandlerError::permanent(format!(
                        "qty {} over the limit of 100",
                        order.qty
                    )));
                }
                tx.execute("INSERT INTO effects (order_id) VALUES ($1)", &[&key.as_str()])
                    .await?;
                Ok(())
            }
        }
    };
    let redis = redis_connection(&redis_url()).await;
    let flag = FlagLayer::new(
        RedisFlagStore::new(redis.clone()).with_prefix(shop.as_str()),
        Duration::from_secs(3600),
    );
    let lock = LockLayer::new(
        RedisLockStore::new(redis).with_prefix(shop.as_str()),
        KeyExtractor::json_pointer("/sku"),
    );
    let stack = ServiceBuilder::new()
        .layer(flag.with_record_behind())
        .layer(lock)
        .service(PgTransactionalLayer::new(pool.clone(), schema.records()).handler(handler));
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    let (shutdown, running) = start_runner(
        Runner::new(route, topology.clone()),
        amqp_addr(),
        "oncely-cli-readme",
    );

    // One at a time, so that the dead letters are listed in the README's order.
    let producer = Producer::new(connect().await.unwrap());
    let dlq = topology.dead_letter_queue().to_owned();
    for (body, dead_letters) in [
        (r#"{"orderId":"order-1042","sku":"sku-7","qty":2}"#, 0),
        (r#"{"orderId":"order-1043","sku":"sku-7","qty":500}"#, 1),
        (r#"{"sku":"sku-7","qty":1}"#, 2),
    ] {
        producer
            .publish("", &orders, body.as_bytes(), None)
            .await
            .unwrap();
        wait_until(Duration::from_secs(30), || async {
            ready_messages(&channel, &dlq).await == dead_letters
                && effects_of(&schema, "order-1042").await == 1
        })
        .await;
    }
    // The row a consumer killed mid-handler leaves (three-step record), written as its
    // `begin` wrote it, with a lease that runs out at once: `record.rs` kills a real one.
    let stuck = BusinessKey::new("order-1045");
    PgRecordStore::new(pool, schema.records())
        .begin(&stuck, Fingerprint::of(b"{}"), Duration::from_millis(1), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    *limit_raised.lock().unwrap() = true;

    let mut printed = String::new();
    let mut differs = false;
    for (command, expected) in transcript() {
        let arguments: Vec<String> = command
            .split_whitespace()
            .skip(1)
            .map(|word| match word {
                "shop" => shop.clone(),
                "orders" => orders.clone(),
                other => other.to_owned(),
            })
            .collect();
        let output = oncely(&arguments).await;
        let stdout = String::from_utf8_lossy(&output.stdout)
            .replace(&orders, "orders")
            .replace(&shop, "shop");
        differs |= normalized(&stdout) != normalized(&expected);
        printed.push_str(&format!("$ {command}\n{stdout}"));
    }
    assert!(
        !differs,
        "the README's transcript differs from what the tool printed:\n{printed}"
    );

    // The replayed order, its limit raised, was applied once.
    wait_until(Duration::from_secs(30), || async {
        effects_of(&schema, "order-1043").await == 1
    })
    .await;
    stop_runner(shutdown, running).await;
    assert_eq!(effects_of(&schema, "order-1043").await, 1);
    topology.delete(&channel).await.unwrap();
}
