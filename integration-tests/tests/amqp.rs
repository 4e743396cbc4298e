//! The RabbitMQ adapter against a real RabbitMQ, Redis and PostgreSQL: duplicates over
//! concurrent consumers, a consumer process killed mid-run, poison, retries and exhausted
//! attempts. Each test declares its own queues and deletes them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use integration_tests::amqp::{
    FLAG_RECORD_LEASE, close_connections_named, connect, drain, header_text, orders_route, ready_messages,
    scratch_topology,
};
use integration_tests::postgres::schema_pool;
use integration_tests::postgres::{ScratchSchema, pool};
use integration_tests::{redis_connection, redis_url, unique, wait_until};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{Envelope, HandlerError, Json, KeyExtractor, Route, handler_fn};
use oncely_amqp::{Producer, Runner, Topology};
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;

fn order_body(order: usize) -> Vec<u8> {
    format!(
        r#"{{"orderId":"order_{order}","sku":"sku_{}","quantity":1}}"#,
        order % 50
    )
    .into_bytes()
}

/// Publishes `orders` distinct orders plus 30 % more copies: half of the copies are
/// producer retries (same message id), half are re-sent orders (new id, same business key).
async fn publish_with_duplicates(producer: &Producer, queue: &str, orders: usize) -> usize {
    let mut ids = Vec::with_capacity(orders);
    for order in 0..orders {
        ids.push(
            producer
                .publish("", queue, &order_body(order), None)
                .await
                .expect("publish"),
        );
    }
    let copies = orders * 3 / 10;
    for copy in 0..copies {
        let order = (copy * 7919) % orders;
        if copy % 2 == 0 {
            producer
                .publish_with_id(&ids[order], "", queue, &order_body(order), None)
                .await
                .expect("re-publish");
        } else {
            producer
                .publish("", queue, &order_body(order), None)
                .await
                .expect("re-send");
        }
    }
    orders + copies
}

struct OrdersFixture {
    schema: ScratchSchema,
    topology: Topology,
    prefix: String,
}

impl OrdersFixture {
    async fn new(name: &str) -> Self {
        let schema = ScratchSchema::new(&pool(2)).await;
        schema
            .execute("CREATE TABLE stock_moves (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)")
            .await;
        let topology = scratch_topology(name);
        let channel = connect().await.unwrap().create_channel().await.unwrap();
        topology.declare(&channel).await.unwrap();
        OrdersFixture {
            schema,
            topology,
            prefix: unique("oncely-test"),
        }
    }

    /// Starts an `amqp_consumer` process on the fixture's queue, schema and Redis prefix,
    /// with `extra` arguments after those (the stack, the connection name, `--drain-ms`).
    fn consumer_process(&self, extra: &[&str]) -> ConsumerProcess {
        ConsumerProcess(
            std::process::Command::new(env!("CARGO_BIN_EXE_amqp_consumer"))
                .args([self.topology.queue(), self.schema.name(), &self.prefix])
                .args(extra)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("the consumer process starts"),
        )
    }

    /// Starts a consumer process with `stack_args`, SIGKILLs it once a third of `orders` is
    /// applied, and returns how many were applied then.
    async fn kill_mid_run(&self, stack_args: &[&str], orders: usize) -> i64 {
        let consumer = self.consumer_process(stack_args);
        wait_until(Duration::from_secs(60), || async {
            self.moves().await >= (orders / 3) as i64
        })
        .await;
        drop(consumer);
        let at_kill = self.moves().await;
        assert!(at_kill < orders as i64, "killed before the end ({at_kill})");
        at_kill
    }

    async fn moves(&self) -> i64 {
        self.schema.count("SELECT count(*) FROM stock_moves").await
    }

    async fn assert_each_order_once(&self, orders: usize) {
        assert_eq!(self.moves().await, orders as i64, "every order applied");
        let doubled = self
            .schema
            .count("SELECT count(*) FROM (SELECT order_id FROM stock_moves GROUP BY order_id HAVING count(*) > 1) d")
            .await;
        assert_eq!(doubled, 0, "no order applied twice");
        let recorded = self
            .schema
            .count("SELECT count(*) FROM consumption_record WHERE status = 'SUCCESS'")
            .await;
        assert_eq!(recorded, orders as i64);
    }

    async fn teardown(self) {
        let channel = connect().await.unwrap().create_channel().await.unwrap();
        self.topology.delete(&channel).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_thousand_messages_with_thirty_percent_duplicates_over_four_consumers_apply_each_order_once() {
    const ORDERS: usize = 3_850;
    let fixture = OrdersFixture::new("dedup").await;
    let route = orders_route(
        schema_pool(fixture.schema.name(), 16),
        fixture.schema.records(),
        redis_connection(&redis_url()).await,
        &fixture.prefix,
    );

    let producer = Producer::new(connect().await.unwrap());
    let published = publish_with_duplicates(&producer, fixture.topology.queue(), ORDERS).await;
    assert!(published >= 5_000, "{published}");

    let shutdown = CancellationToken::new();
    let connection = connect().await.unwrap();
    let mut consumers = Vec::new();
    for _ in 0..4 {
        let channel = connection.create_channel().await.unwrap();
        let runner = Runner::new(route.clone(), fixture.topology.clone()).with_prefetch(32);
        let shutdown = shutdown.clone();
        consumers.push(tokio::spawn(async move { runner.run(&channel, &shutdown).await }));
    }
    let watch = connection.create_channel().await.unwrap();
    wait_until(Duration::from_secs(120), || async {
        fixture.moves().await >= ORDERS as i64 && ready_messages(&watch, fixture.topology.queue()).await == 0
    })
    .await;
    // Let the in-flight copies settle, then stop gracefully.
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    for consumer in consumers {
        consumer.await.unwrap().expect("the runner stops cleanly");
    }
    fixture.assert_each_order_once(ORDERS).await;
    assert!(
        drain(&watch, fixture.topology.dead_letter_queue())
            .await
            .is_empty(),
        "nothing dead-lettered"
    );
    fixture.teardown().await;
}

/// An order as the typed handler takes it.
#[derive(serde::Deserialize)]
struct Order {
    #[serde(rename = "orderId")]
    order_id: String,
    quantity: i64,
}

/// The stock-deduction route with a typed handler, the flag with the record behind it and
/// the record: a body that is not an [`Order`] is dead-lettered before the handler runs, a
/// quantity out of i32's range is a permanent failure by its error's type, and `order_7`
/// fails its first attempt.
async fn typed_orders_route(
    fixture: &OrdersFixture,
) -> Route<impl integration_tests::RouteStack<std::convert::Infallible> + use<>> {
    let fails = Arc::new(AtomicU32::new(0));
    let deduct = move |tx: PgTransaction, Json(order): Json<Order>| {
        let fail = order.order_id == "order_7" && fails.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            let quantity = i32::try_from(order.quantity)?;
            if fail {
                return Err(HandlerError::transient("stock service busy"));
            }
            tx.execute(
                "INSERT INTO stock_moves (order_id) VALUES ($1)",
                &[&format!("{}:{quantity}", order.order_id)],
            )
            .await?;
            Ok(())
        }
    };
    let records = PgTransactionalLayer::new(schema_pool(fixture.schema.name(), 8), fixture.schema.records());
    let stack = ServiceBuilder::new()
        .layer(
            FlagLayer::new(
                RedisFlagStore::new(redis_connection(&redis_url()).await)
                    .with_prefix(fixture.prefix.as_str()),
                Duration::from_secs(600),
            )
            .with_record_behind(),
        )
        .service(records.handler(deduct));
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drained_run_ends_after_its_retries_and_reports_what_it_did() {
    const ORDERS: usize = 200;
    let fixture = OrdersFixture::new("drain").await;
    // The retry waits longer than the drain's idle time: the run must wait for it.
    let topology = fixture
        .topology
        .clone()
        .with_retry_delays([Duration::from_secs(2)]);
    let route = typed_orders_route(&fixture).await;
    let producer = Producer::new(connect().await.unwrap());
    let published = publish_with_duplicates(&producer, topology.queue(), ORDERS).await;
    for poison in [
        r#"{"orderId":"bad-1","quantity":"many"}"#,
        r#"{"orderId":"big-1","quantity":99999999999}"#,
    ] {
        producer
            .publish("", topology.queue(), poison.as_bytes(), None)
            .await
            .unwrap();
    }

    let runner = Runner::new(route, topology.clone()).with_drain(Duration::from_millis(500));
    let never = CancellationToken::new();
    let run = runner.run_with_reconnect(connect, &never);
    let report = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run drains by itself")
        .unwrap();

    println!("{report}");
    assert!(report.drained);
    assert_eq!(report.processed, ORDERS as u64);
    assert_eq!(
        report.duplicates.values().sum::<u64>(),
        (published - ORDERS) as u64
    );
    assert_eq!(report.retries, [("handler_failed".to_owned(), 1)].into());
    assert_eq!(report.dead_letters, [("bad_body", 1), ("rejected", 1)].into());
    assert_eq!(
        fixture.moves().await,
        ORDERS as i64,
        "order_7 too, after its retry"
    );
    fixture.assert_each_order_once(ORDERS).await;
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    let dead = drain(&channel, topology.dead_letter_queue()).await;
    let reasons: Vec<_> = dead
        .iter()
        .map(|message| header_text(message, oncely::dead_letter::REASON).unwrap())
        .collect();
    assert_eq!(reasons.len(), 2);
    assert!(reasons.contains(&"bad_body".to_owned()) && reasons.contains(&"rejected".to_owned()));
    for retry_queue in topology.retry_queues() {
        channel
            .queue_delete(retry_queue.into(), Default::default())
            .await
            .unwrap();
    }
    fixture.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_process_killed_mid_run_loses_nothing_and_applies_nothing_twice() {
    const ORDERS: usize = 1_500;
    let fixture = OrdersFixture::new("sigkill").await;
    let producer = Producer::new(connect().await.unwrap());
    publish_with_duplicates(&producer, fixture.topology.queue(), ORDERS).await;

    fixture.kill_mid_run(&[], ORDERS).await;

    let consumer = fixture.consumer_process(&[]);
    let watch = connect().await.unwrap().create_channel().await.unwrap();
    wait_until(Duration::from_secs(120), || async {
        fixture.moves().await >= ORDERS as i64 && ready_messages(&watch, fixture.topology.queue()).await == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(consumer);
    fixture.assert_each_order_once(ORDERS).await;
    fixture.teardown().await;
}

/// The red-packet shape — the flag with the record behind it, then the record — after a
/// SIGKILL mid-run: the restarted consumer handles the keys the dead process had in flight
/// at once. A flag that claimed them (as a flag alone does) would hold them for its whole
/// lease, a minute here, past the test's wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_mid_run_recovers_without_waiting_out_the_flag_lease() {
    killed_mid_run_then_drained("flag-record", "sigkill-recovery").await;
}

/// The full stack with the record batched, SIGKILLed with batches open: what the dead
/// process's open transactions held is rolled back with its connections, and the restarted
/// consumer applies every order once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batched_consumer_killed_mid_batch_applies_every_order_once() {
    killed_mid_run_then_drained("batched", "sigkill-batched").await;
}

/// Runs an `amqp_consumer` of `stack` over 1,500 orders with copies, SIGKILLs it a third of
/// the way, restarts it in drain mode and checks what it reports and what it applied.
async fn killed_mid_run_then_drained(stack: &str, name: &str) {
    const ORDERS: usize = 1_500;
    let fixture = OrdersFixture::new(name).await;
    let producer = Producer::new(connect().await.unwrap());
    let published = publish_with_duplicates(&producer, fixture.topology.queue(), ORDERS).await;

    let at_kill = fixture.kill_mid_run(&[stack], ORDERS).await;

    let restarted = Instant::now();
    let restarted_consumer = fixture.consumer_process(&[stack, "oncely-amqp-consumer", "--drain-ms", "1000"]);
    let drained = tokio::task::spawn_blocking(move || restarted_consumer.wait_for_output())
        .await
        .unwrap();
    let time_to_drain = restarted.elapsed();
    println!(
        "{stack}: {at_kill} of {ORDERS} orders ({published} messages) applied at the kill; drained \
         {time_to_drain:.1?} after the restart (flag lease {FLAG_RECORD_LEASE:?}):\n{drained}"
    );
    assert_eq!(
        drained.matches("drained in").count(),
        2,
        "both runners drained:\n{drained}"
    );
    assert!(
        !drained.contains("in_flight:flag"),
        "no delivery waited for the dead process's in-flight markers:\n{drained}"
    );
    fixture.assert_each_order_once(ORDERS).await;
    fixture.teardown().await;
}

/// A consumer process, killed with SIGKILL when dropped — also when the test fails.
struct ConsumerProcess(std::process::Child);

impl ConsumerProcess {
    /// Waits for the process to exit by itself (at most two minutes) and returns what it
    /// printed; panics if it failed or had to be killed.
    fn wait_for_output(mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.0.try_wait().expect("the consumer's status").is_none() {
            assert!(
                Instant::now() < deadline,
                "the consumer did not drain within two minutes"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let status = self.0.wait().expect("the consumer's status");
        let mut printed = String::new();
        std::io::Read::read_to_string(self.0.stdout.as_mut().expect("piped"), &mut printed)
            .expect("its output");
        assert!(status.success(), "the consumer failed ({status}):\n{printed}");
        printed
    }
}

impl Drop for ConsumerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fresh topology holding `bodies`, and a channel to inspect it with.
async fn queue_with(name: &str, bodies: &[&[u8]]) -> (Topology, lapin::Channel) {
    let topology = scratch_topology(name);
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    let producer = Producer::new(connect().await.unwrap());
    for body in bodies {
        producer.publish("", topology.queue(), body, None).await.unwrap();
    }
    (topology, channel)
}

#[tokio::test]
async fn the_producer_refuses_to_drop_an_unroutable_message() {
    let producer = Producer::new(connect().await.unwrap());
    let queue = format!("oncely-test-missing-{}", oncely::Token::random());
    let error = producer.publish("", &queue, b"{}", None).await.unwrap_err();
    assert!(
        matches!(error, oncely_amqp::Error::Unroutable { .. }),
        "refused at once, not retried: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_connection_is_reconnected_and_consumption_resumes() {
    const ORDERS: usize = 600;
    let fixture = OrdersFixture::new("reconnect").await;
    let producer = Producer::new(connect().await.unwrap());
    publish_with_duplicates(&producer, fixture.topology.queue(), ORDERS).await;

    let route = orders_route(
        schema_pool(fixture.schema.name(), 8),
        fixture.schema.records(),
        redis_connection(&redis_url()).await,
        &fixture.prefix,
    );
    let name = format!("oncely-reconnect-{}", oncely::Token::random());
    let connections = Arc::new(AtomicU32::new(0));
    let runner = Runner::new(route, fixture.topology.clone())
        .with_prefetch(4)
        .with_concurrency(2);
    let shutdown = CancellationToken::new();
    let running = {
        let (shutdown, name, connections) = (shutdown.clone(), name.clone(), connections.clone());
        tokio::spawn(async move {
            let connect = || {
                connections.fetch_add(1, Ordering::SeqCst);
                let properties =
                    lapin::ConnectionProperties::default().with_connection_name(name.as_str().into());
                let address = integration_tests::amqp::amqp_addr();
                async move { lapin::Connection::connect(&address, properties).await }
            };
            runner.run_with_reconnect(connect, &shutdown).await
        })
    };
    wait_until(Duration::from_secs(60), || async { fixture.moves().await >= 100 }).await;
    assert!(
        close_connections_named(&name) > 0,
        "the runner's connection was listed and closed"
    );
    let watch = connect().await.unwrap().create_channel().await.unwrap();
    wait_until(Duration::from_secs(120), || async {
        fixture.moves().await >= ORDERS as i64 && ready_messages(&watch, fixture.topology.queue()).await == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    running
        .await
        .unwrap()
        .expect("the runner stops at shutdown without an error");
    assert!(
        connections.load(Ordering::SeqCst) >= 2,
        "the runner connected again"
    );
    fixture.assert_each_order_once(ORDERS).await;
    fixture.teardown().await;
}

/// A route whose handler takes `work` and counts the runs that finished.
fn slow_route(
    work: Duration,
    finished: Arc<AtomicU32>,
) -> Route<
    impl tower::Service<Envelope, Response = oncely::Outcome, Error = std::convert::Infallible, Future: Send>
    + Clone
    + Send
    + Sync,
> {
    let handler = handler_fn(move |_: Envelope| {
        let finished = finished.clone();
        async move {
            tokio::time::sleep(work).await;
            finished.fetch_add(1, Ordering::SeqCst);
            Ok::<(), HandlerError>(())
        }
    });
    Route::new("slow", KeyExtractor::json_pointer("/orderId"), handler)
}

/// Starts a runner with `grace` on a fresh connection, cancels it once the handler is busy,
/// and returns after the runner stopped and its connection closed.
async fn stop_while_busy(topology: &Topology, work: Duration, grace: Duration) -> u32 {
    let finished = Arc::new(AtomicU32::new(0));
    let connection = connect().await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let runner = Runner::new(slow_route(work, finished.clone()), topology.clone()).with_shutdown_grace(grace);
    let shutdown = CancellationToken::new();
    let running = {
        let (channel, shutdown) = (channel.clone(), shutdown.clone());
        tokio::spawn(async move { runner.run(&channel, &shutdown).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    connection.close(200, "test done".into()).await.unwrap();
    finished.load(Ordering::SeqCst)
}

#[tokio::test]
async fn shutdown_lets_in_flight_deliveries_finish_within_the_grace_and_abandons_the_rest() {
    let (topology, channel) = queue_with("shutdown", &[&order_body(1)]).await;

    // Within the grace: the handler finishes and the delivery is acked.
    let finished = stop_while_busy(&topology, Duration::from_millis(700), Duration::from_secs(5)).await;
    assert_eq!(finished, 1);
    assert_eq!(
        ready_messages(&channel, topology.queue()).await,
        0,
        "acked before the runner stopped"
    );

    // Beyond the grace: the delivery is abandoned unacked and comes back.
    let producer = Producer::new(connect().await.unwrap());
    producer
        .publish("", topology.queue(), &order_body(2), None)
        .await
        .unwrap();
    let finished = stop_while_busy(&topology, Duration::from_secs(5), Duration::from_millis(100)).await;
    assert_eq!(finished, 0);
    wait_until(Duration::from_secs(5), || async {
        ready_messages(&channel, topology.queue()).await == 1
    })
    .await;
    topology.delete(&channel).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_resends_under_the_same_id_after_losing_its_connection() {
    let (topology, channel) = queue_with("resend", &[]).await;
    let name = format!("oncely-producer-{}", oncely::Token::random());
    let properties = lapin::ConnectionProperties::default()
        .with_connection_name(name.as_str().into())
        .enable_auto_recover();
    let connection = lapin::Connection::connect(&integration_tests::amqp::amqp_addr(), properties)
        .await
        .unwrap();
    let producer = Producer::new(connection)
        .with_confirm_timeout(Duration::from_secs(2))
        .with_max_attempts(20);
    producer
        .publish("", topology.queue(), &order_body(1), None)
        .await
        .unwrap();

    assert!(
        close_connections_named(&name) > 0,
        "the producer's connection was closed by the broker"
    );
    let id = producer
        .publish("", topology.queue(), &order_body(2), Some("order_2"))
        .await
        .expect("resent until confirmed");

    wait_until(Duration::from_secs(10), || async {
        ready_messages(&channel, topology.queue()).await >= 2
    })
    .await;
    let messages = drain(&channel, topology.queue()).await;
    let second: Vec<_> = messages
        .iter()
        .filter(|m| m.delivery.properties.message_id().as_ref().map(|id| id.as_str()) == Some(id.as_str()))
        .collect();
    assert!(!second.is_empty(), "the message after the drop arrived");
    assert_eq!(
        header_text(second[0], oncely_amqp::DEFAULT_KEY_HEADER).as_deref(),
        Some("order_2"),
        "with its business-key header"
    );
    topology.delete(&channel).await.unwrap();
}

/// A runner of a do-nothing route on its own queue.
fn idle_runner(queue: &str) -> Runner<impl integration_tests::RouteStack<std::convert::Infallible> + use<>> {
    let handler = handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) });
    let route = Route::new("idle", KeyExtractor::message_id(), handler);
    Runner::new(route, Topology::new(queue)).with_max_connect_failures(3)
}

/// `amqp_addr()` with the password replaced.
fn with_password(address: &str, password: &str) -> String {
    let (scheme, rest) = address.split_once("://").expect("an amqp:// address");
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://guest:{password}@{host}")
}

#[tokio::test]
async fn connection_failures_that_retrying_cannot_fix_end_the_runner_with_their_error() {
    let shutdown = CancellationToken::new();
    let address = integration_tests::amqp::amqp_addr();

    // Refused credentials: an error at once, not a silent reconnect loop.
    let wrong = with_password(&address, "not-the-password");
    let refused = tokio::time::timeout(
        Duration::from_secs(20),
        idle_runner(&unique("oncely-test-auth")).run_with_reconnect(
            || lapin::Connection::connect(&wrong, Default::default()),
            &shutdown,
        ),
    )
    .await
    .expect("the runner gives up instead of retrying forever");
    let error = refused.expect_err("wrong credentials are an error");
    assert!(
        matches!(error, oncely_amqp::Error::Amqp(_)) && !error.is_retryable(),
        "refused at the first attempt: {error}"
    );

    // A queue that exists with other arguments: the declaration is refused for good.
    let queue = unique("oncely-test-declare");
    let connection = lapin::Connection::connect(&address, Default::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let exclusive = lapin::options::QueueDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), exclusive, Default::default())
        .await
        .unwrap();
    let declared = idle_runner(&queue)
        .run_with_reconnect(
            || lapin::Connection::connect(&address, Default::default()),
            &shutdown,
        )
        .await;
    let error = declared.expect_err("a refused declaration is an error");
    assert!(
        matches!(&error, oncely_amqp::Error::QueueMismatch { queue: named, argument, .. }
            if *named == queue && argument == "durable")
            && !error.is_retryable(),
        "refused at the first attempt, naming the queue and the argument: {error}"
    );
    drop(connection);

    // Nobody listening: three failed attempts in a row, then the runner gives up.
    let started = Instant::now();
    let unreachable = idle_runner(&unique("oncely-test-unreachable"))
        .run_with_reconnect(
            || lapin::Connection::connect("amqp://127.0.0.1:1/%2f", Default::default()),
            &shutdown,
        )
        .await;
    assert!(
        matches!(
            unreachable,
            Err(oncely_amqp::Error::ConnectGaveUp { attempts: 3, .. })
        ),
        "{unreachable:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// The runner batches its acks (`multiple`) on a channel of its own: one delivery still
/// running must hold back no one's ack, and no ack may settle it. Order 1 is published first
/// (the lowest tag) and its handler never returns; the 19 behind it finish. Stopped with a
/// short grace, the runner abandons order 1: exactly it comes back, the 19 stay acked. A
/// `multiple` ack past it would lose it (nothing comes back); acks held behind it would
/// bring back all 20.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_ack_never_settles_a_delivery_still_running_nor_waits_for_it() {
    const ORDERS: usize = 20;
    let bodies: Vec<Vec<u8>> = (1..=ORDERS).map(order_body).collect();
    let bodies: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    let (topology, channel) = queue_with("batched-acks", &bodies).await;
    let finished = Arc::new(AtomicU32::new(0));
    let handler = handler_fn({
        let finished = finished.clone();
        move |envelope: Envelope| {
            let finished = finished.clone();
            async move {
                if envelope.key().as_str() == "order_1" {
                    std::future::pending::<()>().await;
                }
                finished.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        }
    });
    let route = Route::new("acks", KeyExtractor::json_pointer("/orderId"), handler);
    let runner = Runner::new(route, topology.clone()).with_shutdown_grace(Duration::from_millis(100));
    let (shutdown, running) = integration_tests::amqp::start_runner(
        runner,
        integration_tests::amqp::amqp_addr(),
        &unique("oncely-batched-acks"),
    );
    wait_until(Duration::from_secs(30), || async {
        finished.load(Ordering::SeqCst) == ORDERS as u32 - 1
    })
    .await;
    let report = integration_tests::amqp::stop_runner(shutdown, running).await;
    assert_eq!(report.abandoned, 1, "order 1 was still running: {report:?}");
    wait_until(Duration::from_secs(10), || async {
        ready_messages(&channel, topology.queue()).await == 1
    })
    .await;
    let back = drain(&channel, topology.queue()).await;
    assert_eq!(back.len(), 1, "only the delivery still running comes back");
    assert_eq!(back[0].delivery.data, order_body(1));
    topology.delete(&channel).await.unwrap();
}
