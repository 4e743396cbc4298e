//! RabbitMQ for the tests: connections on `AMQP_ADDR` (RabbitMQ 3.10) and `AMQP_ADDR_4`
//! (RabbitMQ 4.0), queues of each test's own, runners in tasks of their own, and the
//! stock-deduction route the tests and the consumer process share.

use std::collections::HashMap;
use std::convert::Infallible;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::postgres::Table;
use oncely::record::PgTransactionalLayer;
use oncely::report::RunReport;
use oncely::{Envelope, KeyExtractor, Outcome, Route, handler_fn};
use oncely_amqp::{Producer, Runner, Topology};
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;

use crate::postgres::stock_move;

/// The RabbitMQ the tests use: `AMQP_ADDR`, or `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_addr() -> String {
    std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A connection to `AMQP_ADDR`.
pub async fn connect() -> Result<Connection, lapin::Error> {
    connect_to(&amqp_addr(), ConnectionProperties::default()).await
}

/// A connection to `address`: over TLS for `amqps://`, trusting the test CA and presenting
/// the client certificate ([`crate::tls::settings`]).
pub async fn connect_to(address: &str, properties: ConnectionProperties) -> Result<Connection, lapin::Error> {
    match address.starts_with("amqps://") {
        true => {
            let config = oncely_amqp::tls::config(&crate::tls::settings()).expect("the test certificates");
            let runtime = lapin::runtime::default_runtime()?;
            Connection::connect_with_config(address, properties, config, runtime).await
        }
        false => Connection::connect(address, properties).await,
    }
}

/// The RabbitMQ versions the tests run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broker {
    /// RabbitMQ 3.10 (Debian 12's) at `AMQP_ADDR`.
    Rabbit3,
    /// RabbitMQ 4.0 (Debian 13's) at `AMQP_ADDR_4`, default `amqp://guest:guest@127.0.0.1:5673/%2f`.
    Rabbit4,
    /// RabbitMQ 3.10 over TLS, with a client certificate: `AMQP_TLS_ADDR`, default
    /// `amqps://guest:guest@127.0.0.1:5671/%2f` (`services.sh tls`).
    Rabbit3Tls,
}

impl Broker {
    /// Its AMQP address.
    pub fn address(self) -> String {
        match self {
            Broker::Rabbit3 => amqp_addr(),
            Broker::Rabbit4 => std::env::var("AMQP_ADDR_4")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5673/%2f".into()),
            Broker::Rabbit3Tls => crate::tls::amqp_tls_addr(),
        }
    }

    /// The broker `AMQP_ADDR` names: RabbitMQ 4.0 when it is `AMQP_ADDR_4`'s address (a
    /// chaos run pointed at 4.0), 3.10 otherwise. Tells which `rabbitmqctl` reaches it.
    pub fn at_amqp_addr() -> Broker {
        match amqp_addr() == Broker::Rabbit4.address() {
            true => Broker::Rabbit4,
            false => Broker::Rabbit3,
        }
    }

    /// Its `host:port`.
    pub fn host_port(self) -> String {
        let address = self.address();
        let rest = address
            .split_once("://")
            .map_or(address.as_str(), |(_, rest)| rest);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
        rest.split('/').next().unwrap_or(rest).to_owned()
    }

    /// A connection to it.
    pub async fn connect(self) -> Connection {
        connect_to(&self.address(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|error| {
                panic!("{self:?} unreachable ({error}); run integration-tests/services.sh")
            })
    }

    /// Runs its `rabbitmqctl` with `arguments` (RabbitMQ 4.0's through `services.sh
    /// rabbitmqctl4`, inside its Debian 13 root) and returns what it printed; panics if it
    /// fails.
    pub fn rabbitmqctl<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(self, arguments: &[S]) -> String {
        let output = self
            .rabbitmqctl_command()
            .args(arguments)
            .output()
            .expect("rabbitmqctl runs");
        assert!(
            output.status.success(),
            "rabbitmqctl {arguments:?} on {self:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn rabbitmqctl_command(self) -> Command {
        match self {
            Broker::Rabbit3 | Broker::Rabbit3Tls => Command::new("rabbitmqctl"),
            Broker::Rabbit4 => {
                let mut command = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/services.sh"));
                command.arg("rabbitmqctl4");
                command
            }
        }
    }
}

/// Turns async functions taking a [`Broker`] into one test per broker, in modules
/// `rabbitmq_3` and `rabbitmq_4`.
#[macro_export]
macro_rules! on_both_brokers {
    ($($case:ident),* $(,)?) => {
        mod rabbitmq_3 {
            $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                super::$case($crate::amqp::Broker::Rabbit3).await
            }
            )*
        }
        mod rabbitmq_4 {
            $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                super::$case($crate::amqp::Broker::Rabbit4).await
            }
            )*
        }
    };
}

/// A fresh topology on `broker` holding one message per order id (body `{"orderId":…}`),
/// and a channel to inspect it with.
pub async fn topology_with_orders(broker: Broker, name: &str, orders: &[&str]) -> (Topology, Channel) {
    let topology = scratch_topology(name);
    let channel = broker.connect().await.create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    let producer = Producer::new(broker.connect().await);
    for order in orders {
        let body = format!(r#"{{"orderId":"{order}"}}"#);
        producer
            .publish("", topology.queue(), body.as_bytes(), None)
            .await
            .unwrap();
    }
    (topology, channel)
}

/// Counts handler runs per business key.
#[derive(Clone, Default)]
pub struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    /// Counts a run of `envelope`'s key and returns how many it has had.
    pub fn count(&self, envelope: &Envelope) -> u32 {
        let mut runs = self.0.lock().unwrap();
        let count = runs.entry(envelope.key().to_string()).or_default();
        *count += 1;
        *count
    }

    /// How many runs `key` had.
    pub fn of(&self, key: &str) -> u32 {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// How many keys starting with `prefix` ran.
    pub fn keys_starting(&self, prefix: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .keys()
            .filter(|key| key.starts_with(prefix))
            .count()
    }
}

/// A runner running in a task of its own.
pub type Running = tokio::task::JoinHandle<Result<RunReport, oncely_amqp::Error>>;

/// Starts `runner` on its own connections to `address` named `name`, reconnecting when the
/// broker drops one.
pub fn start_runner<S>(runner: Runner<S>, address: String, name: &str) -> (CancellationToken, Running)
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
                let address = address.clone();
                async move { connect_to(&address, properties).await }
            };
            runner.run_with_reconnect(connect, &shutdown).await
        })
    };
    (shutdown, running)
}

/// Closes the connections named `name` on `broker` each time `crashed` is notified, as a
/// consumer process that dies holding its deliveries would lose them, until aborted.
pub fn crash_on_notify(
    broker: Broker,
    name: &str,
    crashed: Arc<tokio::sync::Notify>,
) -> tokio::task::JoinHandle<()> {
    let name = name.to_owned();
    tokio::spawn(async move {
        loop {
            crashed.notified().await;
            let name = name.clone();
            tokio::task::spawn_blocking(move || close_connections_on(broker, &name))
                .await
                .unwrap();
        }
    })
}

/// Runs `route` over `topology` (dead-lettering after 3 runs alone) as a consumer named
/// after `name`, cut off from `broker` each time `crashed` is notified, until the dead-letter
/// queue holds one message and `runs` counted 20 keys starting with `ok`; then stops it.
/// A crash loop among 20 good messages, for its test to check what it left.
pub async fn run_through_a_crash_loop<S>(
    broker: Broker,
    route: Route<S>,
    topology: &Topology,
    name: &str,
    crashed: Arc<tokio::sync::Notify>,
    runs: &Runs,
) where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    let connection = broker.connect().await;
    let channel = connection.create_channel().await.unwrap();
    let runner = Runner::new(route, topology.clone())
        .with_max_deliveries(3)
        .with_shutdown_grace(Duration::from_millis(100));
    let name = crate::unique(name);
    let (shutdown, running) = start_runner(runner, broker.address(), &name);
    let killer = crash_on_notify(broker, &name, crashed);
    let dlq = topology.dead_letter_queue();
    crate::wait_until(Duration::from_secs(60), || async {
        ready_messages(&channel, dlq).await == 1 && runs.keys_starting("ok") == 20
    })
    .await;
    stop_runner(shutdown, running).await;
    killer.abort();
}

/// Stops a runner [`start_runner`] started, checks it ended without an error and returns its
/// report.
pub async fn stop_runner(shutdown: CancellationToken, running: Running) -> RunReport {
    shutdown.cancel();
    let ended = running.await.expect("the runner task does not panic");
    ended.expect("the runner stops at shutdown without an error")
}

/// The topology of `queue` with the tests' short retry delays (100 ms, 300 ms).
pub fn test_topology(queue: &str) -> Topology {
    Topology::new(queue).with_retry_delays([Duration::from_millis(100), Duration::from_millis(300)])
}

/// [`test_topology`] on a fresh queue name.
pub fn scratch_topology(name: &str) -> Topology {
    test_topology(&format!("oncely-test-{name}-{}", oncely::Token::random()))
}

/// How many messages are ready in `queue`.
pub async fn ready_messages(channel: &Channel, queue: &str) -> u32 {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .map(|queue| queue.message_count())
        .unwrap_or(0)
}

/// Takes every message from `queue` (acking them), for inspection.
pub async fn drain(channel: &Channel, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
    let mut messages = Vec::new();
    while let Ok(Some(message)) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
    {
        messages.push(message);
    }
    messages
}

/// The header `name` of a message taken from a queue, as text: strings as they are, any
/// other type in its debug form (`LongLongInt(3)`), so that a test comparing it with the text
/// oncely writes also checks its type (every value oncely writes is text).
pub fn header_text(message: &lapin::message::BasicGetMessage, name: &str) -> Option<String> {
    let headers = message.delivery.properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}

/// Closes, on the side of the broker at `AMQP_ADDR`, every connection whose client
/// properties carry `name`, as a network failure or a broker operator would, and returns how
/// many it closed.
pub fn close_connections_named(name: &str) -> usize {
    close_connections_on(Broker::at_amqp_addr(), name)
}

/// [`close_connections_named`] on `broker`.
pub fn close_connections_on(broker: Broker, name: &str) -> usize {
    let rabbitmqctl = |arguments: &[&str]| broker.rabbitmqctl_command().args(arguments).output();
    let Ok(listed) = rabbitmqctl(&["list_connections", "-q", "pid", "client_properties"]) else {
        return 0;
    };
    let pids: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|line| line.contains(name))
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    pids.iter()
        .filter(|pid| {
            rabbitmqctl(&[
                "close_connection",
                pid.as_str(),
                "oncely test: connection dropped",
            ])
            .is_ok_and(|output| output.status.success())
        })
        .count()
}

/// The stock-deduction route: keyed by the body's `/orderId`, through the Redis flag, the
/// Redis lock on the body's `/sku` and the PostgreSQL record in transactional mode, to a
/// handler that inserts one `stock_moves` row per order in the record's transaction.
/// `pool`'s connections must search the schema holding `stock_moves` first; Redis keys
/// start with `prefix`.
pub fn orders_route(
    pool: Pool,
    records: Table,
    redis: ConnectionManager,
    prefix: &str,
) -> Route<impl crate::RouteStack<Infallible> + use<>> {
    let stack = ServiceBuilder::new()
        .layer(orders_flag(redis.clone(), prefix))
        .layer(orders_lock(redis, prefix))
        .service(PgTransactionalLayer::new(pool, records).handler(stock_move));
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The stock-deduction route at broker speed: the Redis flag with the record behind it (lease
/// [`FLAG_RECORD_LEASE`]), the
/// Redis lock on the body's `/sku` and the PostgreSQL record, batched, to the handler
/// inserting one `stock_moves` row per order in the batch's transaction.
pub fn batched_orders_route(
    pool: Pool,
    records: Table,
    redis: ConnectionManager,
    prefix: &str,
) -> Route<impl crate::RouteStack<Infallible> + use<>> {
    let stack = ServiceBuilder::new()
        .layer(
            orders_flag(redis.clone(), prefix)
                .with_lease(FLAG_RECORD_LEASE)
                .with_record_behind(),
        )
        .layer(orders_lock(redis, prefix))
        .service(
            PgTransactionalLayer::new(pool, records)
                .batched()
                .handler(stock_move),
        );
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The lock of the stock-deduction routes: one order per product at a time.
pub fn orders_lock(redis: ConnectionManager, prefix: &str) -> LockLayer<RedisLockStore<ConnectionManager>> {
    LockLayer::new(
        RedisLockStore::new(redis).with_prefix(prefix),
        KeyExtractor::json_pointer("/sku"),
    )
    .with_lease(Duration::from_secs(5))
    .with_busy_delay(Duration::from_millis(100))
}

/// The lease of [`flag_record_orders_route`]'s and [`batched_orders_route`]'s flag: long, so
/// that a recovery that waited for it would be plain to see (a flag with the record behind
/// it claims nothing, so none should).
pub const FLAG_RECORD_LEASE: Duration = Duration::from_secs(60);

/// The red-packet shape of the stock-deduction route: the Redis flag with the record behind
/// it (lease [`FLAG_RECORD_LEASE`]) in front of the PostgreSQL record in transactional mode,
/// no lock, to the handler inserting one `stock_moves` row per order in the record's
/// transaction.
pub fn flag_record_orders_route(
    pool: Pool,
    records: Table,
    redis: ConnectionManager,
    prefix: &str,
) -> Route<impl crate::RouteStack<Infallible> + use<>> {
    let flag = orders_flag(redis, prefix)
        .with_lease(FLAG_RECORD_LEASE)
        .with_record_behind();
    let stack = ServiceBuilder::new()
        .layer(flag)
        .service(PgTransactionalLayer::new(pool, records).handler(stock_move));
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The weaker stack for comparison: only the Redis flag in front of a handler that inserts
/// the `stock_moves` row on its own (no record, no transaction). What Redis forgets — a
/// flush, a restart, a crash between the handler and the flag's completion — it applies
/// again.
pub fn flag_only_orders_route(
    pool: Pool,
    redis: ConnectionManager,
    prefix: &str,
) -> Route<impl crate::RouteStack<Infallible> + use<>> {
    let handler = handler_fn(move |envelope: Envelope| {
        let pool = pool.clone();
        async move {
            pool.get()
                .await?
                .execute(
                    "INSERT INTO stock_moves (order_id) VALUES ($1)",
                    &[&envelope.key().as_str()],
                )
                .await?;
            Ok::<(), oncely::HandlerError>(())
        }
    });
    let stack = ServiceBuilder::new()
        .layer(orders_flag(redis, prefix))
        .service(handler);
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// The flag of the stock-deduction routes: done keys remembered for ten minutes, an
/// in-flight mark of five seconds; Redis keys start with `prefix`.
pub fn orders_flag(redis: ConnectionManager, prefix: &str) -> FlagLayer<RedisFlagStore<ConnectionManager>> {
    FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix(prefix),
        Duration::from_secs(600),
    )
    .with_lease(Duration::from_secs(5))
    .with_in_flight_delay(Duration::from_millis(100))
}
