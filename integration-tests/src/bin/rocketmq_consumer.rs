//! Run with: `rocketmq_consumer TOPIC GROUP DEAD_LETTER_TOPIC SCHEMA REDIS_PREFIX` (started by
//! `make chaos`'s RocketMQ run, which kills it with SIGKILL mid-run).
//!
//! One consumer process of the RocketMQ chaos run: a push consumer in GROUP on TOPIC, one
//! message per listener call, with oncely's concurrent listener over the chaos stack shaped
//! as `examples/rocketmq-points` (`integration_tests::chaos_stack::chaos_points_route`):
//! keyed by KEYS in a namespace, a delivery limit counted in Redis, a `tower::timeout`
//! outermost, the Redis flag and the PostgreSQL record in transactional mode, to the chaos
//! handler. Dead letters go to DEAD_LETTER_TOPIC. Runs until it is killed or the process
//! that started it exits. Redis and PostgreSQL come from `REDIS_URL` and `DATABASE_URL`, the
//! Redis of the delivery counts from `ONCELY_DELIVERIES_REDIS_URL` (default `REDIS_URL`);
//! `ONCELY_CHAOS_FAULTS=PERCENT` sets the handler faults (none when unset; poison messages
//! SIGKILL this process either way).

use integration_tests::chaos_stack::{
    ChaosDatabase, ChaosStore, DELIVERIES_REDIS_ENV, HandlerFaults, chaos_points_route,
};
use integration_tests::rocketmq::ScratchRocketMq;
use integration_tests::{exit_when_orphaned, redis_connection, redis_url};
use oncely_rocketmq::ConcurrentListener;
use tokio::runtime::Handle;

#[tokio::main]
async fn main() {
    tokio::spawn(exit_when_orphaned());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [topic, group, dead_letter_topic, schema, prefix] = args.as_slice() else {
        eprintln!("usage: rocketmq_consumer TOPIC GROUP DEAD_LETTER_TOPIC SCHEMA REDIS_PREFIX");
        std::process::exit(2);
    };
    let redis = redis_connection(&redis_url()).await;
    let deliveries_url = std::env::var(DELIVERIES_REDIS_ENV).unwrap_or_else(|_| redis_url());
    let deliveries = redis_connection(&deliveries_url).await;
    let store = ChaosStore::Postgres;
    let faults = HandlerFaults::from_env(store, schema)
        .unwrap_or_else(|| HandlerFaults::new(0.0, ChaosDatabase::new(store, schema, 2)));
    let database = ChaosDatabase::new(store, schema, 8);
    let route = chaos_points_route(database, redis, deliveries, prefix, faults);

    let mut rocketmq = ScratchRocketMq::with_names(
        "chaos-consumer",
        topic.clone(),
        group.clone(),
        dead_letter_topic.clone(),
    )
    .await;
    let listener = ConcurrentListener::new(route, Handle::current(), rocketmq.dead_letters());
    rocketmq.consume_concurrently(topic, group, listener).await;
    std::future::pending::<()>().await;
}
