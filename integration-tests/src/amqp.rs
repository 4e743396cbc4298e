//! RabbitMQ for the tests: connections on `AMQP_ADDR`, queues of each test's own, and the
//! stock-deduction route the tests and the consumer process share.

use std::convert::Infallible;
use std::process::{Command, Stdio};
use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::postgres::Table;
use oncely::record::PgTransactionalLayer;
use oncely::{Envelope, KeyExtractor, Route, handler_fn};
use oncely_amqp::Topology;
use redis::aio::ConnectionManager;
use tower::ServiceBuilder;

use crate::postgres::stock_move;

/// The RabbitMQ the tests use: `AMQP_ADDR`, or `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_addr() -> String {
    std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A connection to `AMQP_ADDR`.
pub async fn connect() -> Result<Connection, lapin::Error> {
    Connection::connect(&amqp_addr(), ConnectionProperties::default()).await
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

/// The header `name` of a message taken from a queue, as text: strings as they are, numbers
/// in decimal (the runner's attempt counters), anything else in its debug form.
pub fn header_text(message: &lapin::message::BasicGetMessage, name: &str) -> Option<String> {
    let headers = message.delivery.properties.headers().as_ref()?;
    match headers.inner().get(name)? {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        AMQPValue::LongLongInt(number) => Some(number.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Closes, on the broker's side, every connection whose client properties carry `name`,
/// as a network failure or a broker operator would, and returns how many it closed.
pub fn close_connections_named(name: &str) -> usize {
    let Ok(listed) = Command::new("rabbitmqctl")
        .args(["list_connections", "-q", "pid", "client_properties"])
        .output()
    else {
        return 0;
    };
    let pids: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter(|line| line.contains(name))
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    pids.iter()
        .filter(|pid| {
            Command::new("rabbitmqctl")
                .args([
                    "close_connection",
                    pid.as_str(),
                    "oncely test: connection dropped",
                ])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
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
fn orders_lock(redis: ConnectionManager, prefix: &str) -> LockLayer<RedisLockStore<ConnectionManager>> {
    LockLayer::new(
        RedisLockStore::new(redis).with_prefix(prefix),
        KeyExtractor::json_pointer("/sku"),
    )
    .with_lease(Duration::from_secs(5))
    .with_busy_delay(Duration::from_millis(100))
}

/// The lease of [`flag_record_orders_route`]'s and [`batched_orders_route`]'s flag: long, so that a recovery that waited
/// for it would be plain to see.
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

fn orders_flag(redis: ConnectionManager, prefix: &str) -> FlagLayer<RedisFlagStore<ConnectionManager>> {
    FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix(prefix),
        Duration::from_secs(600),
    )
    .with_lease(Duration::from_secs(5))
    .with_in_flight_delay(Duration::from_millis(100))
}
