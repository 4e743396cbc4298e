//! Run with: `amqp_consumer QUEUE SCHEMA REDIS_PREFIX [full|flag-only] [CONNECTION_NAME]`
//! (started by the AMQP tests and `make chaos`, which kill it with SIGKILL mid-run).
//!
//! One consumer process of the stock-deduction route: two runners on the queue, each on
//! its own connection (named CONNECTION_NAME, so a test can drop exactly these), through the
//! full stack (Redis flag, Redis lock, PostgreSQL record in transactional mode; the
//! default) or the Redis flag alone, until it is killed or the process that started it
//! exits. Redis and PostgreSQL come from `REDIS_URL` and `DATABASE_URL`.
//!
//! With `ONCELY_CHAOS_FAULTS=PERCENT` set (by `make chaos`), the same tiers run behind a
//! `tower::timeout` in front of the chaos handler of `integration_tests::chaos_stack`: a
//! two-row effect, PERCENT % of calls each panicking, timing out and swallowing a failed
//! statement, and poison messages that SIGKILL this process.

use integration_tests::amqp::{amqp_addr, flag_only_orders_route, orders_route, test_topology};
use integration_tests::chaos_stack::{ChaosStack, HandlerFaults, chaos_flag_only_route, chaos_orders_route};
use integration_tests::postgres::schema_pool;
use integration_tests::{exit_when_orphaned, redis_connection, redis_url};
use lapin::{Connection, ConnectionProperties};
use oncely::postgres::Table;
use oncely::{BoxError, Envelope, Outcome, Route};
use oncely_amqp::Runner;
use tokio_util::sync::CancellationToken;

/// Runs two runners of `route` on `queue` until the process is killed.
async fn consume<S>(route: Route<S>, queue: &str, connection_name: &str)
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let shutdown = CancellationToken::new();
    let runners: Vec<_> = (0..2)
        .map(|_| {
            let runner = Runner::new(route.clone(), test_topology(queue)).with_prefetch(16);
            let (shutdown, name) = (shutdown.clone(), connection_name.to_owned());
            tokio::spawn(async move {
                let connect = || {
                    let properties =
                        ConnectionProperties::default().with_connection_name(name.clone().into());
                    async move { Connection::connect(&amqp_addr(), properties).await }
                };
                runner.run_with_reconnect(connect, &shutdown).await
            })
        })
        .collect();
    for runner in runners {
        if let Ok(Err(error)) = runner.await {
            eprintln!("amqp_consumer: {error}");
            std::process::exit(1);
        }
    }
}

#[tokio::main]
async fn main() {
    tokio::spawn(exit_when_orphaned());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (queue, schema, prefix, stack, name) = match args.as_slice() {
        [queue, schema, prefix, rest @ ..] if rest.len() <= 2 => (
            queue,
            schema,
            prefix,
            rest.first().map_or(Ok(ChaosStack::Full), |stack| stack.parse()),
            rest.get(1).map_or("oncely-amqp-consumer", String::as_str),
        ),
        _ => {
            eprintln!("usage: amqp_consumer QUEUE SCHEMA REDIS_PREFIX [full|flag-only] [CONNECTION_NAME]");
            std::process::exit(2);
        }
    };
    let stack = stack.unwrap_or_else(|problem| {
        eprintln!("{problem}");
        std::process::exit(2);
    });
    let redis = redis_connection(&redis_url()).await;
    let pool = schema_pool(schema, 8);
    let records = || Table::new(schema, "consumption_record").expect("a valid schema");
    match (stack, HandlerFaults::from_env(schema)) {
        (ChaosStack::Full, None) => consume(orders_route(pool, records(), redis, prefix), queue, name).await,
        (ChaosStack::Full, Some(faults)) => {
            let route = chaos_orders_route(pool, records(), redis, prefix, faults);
            consume(route, queue, name).await;
        }
        (ChaosStack::FlagOnly, None) => {
            consume(flag_only_orders_route(pool, redis, prefix), queue, name).await;
        }
        (ChaosStack::FlagOnly, Some(faults)) => {
            consume(chaos_flag_only_route(pool, redis, prefix, faults), queue, name).await;
        }
    }
}
