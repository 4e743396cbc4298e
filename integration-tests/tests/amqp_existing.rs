//! The drop-in on a queue that already exists, on RabbitMQ 3.10 and 4.0: a classic queue
//! producers already publish to is consumed as it is, each order applied once; declaring
//! oncely's own queue over it is an error that names the queue, the argument and the
//! README's section; and consumers move onto oncely's own queues while a producer keeps
//! publishing, losing nothing and applying nothing twice.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use integration_tests::amqp::{
    Broker, Runs, ready_messages, run_through_a_crash_loop, start_runner, stop_runner, test_topology,
};
use integration_tests::on_both_brokers;
use integration_tests::postgres::{BoxedStack, ScratchSchema, boxed, pool, schema_pool};
use integration_tests::wait_until;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{BusinessKey, Envelope, HandlerError, KeyExtractor, Route, handler_fn};
use oncely_amqp::{Producer, Runner};
use tokio::sync::Notify;

on_both_brokers!(
    a_classic_queue_is_consumed_as_it_is_and_each_order_applied_once,
    a_message_that_takes_its_consumer_down_on_a_classic_queue_is_dead_lettered,
    consumers_move_onto_oncelys_queues_while_a_producer_publishes,
);

/// A schema with a `moves` table that counts every application (no unique index: an order
/// applied twice shows as two rows), and the route that applies an order there.
async fn shop() -> (ScratchSchema, Route<BoxedStack>) {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE moves (order_id TEXT NOT NULL)")
        .await;
    let pool = schema_pool(schema.name(), 8);
    let apply = |tx: PgTransaction, order: BusinessKey| async move {
        tx.execute("INSERT INTO moves (order_id) VALUES ($1)", &[&order.as_str()])
            .await?;
        Ok::<(), oncely::HandlerError>(())
    };
    let stack = boxed(PgTransactionalLayer::new(pool, schema.records()).handler(apply));
    let route = Route::new("moves", KeyExtractor::json_pointer("/orderId"), stack);
    (schema, route)
}

/// A classic durable queue named `queue`, as a shop's producers declared it.
async fn declare_classic(channel: &Channel, queue: &str) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .expect("a classic queue");
}

/// Orders applied, and how many applied more than once.
async fn applied(schema: &ScratchSchema) -> (i64, i64) {
    let distinct = schema.count("SELECT count(DISTINCT order_id) FROM moves").await;
    let doubled = schema
        .count("SELECT count(*) FROM (SELECT order_id FROM moves GROUP BY order_id HAVING count(*) > 1) d")
        .await;
    (distinct, doubled)
}

async fn a_classic_queue_is_consumed_as_it_is_and_each_order_applied_once(broker: Broker) {
    let (schema, route) = shop().await;
    let connection = broker.connect().await;
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("oncely-test-classic-{}", oncely::Token::random());
    declare_classic(&channel, &queue).await;

    // oncely's own declaration over it is refused, and says what to do.
    let refused = connection.create_channel().await.unwrap();
    let error = test_topology(&queue)
        .declare(&refused)
        .await
        .expect_err("the broker refuses");
    let said = error.to_string();
    assert!(
        matches!(error, oncely_amqp::Error::QueueMismatch { .. }),
        "{error:?}"
    );
    for named in [
        queue.as_str(),
        "x-",
        "Moving onto a queue that already exists",
        "with_existing_work_queue",
    ] {
        assert!(said.contains(named), "{named} not in: {said}");
    }

    let producer = Producer::new(broker.connect().await);
    for i in 0..130 {
        // 100 orders; the last 30 sent again as new messages (a producer's retries).
        let body = format!(r#"{{"orderId":"o-{}"}}"#, i % 100);
        producer.publish("", &queue, body.as_bytes(), None).await.unwrap();
    }
    let topology = test_topology(&queue).with_existing_work_queue();
    let (shutdown, running) = start_runner(
        Runner::new(route, topology.clone()),
        broker.address(),
        "oncely-classic",
    );
    wait_until(Duration::from_secs(60), || async {
        applied(&schema).await.0 == 100
    })
    .await;
    wait_until(Duration::from_secs(30), || async {
        topology.ready_messages(&channel).await.unwrap_or(1) == 0
    })
    .await;
    let report = stop_runner(shutdown, running).await;
    assert_eq!(applied(&schema).await, (100, 0), "{report}");
    assert_eq!(report.duplicates.values().sum::<u64>(), 30, "{report}");
    topology.delete(&channel).await.unwrap();
}

async fn consumers_move_onto_oncelys_queues_while_a_producer_publishes(broker: Broker) {
    let (schema, route) = shop().await;
    let connection = broker.connect().await;
    let channel = connection.create_channel().await.unwrap();
    let name = format!("oncely-test-move-{}", oncely::Token::random());
    let (exchange, old_queue, new_queue) =
        (format!("{name}.x"), format!("{name}.old"), format!("{name}.new"));
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    declare_classic(&channel, &old_queue).await;
    let bind = |queue: String| {
        let (channel, exchange) = (channel.clone(), exchange.clone());
        async move {
            channel
                .queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    "orders".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
    };
    bind(old_queue.clone()).await;

    // The producer publishes throughout: 1,200 messages, one in ten a re-send of an order.
    let published = Arc::new(Mutex::new(BTreeSet::new()));
    let publishing = {
        let (producer, exchange, published) = (
            Producer::new(broker.connect().await),
            exchange.clone(),
            published.clone(),
        );
        tokio::spawn(async move {
            for i in 0..1200u32 {
                let order = if i % 10 == 9 { i - 5 } else { i };
                let body = format!(r#"{{"orderId":"o-{order}"}}"#);
                producer
                    .publish(&exchange, "orders", body.as_bytes(), None)
                    .await
                    .expect("published");
                published.lock().unwrap().insert(order);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let old = test_topology(&old_queue).with_existing_work_queue();
    let start_old = || {
        start_runner(
            Runner::new(route.clone(), old.clone()),
            broker.address(),
            "oncely-move-old",
        )
    };
    let (mut shutdown_old, mut running_old) = start_old();
    let sent = || published.lock().unwrap().len();
    wait_until(Duration::from_secs(30), || async { sent() > 300 }).await;

    // The move, as the README says: oncely's own queues bound beside the old one, with their
    // consumers; the old one unbound; its consumers stopped once it and its retry and
    // suspect queues are empty; then it is deleted, only if empty.
    let new = test_topology(&new_queue);
    new.declare(&channel).await.unwrap();
    bind(new_queue.clone()).await;
    let (shutdown_new, running_new) = start_runner(
        Runner::new(route.clone(), new.clone()),
        broker.address(),
        "oncely-move-new",
    );
    wait_until(Duration::from_secs(30), || async { sent() > 600 }).await;
    channel
        .queue_unbind(
            old_queue.as_str().into(),
            exchange.as_str().into(),
            "orders".into(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    loop {
        wait_until(Duration::from_secs(60), || async {
            old.ready_messages(&channel).await.unwrap_or(1) == 0
        })
        .await;
        stop_runner(shutdown_old, running_old).await;
        // A delivery in flight at the stop goes back to the queue: run the old consumers
        // again until nothing is left.
        if old.ready_messages(&channel).await.unwrap() == 0 {
            break;
        }
        (shutdown_old, running_old) = start_old();
    }
    let if_empty = QueueDeleteOptions {
        if_empty: true,
        ..QueueDeleteOptions::default()
    };
    channel
        .queue_delete(old_queue.as_str().into(), if_empty)
        .await
        .expect("the old queue is empty, and deleted");
    old.delete(&channel).await.ok();

    publishing.await.expect("the producer");
    let orders = published.lock().unwrap().len() as i64;
    wait_until(Duration::from_secs(60), || async {
        applied(&schema).await.0 == orders
    })
    .await;
    wait_until(Duration::from_secs(30), || async {
        new.ready_messages(&channel).await.unwrap_or(1) == 0
    })
    .await;
    let report = stop_runner(shutdown_new, running_new).await;
    assert_eq!(applied(&schema).await, (orders, 0), "every order once: {report}");
    assert_eq!(ready_messages(&channel, new.dead_letter_queue()).await, 0);
    new.delete(&channel).await.unwrap();
}

/// A classic queue counts no deliveries, so a message that takes its consumer down every
/// time is bounded by the runner: back once, it moves to the (quorum) suspect queue, where
/// it runs alone and is counted, and it is dead-lettered after `max_deliveries` runs there.
async fn a_message_that_takes_its_consumer_down_on_a_classic_queue_is_dead_lettered(broker: Broker) {
    let connection = broker.connect().await;
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("oncely-test-classic-crash-{}", oncely::Token::random());
    declare_classic(&channel, &queue).await;
    let producer = Producer::new(broker.connect().await);
    for order in std::iter::once("poison".to_owned()).chain((0..20).map(|n| format!("ok-{n}"))) {
        let body = format!(r#"{{"orderId":"{order}"}}"#);
        producer.publish("", &queue, body.as_bytes(), None).await.unwrap();
    }
    let runs = Runs::default();
    let crashed = Arc::new(Notify::new());
    let (counted, crash) = (runs.clone(), crashed.clone());
    // The poison message hangs its consumer and has it cut off from the broker, as a
    // process that dies holding its deliveries would be.
    let handler = handler_fn(move |envelope: Envelope| {
        counted.count(&envelope);
        let crash = crash.clone();
        async move {
            if envelope.key().as_str() == "poison" {
                crash.notify_one();
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("classic-crash", KeyExtractor::json_pointer("/orderId"), handler);
    let topology = test_topology(&queue).with_existing_work_queue();
    // Declared before the runner does: a passive look at a queue not there yet would close
    // the test's channel.
    topology.declare(&channel).await.unwrap();
    run_through_a_crash_loop(
        broker,
        route,
        &topology,
        "oncely-test-classic-crash",
        crashed,
        &runs,
    )
    .await;
    // One crash among others, then three alone; then it never ran again.
    assert_eq!(runs.of("poison"), 4);
    assert_eq!(ready_messages(&channel, &queue).await, 0);
    topology.delete(&channel).await.unwrap();
}
