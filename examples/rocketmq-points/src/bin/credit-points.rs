//! Run with: `cargo run -p rocketmq-points --bin credit-points` (Ctrl-C to stop), or with
//! `-- --drain` to stop once the group has consumed everything, its broker retries included,
//! and nothing arrived for five seconds. Either way it prints the run's report and checks
//! the points against the balances.
//!
//! The points-after-payment consumer: `rocketmq_points_payments` through the Redis flag and
//! the PostgreSQL record in transactional mode, on a RocketMQ push consumer with oncely's
//! concurrent listener. The typed handler takes the payment (a body that is not one is
//! dead-lettered as `bad_body`), its order id and the record's transaction, writes one
//! `points` row per order (the order id is the primary key, the final word) and adds the
//! points to the user's balance, both in the transaction. Dead letters go to
//! `rocketmq_points_dead_letters`, with their reasons counted in the report.

use std::time::Duration;

use oncely::deliveries::RedisDeliveryCounter;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::postgres::{Table, migrate};
use oncely::record::{PgTransaction, PgTransactionalLayer};
use oncely::{BusinessKey, HandlerError, Json, KeyExtractor, Route};
use oncely_rocketmq::rocketmq_client_rust::{DefaultMQPushConsumer, MQPushConsumer};
use oncely_rocketmq::rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use oncely_rocketmq::{ConcurrentListener, DeadLetterTopic, GroupLag};
use rocketmq_points::{
    DEAD_LETTER_TOPIC, GROUP, SCHEMA, TOPIC, namesrv_addr, pool, serve_metrics, setting, start_producer,
};
use tower::ServiceBuilder;

#[derive(serde::Deserialize)]
struct Payment {
    #[serde(rename = "userId")]
    user_id: String,
    amount: i64,
}

async fn credit_points(
    tx: PgTransaction,
    order: BusinessKey,
    Json(payment): Json<Payment>,
) -> Result<(), HandlerError> {
    // An amount beyond i32 is a permanent failure by its error's type.
    let points = i32::try_from(payment.amount)?;
    // The record tier lets one delivery per key through; the primary key is the last word
    // should anything bypass it, and then the balance is left alone.
    let inserted = tx
        .execute(
            "INSERT INTO points (order_id, user_id, points) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            &[&order.as_str(), &payment.user_id, &points],
        )
        .await?;
    if inserted == 1 {
        tx.execute(
            "INSERT INTO balances (user_id, points) VALUES ($1, $2)
             ON CONFLICT (user_id) DO UPDATE SET points = balances.points + EXCLUDED.points",
            &[&payment.user_id, &i64::from(points)],
        )
        .await?;
    }
    Ok(())
}

/// Prints what was credited, and exits 1 if the balances do not add up to the points.
async fn check_balances(pool: &deadpool_postgres::Pool) -> Result<(), Box<dyn std::error::Error>> {
    let client = pool.get().await?;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM points), (SELECT COALESCE(sum(points), 0)::BIGINT FROM points),
                    (SELECT COALESCE(sum(points), 0)::BIGINT FROM balances)",
            &[],
        )
        .await?;
    let (orders, credited, balances): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    println!("points: {orders} orders credited, {credited} points; balances total {balances}");
    if credited != balances {
        eprintln!("FAIL: the balances do not add up to the points credited");
        std::process::exit(1);
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let drain = std::env::args().any(|arg| arg == "--drain");
    let metrics = serve_metrics()?;
    println!("metrics at http://{metrics}/metrics");
    let pool = pool();
    let records = Table::new(SCHEMA, "consumption_record")?;
    prepare_database(&pool, &records).await?;
    let tls = oncely::tls::TlsSettings::from_env()?;
    let redis = oncely::tls::redis::client(setting("REDIS_URL", "redis://127.0.0.1:6379"), &tls)?
        .get_connection_manager()
        .await?;

    let flag = FlagLayer::new(
        RedisFlagStore::new(redis.clone()).with_prefix("rocketmq-points"),
        Duration::from_secs(24 * 3600),
    )
    .with_record_behind();
    let stack = ServiceBuilder::new()
        .layer(flag)
        .service(PgTransactionalLayer::new(pool.clone(), records).handler(credit_points));
    // KEYS carry the order id; the namespace keeps this operation's keys apart from other
    // consumers of the same payments (`order_1:credit_points`).
    // RocketMQ does not count a delivery whose consumer died: the route does, so a message
    // that crashes this process every time is dead-lettered after five crashes alone (six
    // runs: its first, perhaps beside others, is not counted against it).
    let route = Route::new(
        "credit_points",
        KeyExtractor::broker_key().with_namespace("credit_points"),
        stack,
    )
    .with_delivery_limit(RedisDeliveryCounter::new(redis).with_prefix("rocketmq-points"), 5);

    let (runtime, producer) = start_producer("rocketmq_points_dead_letters").await?;
    let dead_letters = DeadLetterTopic::new(producer, DEAD_LETTER_TOPIC);
    let listener = ConcurrentListener::new(route, tokio::runtime::Handle::current(), dead_letters.clone());
    let progress = listener.progress();
    let mut payments = DefaultMQPushConsumer::builder(runtime.client_runtime())
        .consumer_group(GROUP.to_owned())
        .name_server_addr(namesrv_addr())
        .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
        .build();
    payments.subscribe(TOPIC, "*").await?;
    payments.register_message_listener_concurrently(listener);
    payments.start().await?;

    let report = if drain {
        let lag = GroupLag::start(&runtime, &namesrv_addr(), GROUP, TOPIC).await?;
        let report = progress.wait_until_drained(Duration::from_secs(5), &lag).await;
        lag.shutdown().await;
        report
    } else {
        tokio::signal::ctrl_c().await?;
        progress.report()
    };
    payments.shutdown().await;
    // Before the runtime, which otherwise waits 30 s for the running producer's tasks.
    dead_letters.shutdown().await;
    println!("{report}");

    check_balances(&pool).await?;
    runtime.shutdown().await;
    Ok(())
}
