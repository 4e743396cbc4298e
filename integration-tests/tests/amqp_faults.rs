//! The RabbitMQ runner under handler and broker faults: panics, a message that takes its
//! consumer down every time, retry copies the broker will not take, waits that must not use
//! up attempts, and a retry hop whose target queue is missing. Each test declares its own
//! queues and deletes them.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use integration_tests::amqp::{
    Broker, Runs, close_connections_on, crash_on_notify, drain, header_text, ready_messages,
    run_through_a_crash_loop, scratch_topology, start_runner, stop_runner, topology_with_orders,
};
use integration_tests::amqp_tap::AmqpTap;
use integration_tests::dead_letter;
use integration_tests::{on_both_brokers, unique, wait_until};
use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use oncely::{
    BoxFuture, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, Tier, handler_fn,
};
use oncely_amqp::{Runner, SuspectGate, Topology};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

on_both_brokers!(
    panicking_handlers_never_stall_the_consumer_and_are_dead_lettered_as_panics,
    a_message_that_takes_its_consumer_down_every_time_is_dead_lettered_and_the_rest_flow,
    a_retry_the_broker_will_not_take_is_bounded_and_ends_in_the_dead_letter_queue,
    waiting_for_another_holder_uses_up_no_attempts,
    work_and_suspect_queues_dead_letter_past_the_brokers_delivery_limit,
    queues_declared_before_the_safety_net_get_it_from_the_policy,
    a_late_confirm_is_waited_for_not_answered_with_a_second_copy,
    deliveries_received_but_not_started_at_shutdown_come_back_uncounted,
    counters_a_producer_sets_on_a_first_delivery_change_nothing,
    runners_sharing_a_gate_never_blame_one_runners_suspect_for_anothers_crash,
    acks_never_pass_a_delivery_still_running,
);

/// A fresh topology holding the order `poison`, then `oks` orders `ok-0`, `ok-1`, ….
async fn poison_among_oks(broker: Broker, name: &str, oks: usize) -> (Topology, lapin::Channel) {
    let mut orders = vec!["poison".to_owned()];
    orders.extend((0..oks).map(|n| format!("ok-{n}")));
    let order_refs: Vec<&str> = orders.iter().map(String::as_str).collect();
    topology_with_orders(broker, name, &order_refs).await
}

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

async fn panicking_handlers_never_stall_the_consumer_and_are_dead_lettered_as_panics(broker: Broker) {
    let orders = [
        "panic-1", "panic-2", "panic-3", "panic-4", "panic-5", "ok-1", "ok-2", "ok-3",
    ];
    let (topology, channel) = topology_with_orders(broker, "panics", &orders).await;
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
    let (shutdown, running) = start_runner(runner, broker.address(), &unique("oncely-test-panics"));
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, dlq).await == 5 && runs.keys_starting("ok") == 3
    })
    .await;
    stop_runner(shutdown, running).await;

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

async fn a_message_that_takes_its_consumer_down_every_time_is_dead_lettered_and_the_rest_flow(
    broker: Broker,
) {
    let (topology, channel) = poison_among_oks(broker, "crash-loop", 20).await;
    let runs = Runs::default();
    let crashed = Arc::new(Notify::new());
    let (counted, crash) = (runs.clone(), crashed.clone());
    // The poison message hangs its consumer and has it cut off from the broker, as a process
    // that dies holding its deliveries would be: the broker takes back everything unacked.
    // Between crashes it fails once, so it also travels through a retry queue, whose copy the
    // broker counts from zero (as a wait for the flag or lock its crash left behind would).
    // The ok messages the consumer held at its crashes are caught in them, through no fault
    // of their own.
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
    run_through_a_crash_loop(broker, route, &topology, "oncely-test-crash-loop", crashed, &runs).await;
    let dlq = topology.dead_letter_queue();

    let dead = drain(&channel, dlq).await;
    assert_eq!(dead.len(), 1, "only the poison message is dead-lettered");
    // One crash among others (not counted: it cannot be told from its neighbours'), then it
    // runs alone: three crashes, with a failure and a retry (attempt + 1) before each.
    assert_dead_letter(&dead[0], &topology, "delivery_limit", 4, "crash-loop");
    assert_eq!(
        String::from_utf8_lossy(&dead[0].delivery.data),
        r#"{"orderId":"poison"}"#
    );
    assert_eq!(
        runs.of("poison"),
        7,
        "a crash among others, then three failures and three crashes alone; then it never ran again"
    );
    topology.delete(&channel).await.unwrap();
}

async fn a_retry_the_broker_will_not_take_is_bounded_and_ends_in_the_dead_letter_queue(broker: Broker) {
    let (topology, channel) = topology_with_orders(broker, "unroutable-retry", &["o-1"]).await;
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
    // Through a tap that reads how the runner returns what it cannot settle.
    let tap = AmqpTap::start(&broker.host_port()).await;
    let tapped = Connection::connect(
        &tap.address_for(&broker.address()),
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    // `run`, not `run_with_reconnect`, which would declare the retry queues again.
    let shutdown = CancellationToken::new();
    let running = {
        let (shutdown, channel) = (shutdown.clone(), tapped.create_channel().await.unwrap());
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
    assert_eq!(
        runs.of("o-1"),
        4,
        "the stack ran a bounded number of times: once among others, then three times alone"
    );
    // Returned with basic.reject, which RabbitMQ counts in every version (a nack's return
    // stops counting in 4.3, and this loop would never end there).
    let sent = tap.sent();
    let rejects = sent.iter().filter(|method| method.is_reject()).count();
    assert!(rejects >= 4, "every failed settlement is a reject: {sent:?}");
    assert!(
        sent.iter()
            .filter(|m| m.is_reject())
            .all(|m| m.requeue == Some(true))
    );
    assert!(!sent.iter().any(|method| method.is_nack()), "no nack: {sent:?}");
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

async fn waiting_for_another_holder_uses_up_no_attempts(broker: Broker) {
    let (topology, channel) = topology_with_orders(broker, "waits", &["o-1"]).await;
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let stack = WaitsThenFails {
        waits: 4,
        attempts: attempts.clone(),
    };
    let route = Route::new("waits", KeyExtractor::json_pointer("/orderId"), stack).with_max_attempts(3);
    let runner = Runner::new(route, topology.clone());
    let (shutdown, running) = start_runner(runner, broker.address(), &unique("oncely-test-waits"));
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, dlq).await == 1
    })
    .await;
    stop_runner(shutdown, running).await;
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
    let channel = Broker::Rabbit3.connect().await.create_channel().await.unwrap();
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

/// Returns one message from `queue` `returns` times with `basic.reject` and requeue, as a
/// consumer that keeps failing to settle it would.
async fn return_again_and_again(channel: &lapin::Channel, queue: &str, returns: u32) {
    use lapin::options::{BasicGetOptions, BasicRejectOptions};
    for _ in 0..returns {
        let get = channel.basic_get(queue.into(), BasicGetOptions { no_ack: false });
        let Some(message) = get.await.unwrap() else {
            return;
        };
        message
            .delivery
            .acker
            .reject(BasicRejectOptions { requeue: true })
            .await
            .unwrap();
    }
}

/// Publishes `body` to `queue` through the default exchange, confirmed, with `headers`.
async fn publish_raw(channel: &lapin::Channel, queue: &str, body: &[u8], headers: lapin::types::FieldTable) {
    channel.confirm_select(Default::default()).await.unwrap();
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Returns a message in each of the work, suspect and dead-letter queues 25 times (past
/// RabbitMQ 4.x's default delivery limit of 20) and checks that none is gone: on 3.10 they
/// stay where they are, on 4.x the broker dead-letters the first two to the dead-letter
/// queue, which keeps its own.
async fn assert_returns_lose_nothing(broker: Broker, topology: &Topology, channel: &lapin::Channel) {
    let queues = [
        topology.queue(),
        topology.suspect_queue(),
        topology.dead_letter_queue(),
    ];
    for queue in queues {
        publish_raw(channel, queue, br#"{"orderId":"o-1"}"#, Default::default()).await;
        return_again_and_again(channel, queue, 25).await;
    }
    // Returned and dead-lettered messages settle asynchronously: counted until they have.
    let dlq = topology.dead_letter_queue();
    let kept = || async {
        let work = ready_messages(channel, topology.queue()).await;
        let suspect = ready_messages(channel, topology.suspect_queue()).await;
        (work + suspect, ready_messages(channel, dlq).await)
    };
    let expected = match broker {
        Broker::Rabbit3 | Broker::Rabbit3Tls => (2, 1),
        // Past 20 deliveries, 4.x dead-letters.
        Broker::Rabbit4 => (0, 3),
    };
    let settled = tokio::time::timeout(Duration::from_secs(10), async {
        while kept().await != expected {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let _ = settled.await;
    assert_eq!(
        kept().await,
        expected,
        "{broker:?}: a message returned 25 times is never dropped (in their queues, in the dead-letter queue)"
    );
}

async fn work_and_suspect_queues_dead_letter_past_the_brokers_delivery_limit(broker: Broker) {
    let (topology, channel) = topology_with_orders(broker, "delivery-limit", &[]).await;
    assert_returns_lose_nothing(broker, &topology, &channel).await;
    topology.delete(&channel).await.unwrap();
}

async fn queues_declared_before_the_safety_net_get_it_from_the_policy(broker: Broker) {
    // Queues as oncely 0.1 declared them: the topology still accepts them...
    let topology = scratch_topology("policy").with_safety_net_by_policy();
    let channel = broker.connect().await.create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    // ...and the policies give them their safety net.
    let policies = topology.safety_net_policies();
    for policy in &policies {
        broker.rabbitmqctl(&policy.rabbitmqctl_arguments());
    }
    wait_until(Duration::from_secs(10), || async {
        let listed = broker.rabbitmqctl(&["list_queues", "-q", "name", "policy"]);
        let applied = |queue: &str, policy: &str| {
            listed
                .lines()
                .any(|line| line.split_whitespace().eq([queue, policy]))
        };
        let [dead_lettering, keeping] = policies.as_slice() else {
            panic!("two policies: {policies:?}")
        };
        applied(topology.queue(), &dead_lettering.name)
            && applied(topology.suspect_queue(), &dead_lettering.name)
            && applied(topology.dead_letter_queue(), &keeping.name)
    })
    .await;
    assert_returns_lose_nothing(broker, &topology, &channel).await;
    for policy in &policies {
        broker.rabbitmqctl(&["clear_policy", policy.name.as_str()]);
    }
    topology.delete(&channel).await.unwrap();
}

async fn a_late_confirm_is_waited_for_not_answered_with_a_second_copy(broker: Broker) {
    let (topology, channel) = topology_with_orders(broker, "late-confirm", &[]).await;
    let handler = handler_fn(|_: Envelope| async { Err::<(), _>(HandlerError::permanent("bad order")) });
    let route = Route::new("late-confirm", KeyExtractor::json_pointer("/orderId"), handler);
    let runner = Runner::new(route, topology.clone()).with_confirm_timeout(Duration::from_millis(200));
    // The broker's answers reach the runner a second late: every confirm times out first.
    let tap = AmqpTap::start(&broker.host_port()).await;
    let (shutdown, running) = start_runner(
        runner,
        tap.address_for(&broker.address()),
        &unique("oncely-test-late"),
    );
    wait_until(Duration::from_secs(10), || async {
        ready_messages(&channel, topology.queue()).await == 0
    })
    .await;
    tap.delay_answers(Duration::from_secs(1));
    publish_raw(
        &channel,
        topology.queue(),
        br#"{"orderId":"o-1"}"#,
        Default::default(),
    )
    .await;
    let dlq = topology.dead_letter_queue();
    wait_until(Duration::from_secs(30), || async {
        ready_messages(&channel, dlq).await >= 1
    })
    .await;
    // Long enough for the copies the runner used to send after each timeout to land.
    tokio::time::sleep(Duration::from_secs(6)).await;
    tap.delay_answers(Duration::ZERO);
    let report = stop_runner(shutdown, running).await;
    assert_eq!(
        ready_messages(&channel, dlq).await,
        1,
        "one message, one dead letter"
    );
    assert_eq!(report.dead_letters.values().sum::<u64>(), 1, "{report}");
    topology.delete(&channel).await.unwrap();
}

async fn deliveries_received_but_not_started_at_shutdown_come_back_uncounted(broker: Broker) {
    let orders: Vec<String> = (0..10).map(|n| format!("o-{n}")).collect();
    let order_refs: Vec<&str> = orders.iter().map(String::as_str).collect();
    let (topology, channel) = topology_with_orders(broker, "shutdown-hand-back", &order_refs).await;
    let runs = Runs::default();
    let route = || {
        let counted = runs.clone();
        let handler = handler_fn(move |envelope: Envelope| {
            counted.count(&envelope);
            async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<(), HandlerError>(())
            }
        });
        Route::new("hand-back", KeyExtractor::json_pointer("/orderId"), handler)
    };
    // One at a time, with every message sent ahead: a deploy stops it with most not started.
    let runner = Runner::new(route(), topology.clone())
        .with_prefetch(20)
        .with_concurrency(1);
    let (shutdown, running) = start_runner(runner, broker.address(), &unique("oncely-test-hand-back"));
    wait_until(Duration::from_secs(10), || async {
        runs.keys_starting("o-") >= 1
    })
    .await;
    stop_runner(shutdown, running).await;
    let started = runs.keys_starting("o-");
    assert!(started < 10, "the deploy came before the backlog was done");

    // The next run takes the rest as first deliveries: none goes through the suspect queue.
    let runner = Runner::new(route(), topology.clone()).with_drain(Duration::from_millis(500));
    let (_, running) = start_runner(runner, broker.address(), &unique("oncely-test-hand-back"));
    let report = running.await.unwrap().unwrap();
    assert_eq!(report.retries.get("returned_unsettled"), None, "{report}");
    assert_eq!(report.processed, 10 - started as u64, "{report}");
    for order in &orders {
        assert_eq!(runs.of(order), 1, "{order} ran once");
    }
    topology.delete(&channel).await.unwrap();
}

async fn counters_a_producer_sets_on_a_first_delivery_change_nothing(broker: Broker) {
    let (topology, channel) = topology_with_orders(broker, "forged-headers", &[]).await;
    let mut headers = lapin::types::FieldTable::default();
    for name in ["x-oncely-returns", "x-delivery-count"] {
        headers.insert(name.into(), lapin::types::AMQPValue::LongLongInt(99));
    }
    // As the runner writes it, in text: without the runner's seal it changes nothing either.
    headers.insert(
        oncely_amqp::ATTEMPT_HEADER.into(),
        lapin::types::AMQPValue::LongString("99".into()),
    );
    publish_raw(&channel, topology.queue(), br#"{"orderId":"o-1"}"#, headers).await;
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = attempts.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        seen.lock().unwrap().push(envelope.delivery().attempt());
        async { Ok::<(), HandlerError>(()) }
    });
    let route = Route::new("forged", KeyExtractor::json_pointer("/orderId"), handler).with_max_attempts(3);
    let runner = Runner::new(route, topology.clone()).with_drain(Duration::from_millis(500));
    let (_, running) = start_runner(runner, broker.address(), &unique("oncely-test-forged"));
    let report = running.await.unwrap().unwrap();
    assert_eq!(
        *attempts.lock().unwrap(),
        vec![1],
        "it ran once, as a first attempt: {report}"
    );
    assert_eq!(report.processed, 1, "{report}");
    assert_eq!(ready_messages(&channel, topology.dead_letter_queue()).await, 0);
    topology.delete(&channel).await.unwrap();
}

async fn runners_sharing_a_gate_never_blame_one_runners_suspect_for_anothers_crash(broker: Broker) {
    // Two runners of one process (one connection name: a crash takes both down). Runner A's
    // poison message takes the process down half a second into its run; runner B holds a
    // suspect that takes three seconds.
    let (poisoned, channel) = topology_with_orders(broker, "gate-poison", &["poison"]).await;
    let (innocent, _) = topology_with_orders(broker, "gate-suspect", &[]).await;
    publish_raw(
        &channel,
        innocent.suspect_queue(),
        br#"{"orderId":"s-1"}"#,
        Default::default(),
    )
    .await;
    let runs = Runs::default();
    let crashed = Arc::new(Notify::new());
    let route = || {
        let (counted, crash) = (runs.clone(), crashed.clone());
        let handler = handler_fn(move |envelope: Envelope| {
            let run = counted.count(&envelope);
            let crash = crash.clone();
            async move {
                if envelope.key().as_str() == "poison" {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    crash.notify_one();
                    std::future::pending::<()>().await;
                }
                if run == 1 {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                Ok::<(), HandlerError>(())
            }
        });
        Route::new("gate", KeyExtractor::json_pointer("/orderId"), handler)
    };
    let gate = SuspectGate::new();
    let runner = |topology: &Topology| {
        Runner::new(route(), topology.clone())
            .with_max_deliveries(1)
            .with_shutdown_grace(Duration::from_millis(100))
            .with_suspect_gate(gate.clone())
    };
    let (runner_a, runner_b) = (runner(&poisoned), runner(&innocent));
    // One consumer process: both runners on one connection, so that a crash takes both at
    // the same instant; started again on a new connection after each crash.
    let name = unique("oncely-test-gate");
    let stop = CancellationToken::new();
    let process = {
        let (stop, address, name) = (stop.clone(), broker.address(), name.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let properties = ConnectionProperties::default().with_connection_name(name.clone().into());
                let Ok(connection) = Connection::connect(&address, properties).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let (a, b) = (
                    connection.create_channel().await,
                    connection.create_channel().await,
                );
                let (Ok(a), Ok(b)) = (a, b) else { continue };
                let _ = tokio::join!(runner_a.run(&a, &stop), runner_b.run(&b, &stop));
            }
        })
    };
    let killer = crash_on_notify(broker, &name, crashed.clone());
    wait_until(Duration::from_secs(60), || async {
        ready_messages(&channel, poisoned.dead_letter_queue()).await == 1
            && ready_messages(&channel, innocent.suspect_queue()).await == 0
            && runs.of("s-1") >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.cancel();
    process.await.unwrap();
    killer.abort();
    assert_eq!(
        ready_messages(&channel, innocent.dead_letter_queue()).await,
        0,
        "the suspect never ran beside the poison message, so it is not blamed for its crashes"
    );
    assert_eq!(ready_messages(&channel, innocent.queue()).await, 0);
    assert_eq!(runs.of("s-1"), 1, "the suspect ran once, to its end");
    poisoned.delete(&channel).await.unwrap();
    innocent.delete(&channel).await.unwrap();
}

/// No ack covers a delivery still running: the first delivery hangs while the ones behind
/// it finish and are acked, then the consumer loses its connection. Had an ack covered the
/// hanging one (an ack with `multiple` for those behind it, say), its message would be gone;
/// it comes back and runs again.
async fn acks_never_pass_a_delivery_still_running(broker: Broker) {
    let orders = ["slow", "o-0", "o-1", "o-2", "o-3"];
    let (topology, channel) = topology_with_orders(broker, "multiple-acks", &orders).await;
    let runs = Runs::default();
    let hung = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let (runs, hung) = (runs.clone(), hung.clone());
        handler_fn(move |envelope: Envelope| {
            runs.count(&envelope);
            let hang =
                envelope.key().as_str() == "slow" && !hung.swap(true, std::sync::atomic::Ordering::SeqCst);
            async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok::<(), HandlerError>(())
            }
        })
    };
    let route = Route::new("multiple-acks", KeyExtractor::json_pointer("/orderId"), handler);
    let name = unique("oncely-test-multiple-acks");
    // A short grace: the lost channel's run abandons the hanging call and reconnects.
    let runner = Runner::new(route, topology.clone())
        .with_prefetch(20)
        .with_concurrency(10)
        .with_shutdown_grace(Duration::from_millis(200));
    let (shutdown, running) = start_runner(runner, broker.address(), &name);
    wait_until(Duration::from_secs(10), || async {
        runs.of("slow") == 1 && runs.keys_starting("o-") == 4
    })
    .await;
    // The four behind it are settled; give their acks time to reach the broker.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let closed = tokio::task::spawn_blocking(move || close_connections_on(broker, &name))
        .await
        .unwrap();
    assert_eq!(closed, 1);
    wait_until(Duration::from_secs(30), || async { runs.of("slow") == 2 }).await;
    stop_runner(shutdown, running).await;
    topology.delete(&channel).await.unwrap();
}
