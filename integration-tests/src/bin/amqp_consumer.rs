//! Run with: `amqp_consumer QUEUE SCHEMA REDIS_PREFIX` (started by the AMQP tests, which kill
//! it with SIGKILL mid-run).
//!
//! One consumer process of the stock-deduction route: four runners on the queue, through
//! the Redis flag and the PostgreSQL record in transactional mode, until it is killed.

use integration_tests::amqp::{connect, orders_route, test_topology};
use integration_tests::postgres::schema_pool;
use integration_tests::{redis_connection, redis_url};
use oncely::flag::RedisFlagStore;
use oncely::postgres::Table;
use oncely_amqp::Runner;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [queue, schema, prefix] = args.as_slice() else {
        eprintln!("usage: amqp_consumer QUEUE SCHEMA REDIS_PREFIX");
        std::process::exit(2);
    };
    let flags = RedisFlagStore::new(redis_connection(&redis_url()).await).with_prefix(prefix.as_str());
    let records = Table::new(schema, "consumption_record").expect("a valid schema");
    let route = orders_route(schema_pool(schema, 8), records, flags);
    let shutdown = CancellationToken::new();
    let runners: Vec<_> = (0..4)
        .map(|_| {
            let runner = Runner::new(route.clone(), test_topology(queue)).with_prefetch(16);
            let shutdown = shutdown.clone();
            tokio::spawn(async move { runner.run_with_reconnect(connect, &shutdown).await })
        })
        .collect();
    for runner in runners {
        let _ = runner.await;
    }
}
