//! Run with: `amqp_consumer QUEUE SCHEMA REDIS_PREFIX [full|flag-only|flag-record|batched]
//! [CONNECTION_NAME] [--drain-ms MS] [--store postgres|mysql] [--default-prefetch]` (started by
//! the AMQP tests and `make chaos`, which kill it with SIGKILL mid-run).
//!
//! One consumer process of the stock-deduction route: two runners on the queue, each on
//! its own connection (named CONNECTION_NAME, so a test can drop exactly these), through the
//! full stack (Redis flag, Redis lock, PostgreSQL record in transactional mode; the
//! default), the Redis flag alone, the Redis flag with the record behind it and the
//! record (no lock), or the full stack with the record batched, until it is killed or the process that started it exits — or, with
//! `--drain-ms`, until both runners are drained, when it prints their reports and exits.
//! Redis and PostgreSQL come from `REDIS_URL` and `DATABASE_URL`.
//!
//! With `ONCELY_CHAOS_FAULTS=PERCENT` set (by `make chaos`), the same tiers run behind a
//! `tower::timeout` in front of the chaos handler of `integration_tests::chaos_stack`: a
//! two-row effect, PERCENT % of calls each panicking, timing out and swallowing a failed
//! statement, and poison messages that SIGKILL this process.
//!
//! With `--store mysql`, the record, the effects and the fault log are in the database
//! SCHEMA on `MYSQL_URL` (MySQL or MariaDB), and the process always runs the chaos stack
//! (without handler faults if `ONCELY_CHAOS_FAULTS` is not set); the flag-only stack runs on
//! PostgreSQL only.

use std::time::Duration;

use clap::Parser;
use integration_tests::amqp::{
    amqp_addr, batched_orders_route, flag_only_orders_route, flag_record_orders_route, orders_route,
    test_topology,
};
use integration_tests::chaos_stack::{
    CHAOS_PREFETCH, ChaosDatabase, ChaosStack, ChaosStore, HandlerFaults, chaos_flag_only_route,
    chaos_flag_record_route, chaos_orders_route,
};
use integration_tests::postgres::{RecordMode, schema_pool};
use integration_tests::{exit_when_orphaned, redis_connection, redis_url};
use lapin::ConnectionProperties;
use oncely::postgres::Table;
use oncely::{BoxError, Envelope, Outcome, Route};
use oncely_amqp::{Runner, SuspectGate};
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;

/// The command line.
#[derive(Parser)]
struct Args {
    /// The work queue.
    queue: String,
    /// The PostgreSQL schema (the MySQL database, with `--store mysql`) of the record and
    /// `stock_moves`.
    schema: String,
    /// The Redis key prefix.
    prefix: String,
    /// The stack: full, flag-only, flag-record or batched.
    #[arg(default_value = "full")]
    stack: ChaosStack,
    /// The name of the AMQP connections.
    #[arg(default_value = "oncely-amqp-consumer")]
    connection_name: String,
    /// Drain mode: stop once the runners have been idle this many milliseconds, and print
    /// their reports.
    #[arg(long)]
    drain_ms: Option<u64>,
    /// Where the record and the effects are.
    #[arg(long, value_enum, default_value_t = ChaosStore::Postgres)]
    store: ChaosStore,
    /// The runners keep the runner's default prefetch and concurrency
    /// (`oncely_amqp::DEFAULT_PREFETCH`), as a user's do. Without it they take
    /// [`CHAOS_PREFETCH`] deliveries at a time, so that a kill leaves few to redeliver and
    /// the tests that kill the process stay short.
    #[arg(long)]
    default_prefetch: bool,
}

/// Runs two runners of `route` on the queue, sharing one suspect gate, until the process is
/// killed, or until drained.
async fn consume<S>(route: Route<S>, args: &Args)
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let shutdown = CancellationToken::new();
    // One process, one gate: a suspect of either runner runs alone in the process.
    let gate = SuspectGate::new();
    let runners: Vec<_> = (0..2)
        .map(|_| {
            let mut runner =
                Runner::new(route.clone(), test_topology(&args.queue)).with_suspect_gate(gate.clone());
            if !args.default_prefetch {
                runner = runner.with_prefetch(CHAOS_PREFETCH);
            }
            if let Some(idle) = args.drain_ms {
                runner = runner.with_drain(Duration::from_millis(idle));
            }
            let (shutdown, name) = (shutdown.clone(), args.connection_name.clone());
            tokio::spawn(async move {
                let connect = || {
                    let properties =
                        ConnectionProperties::default().with_connection_name(name.clone().into());
                    async move { integration_tests::amqp::connect_to(&amqp_addr(), properties).await }
                };
                runner.run_with_reconnect(connect, &shutdown).await
            })
        })
        .collect();
    for runner in runners {
        match runner.await {
            Ok(Ok(report)) => println!("{report}"),
            Ok(Err(error)) => {
                eprintln!("amqp_consumer: {error}");
                std::process::exit(1);
            }
            Err(panicked) => std::panic::resume_unwind(panicked.into_panic()),
        }
    }
}

#[tokio::main]
async fn main() {
    tokio::spawn(exit_when_orphaned());
    let args = Args::parse();
    let (schema, prefix) = (args.schema.as_str(), args.prefix.as_str());
    let redis = redis_connection(&redis_url()).await;
    match (args.store, HandlerFaults::from_env(args.store, schema)) {
        (ChaosStore::Postgres, None) => consume_plain(redis, &args).await,
        (store, faults) => {
            let faults =
                faults.unwrap_or_else(|| HandlerFaults::new(0.0, ChaosDatabase::new(store, schema, 2)));
            let database = ChaosDatabase::new(store, schema, 8);
            match (args.stack, database) {
                (ChaosStack::Full, database) => {
                    let route = chaos_orders_route(database, redis, prefix, faults, RecordMode::PerDelivery);
                    consume(route, &args).await;
                }
                (ChaosStack::Batched, database) => {
                    let route = chaos_orders_route(database, redis, prefix, faults, RecordMode::Batched);
                    consume(route, &args).await;
                }
                (ChaosStack::FlagRecord, database) => {
                    consume(chaos_flag_record_route(database, redis, prefix, faults), &args).await;
                }
                (ChaosStack::FlagOnly, ChaosDatabase::Postgres { pool, .. }) => {
                    consume(chaos_flag_only_route(pool, redis, prefix, faults), &args).await;
                }
                (ChaosStack::FlagOnly, ChaosDatabase::Mysql(_)) => {
                    eprintln!("amqp_consumer: the flag-only stack runs on PostgreSQL only");
                    std::process::exit(2);
                }
            }
        }
    }
}

/// The stack's plain route, without the chaos handler: one `stock_moves` row per order, in
/// PostgreSQL.
async fn consume_plain(redis: ConnectionManager, args: &Args) {
    let (schema, prefix) = (args.schema.as_str(), args.prefix.as_str());
    let pool = schema_pool(schema, 8);
    let records = || Table::new(schema, "consumption_record").expect("a valid schema");
    match args.stack {
        ChaosStack::Full => consume(orders_route(pool, records(), redis, prefix), args).await,
        ChaosStack::Batched => consume(batched_orders_route(pool, records(), redis, prefix), args).await,
        ChaosStack::FlagOnly => consume(flag_only_orders_route(pool, redis, prefix), args).await,
        ChaosStack::FlagRecord => {
            consume(flag_record_orders_route(pool, records(), redis, prefix), args).await;
        }
    }
}
