//! Run with: `cargo run -p rocketmq-points --bin credit-points` (Ctrl-C to stop), or with
//! `-- --drain` to stop once no message has arrived for five seconds and print a summary.
//!
//! The points-after-payment consumer: `rocketmq_points_payments` through the Redis flag and
//! the PostgreSQL record in transactional mode, on a RocketMQ push consumer with oncely's
//! concurrent listener. The handler writes one `points` row per order (the order id is the
//! primary key, the final word) and adds the points to the user's balance, both in the
//! record's transaction. Dead letters go to `rocketmq_points_dead_letters`; a second consumer
//! reads them back and prints their reasons.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::deliveries::RedisDeliveryCounter;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::{Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{Envelope, HandlerError, KeyExtractor, Route, handler_fn};
use oncely_rocketmq::rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, DefaultMQPushConsumer,
    MQPushConsumer, MessageListenerConcurrently,
};
use oncely_rocketmq::rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use oncely_rocketmq::{ConcurrentListener, DeadLetterTopic, OwnedClientRuntime};
use rocketmq_points::{
    DEAD_LETTER_TOPIC, GROUP, SCHEMA, TOPIC, namesrv_addr, pool, serve_metrics, setting, start_producer,
};
use tower::ServiceBuilder;

async fn credit_points(envelope: Envelope) -> Result<(), HandlerError> {
    let payment: serde_json::Value =
        serde_json::from_slice(envelope.delivery().body()).map_err(HandlerError::permanent)?;
    let (Some(user), Some(amount)) = (payment["userId"].as_str(), payment["amount"].as_i64()) else {
        return Err(HandlerError::permanent("a payment needs a userId and an amount"));
    };
    let points = i32::try_from(amount).map_err(HandlerError::permanent)?;
    let tx = envelope
        .extensions()
        .get::<PgTransaction>()
        .expect("the transactional record tier");
    // The record tier lets one delivery per key through; the primary key is the last word
    // should anything bypass it, and then the balance is left alone.
    let inserted = tx
        .client()
        .execute(
            "INSERT INTO points (order_id, user_id, points) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            &[&envelope.key().as_str(), &user, &points],
        )
        .await?;
    if inserted == 1 {
        tx.client()
            .execute(
                "INSERT INTO balances (user_id, points) VALUES ($1, $2)
                 ON CONFLICT (user_id) DO UPDATE SET points = balances.points + EXCLUDED.points",
                &[&user, &i64::from(points)],
            )
            .await?;
    }
    Ok(())
}

async fn prepare_database(pool: &deadpool_postgres::Pool, records: &Table) -> Result<(), oncely::StoreError> {
    migrate(pool, records).await?;
    let client = pool.get().await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS points (order_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, points INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS balances (user_id TEXT PRIMARY KEY, points BIGINT NOT NULL);",
        )
        .await?;
    Ok(())
}

/// Passes every batch on and notes when the last one came, for `--drain`.
struct Watched<L> {
    listener: L,
    last_message: Arc<Mutex<Option<Instant>>>,
}

impl<L: MessageListenerConcurrently> MessageListenerConcurrently for Watched<L> {
    fn consume_message(
        &self,
        messages: &[&MessageExt],
        context: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let status = self.listener.consume_message(messages, context);
        *self.last_message.lock().expect("not poisoned") = Some(Instant::now());
        status
    }
}

fn consumer(runtime: &OwnedClientRuntime, group: &str) -> DefaultMQPushConsumer {
    DefaultMQPushConsumer::builder(runtime.client_runtime())
        .consumer_group(group.to_owned())
        .name_server_addr(namesrv_addr())
        .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
        .build()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let drain = std::env::args().any(|arg| arg == "--drain");
    let metrics = serve_metrics()?;
    println!("metrics at http://{metrics}/metrics");
    let pool = pool();
    let records = Table::new(SCHEMA, "consumption_record")?;
    prepare_database(&pool, &records).await?;
    let redis = redis::Client::open(setting("REDIS_URL", "redis://127.0.0.1:6379"))?
        .get_connection_manager()
        .await?;

    let stack = ServiceBuilder::new()
        .layer(FlagLayer::new(
            RedisFlagStore::new(redis.clone()).with_prefix("rocketmq-points"),
            Duration::from_secs(24 * 3600),
        ))
        .layer(PgTransactionalLayer::new(pool.clone(), records))
        .service(handler_fn(credit_points));
    // KEYS carry the order id; the namespace keeps this operation's keys apart from other
    // consumers of the same payments (`order_1:credit_points`).
    // RocketMQ does not count a delivery whose consumer died: the route does, so a message
    // that crashes this process every time is dead-lettered after five tries.
    let route = Route::new(
        "credit_points",
        KeyExtractor::broker_key().with_namespace("credit_points"),
        stack,
    )
    .with_delivery_limit(RedisDeliveryCounter::new(redis).with_prefix("rocketmq-points"), 5);

    let (runtime, mut producer) = start_producer("rocketmq_points_dead_letters").await?;
    // The broker would create the dead-letter topic on its first message, but the reader
    // below, subscribed before that, would only learn of it at its next route refresh.
    let key = producer.create_topic_key().to_string();
    producer
        .create_topic(&key, DEAD_LETTER_TOPIC, 4, Default::default())
        .await?;
    let producer = Arc::new(producer);
    let last_message = Arc::new(Mutex::new(None));
    let mut payments = consumer(&runtime, GROUP);
    payments.subscribe(TOPIC, "*").await?;
    payments.register_message_listener_concurrently(Watched {
        listener: ConcurrentListener::new(
            route,
            tokio::runtime::Handle::current(),
            DeadLetterTopic::new(producer.clone(), DEAD_LETTER_TOPIC),
        ),
        last_message: last_message.clone(),
    });
    payments.start().await?;

    let reasons = Arc::new(Mutex::new(BTreeMap::<String, u64>::new()));
    let dead_letters_read = Arc::new(AtomicU64::new(0));
    let mut dead_letters = consumer(&runtime, "rocketmq_points_dead_letter_reader");
    dead_letters.subscribe(DEAD_LETTER_TOPIC, "*").await?;
    dead_letters.register_message_listener_concurrently({
        let (reasons, read) = (reasons.clone(), dead_letters_read.clone());
        move |messages: &[&MessageExt], _: &ConsumeConcurrentlyContext| {
            for message in messages {
                let reason = message
                    .properties()
                    .get(oncely::dead_letter::REASON)
                    .map_or_else(|| "none".to_owned(), |reason| reason.to_string());
                *reasons.lock().expect("not poisoned").entry(reason).or_default() += 1;
                read.fetch_add(1, Ordering::Relaxed);
            }
            Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
        }
    });
    dead_letters.start().await?;

    if drain {
        wait_until_idle(&last_message).await;
    } else {
        tokio::signal::ctrl_c().await?;
    }
    payments.shutdown().await;
    dead_letters.shutdown().await;

    let client = pool.get().await?;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM points), (SELECT COALESCE(sum(points), 0)::BIGINT FROM points),
                    (SELECT COALESCE(sum(points), 0)::BIGINT FROM balances)",
            &[],
        )
        .await?;
    let (orders, credited, balances): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    println!(
        "points: {orders} orders credited, {credited} points; balances total {balances}; dead letters read: {} {:?}",
        dead_letters_read.load(Ordering::Relaxed),
        reasons.lock().expect("not poisoned")
    );
    if credited != balances {
        eprintln!("FAIL: the balances do not add up to the points credited");
        std::process::exit(1);
    }
    runtime.shutdown().await;
    Ok(())
}

/// Returns once no message has arrived for five seconds (or none at all in the first 60 s).
async fn wait_until_idle(last_message: &Mutex<Option<Instant>>) {
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let last = *last_message.lock().expect("not poisoned");
        match last {
            Some(at) if at.elapsed() > Duration::from_secs(5) => return,
            None if started.elapsed() > Duration::from_secs(60) => return,
            _ => {}
        }
    }
}
