//! The RabbitMQ runner under handler and broker faults: panics, a message that takes its
//! consumer down every time, retry copies the broker will not take, waits that must not use
//! up attempts, and a retry hop whose target queue is missing. Each test declares its own
//! queues and deletes them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use integration_tests::amqp::{
    amqp_addr, close_connections_named, connect, drain, header_text, ready_messages, scratch_topology,
};
use integration_tests::dead_letter;
use integration_tests::{unique, wait_until};
use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use oncely::report::RunReport;
use oncely::{
    BoxFuture, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, Tier, handler_fn,
};
use oncely_amqp::{Producer, Runner, Topology};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Asserts that `message`, taken from the dead-letter queue of `topology`, carries the
/// dead-letter metadata with `reason`, `attempts` and `route`.
fn assert_dead_letter(
    message: &lapin::message::BasicGetMessage,
    topology: &Topology,
    reason: &str,
    attempts: u32,
    route: &str,
) {
    let expected = dead_letter::Expected {
        reason,
        attempts,
        route,
        source: topology.queue(),
        message_id: None,
    };
    dead_letter::assert_metadata(|name| header_text(message, name), &expected);
}

/// A fresh topology holding one message per order id, and a channel to inspect it with.
async fn queue_with(name: &str, orders: &[&str]) -> (Topology, lapin::Channel) {
    let topology = scratch_topology(name);
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    let producer = Producer::new(connect().await.unwrap());
    for order in orders {
        let body = format!(r#"{{"orderId":"{order}"}}"#);
        producer
            .publish("", topology.queue(), body.as_bytes(), None)
            .await
            .unwrap();
    }
    (topology, channel)
}

/// Counts handler runs per order id.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    fn count(&self, envelope: &Envelope) -> u32 {
        let mut runs = self.0.lock().unwrap();
        let count = runs.entry(envelope.key().to_string()).or_default();
        *count += 1;
        *count
    }

    fn of(&self, key: &str) -> u32 {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    fn keys_starting(&self, prefix: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .keys()
            .filter(|key| key.starts_with(prefix))
            .count()
    }
}

/// Stops a runner [`start`] started, checks it ended without an error and returns its report.
async fn stop(shutdown: CancellationToken, running: Running) -> RunReport {
    shutdown.cancel();
    let ended = running.await.expect("the runner task does not panic");
    ended.expect("the runner stops at shutdown without an error")
}

/// A runner running in a task of its own.
type Running = tokio::task::JoinHandle<Result<RunReport, oncely_amqp::Error>>;

/// Starts `runner` on its own connection named `name`, reconnecting when the broker drops it.
fn start<S>(runner: Runner<S>, name: &str) -> (CancellationToken, Running)
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    let shutdown = CancellationToken::new();
    let running = {
        let (shutdown, name) = (shutdown.clone(), name.to_owned());
        tokio::spawn(async move {
            let connect = || {
                let properties = ConnectionProperties::default().with_connection_name(name.clone().into());
                async move { Connection::connect(&amqp_addr(), properties).await }
            };
            runner.run_with_reconnect(connect, &shutdown).await
        })
    };
    (shutdown, running)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_handlers_never_stall_the_consumer_and_are_dead_lettered_as_panics() {
    let orders = [
        "panic-1", "panic-2", "panic-3", "panic-4", "panic-5", "ok-1", "ok-2", "ok-3",
    ];
    let (topology, channel) = queue_with("panics", &orders).await;
    let runs = Runs::default();
    let counted = runs.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        counted.count(&envelope);
        async move {
            if envelope.key().as_str().starts_with("panic") {
                panic!("bug in the handler for {}", envelope.key());
            }
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("panics", KeyExtractor::json_pointer("/orderId"), handler).with_max_attempts(2);
    // Fewer prefetch slots than panicking messages: a pinned slot per panic would stall.
    let runner = Runner::new(route, topology.clone()).with_prefetch(2);
    let (shutdown, running) = start(runner, &unique("oncely-test-panics"));
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, dlq).await == 5 && runs.keys_starting("ok") == 3
    })
    .await;
    stop(shutdown, running).await;

    for message in drain(&channel, dlq).await {
        assert_dead_letter(&message, &topology, "attempts_exhausted", 2, "panics");
        let detail = header_text(&message, oncely::dead_letter::DETAIL).unwrap();
        assert!(detail.contains("panicked: bug in the handler"), "{detail}");
    }
    for order in &orders[..5] {
        assert_eq!(runs.of(order), 2, "{order}: each attempt counted once");
    }
    topology.delete(&channel).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_takes_its_consumer_down_every_time_is_dead_lettered_and_the_rest_flow() {
    let mut orders = vec!["poison".to_owned()];
    orders.extend((0..20).map(|n| format!("ok-{n}")));
    let order_refs: Vec<&str> = orders.iter().map(String::as_str).collect();
    let (topology, channel) = queue_with("crash-loop", &order_refs).await;
    let runs = Runs::default();
    let crashed = Arc::new(Notify::new());
    let (counted, crash) = (runs.clone(), crashed.clone());
    // The poison message hangs its consumer and has it cut off from the broker, as a process
    // that dies holding its deliveries would be: the broker takes back everything unacked.
    // Between crashes it fails once, so it also travels through a retry queue, whose copy the
    // broker counts from zero (as a wait for the flag or lock its crash left behind would).
    let handler = handler_fn(move |envelope: Envelope| {
        let run = counted.count(&envelope);
        let crash = crash.clone();
        async move {
            if envelope.key().as_str() == "poison" {
                if run % 2 == 0 {
                    return Err(HandlerError::transient("downstream unavailable"));
                }
                crash.notify_one();
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<(), HandlerError>(())
        }
    });
    let route = Route::new("crash-loop", KeyExtractor::json_pointer("/orderId"), handler);
    let runner = Runner::new(route, topology.clone())
        .with_max_deliveries(3)
        .with_shutdown_grace(Duration::from_millis(100));
    let name = unique("oncely-test-crash-loop");
    let (shutdown, running) = start(runner, &name);
    let killer = {
        let name = name.clone();
        tokio::spawn(async move {
            loop {
                crashed.notified().await;
                let name = name.clone();
                tokio::task::spawn_blocking(move || close_connections_named(&name))
                    .await
                    .unwrap();
            }
        })
    };
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(60), || async {
        ready_messages(&channel, dlq).await == 1 && runs.keys_starting("ok") == 20
    })
    .await;
    stop(shutdown, running).await;
    killer.abort();

    let dead = drain(&channel, dlq).await;
    assert_eq!(dead.len(), 1, "only the poison message is dead-lettered");
    // Three crashes with a retry (attempt + 1) after each of the first two.
    assert_dead_letter(&dead[0], &topology, "delivery_limit", 3, "crash-loop");
    assert_eq!(
        String::from_utf8_lossy(&dead[0].delivery.data),
        r#"{"orderId":"poison"}"#
    );
    assert_eq!(
        runs.of("poison"),
        5,
        "three crashes with a failure between each, then it never ran again"
    );
    topology.delete(&channel).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_the_broker_will_not_take_is_bounded_and_ends_in_the_dead_letter_queue() {
    let (topology, channel) = queue_with("unroutable-retry", &["o-1"]).await;
    // The retry copies become unroutable: every settlement of a retry fails.
    for retry_queue in topology.retry_queues() {
        channel
            .queue_delete(retry_queue.into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    let runs = Runs::default();
    let counted = runs.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        counted.count(&envelope);
        async { Err::<(), _>(HandlerError::transient("downstream unavailable")) }
    });
    let route = Route::new("unroutable", KeyExtractor::json_pointer("/orderId"), handler);
    let runner = Runner::new(route, topology.clone()).with_max_deliveries(3);
    // `run`, not `run_with_reconnect`, which would declare the retry queues again.
    let shutdown = CancellationToken::new();
    let running = {
        let (shutdown, channel) = (
            shutdown.clone(),
            connect().await.unwrap().create_channel().await.unwrap(),
        );
        tokio::spawn(async move { runner.run(&channel, &shutdown).await.unwrap() })
    };
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, dlq).await == 1
    })
    .await;
    // Nothing runs the stack again once the message is dead-lettered.
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    running.await.unwrap();
    let dead = drain(&channel, dlq).await;
    // Its retry copy never left: every run was attempt 1.
    assert_dead_letter(&dead[0], &topology, "delivery_limit", 1, "unroutable");
    assert_eq!(runs.of("o-1"), 3, "the stack ran a bounded number of times");
    topology.delete(&channel).await.unwrap();
}

/// Answers "in flight elsewhere" on its first `waits` calls, then fails; records the attempt
/// number of every call.
#[derive(Clone)]
struct WaitsThenFails {
    waits: u32,
    attempts: Arc<Mutex<Vec<u32>>>,
}

impl tower::Service<Envelope> for WaitsThenFails {
    type Response = Outcome;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Outcome, std::convert::Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let mut attempts = self.attempts.lock().unwrap();
        attempts.push(envelope.delivery().attempt());
        let reason = if attempts.len() as u32 <= self.waits {
            RetryReason::InFlight(Tier::Flag)
        } else {
            RetryReason::HandlerFailed
        };
        Box::pin(async move { Ok(Outcome::retry_later(reason, "test", None)) })
    }
}

#[tokio::test]
async fn waiting_for_another_holder_uses_up_no_attempts() {
    let (topology, channel) = queue_with("waits", &["o-1"]).await;
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let stack = WaitsThenFails {
        waits: 4,
        attempts: attempts.clone(),
    };
    let route = Route::new("waits", KeyExtractor::json_pointer("/orderId"), stack).with_max_attempts(3);
    let (shutdown, running) = start(Runner::new(route, topology.clone()), &unique("oncely-test-waits"));
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, dlq).await == 1
    })
    .await;
    stop(shutdown, running).await;
    let dead = drain(&channel, dlq).await;
    assert_dead_letter(&dead[0], &topology, "attempts_exhausted", 3, "waits");
    assert_eq!(
        *attempts.lock().unwrap(),
        vec![1, 1, 1, 1, 1, 2, 3],
        "four waits at attempt 1, then three real failures"
    );
    topology.delete(&channel).await.unwrap();
}

/// Slow by the broker's design: RabbitMQ tries an unroutable at-least-once dead letter again
/// about every three minutes.
#[tokio::test]
async fn a_retry_whose_work_queue_is_missing_waits_in_the_retry_queue_instead_of_vanishing() {
    let topology = scratch_topology("retry-hop");
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    channel
        .queue_delete(topology.queue().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    // A retry copy, as the runner publishes it, whose TTL runs out while no work queue exists.
    let retry_queue = topology.retry_queues().next().unwrap();
    channel.confirm_select(Default::default()).await.unwrap();
    channel
        .basic_publish(
            "".into(),
            retry_queue.into(),
            BasicPublishOptions::default(),
            br#"{"orderId":"o-1"}"#,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;

    topology.declare(&channel).await.unwrap();
    wait_until(Duration::from_secs(240), || async {
        ready_messages(&channel, topology.queue()).await == 1
    })
    .await;
    topology.delete(&channel).await.unwrap();
}
