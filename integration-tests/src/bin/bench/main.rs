//! Run with: `make bench` (or `cargo run --release -p integration-tests --bin bench --
//! [all|redis|postgres|mysql|amqp|rocketmq|http|prefilter]... [--long]`; every benchmark when
//! none is named). `--long` (`make bench LONG=1`) adds, after the benchmarks named, a million
//! messages through the RabbitMQ runner's full stack ([`long_run`]); given alone, with no
//! benchmark named, it runs the long run alone.
//!
//! Measures each tier against the raw limit of its own store on this machine, in the same
//! run, prints a table per benchmark with the ratio, and writes them to `BENCHMARKS.md` with
//! a chart (`benchmarks.svg`). One module per benchmark, each a variant enum of what it
//! measures:
//!
//! - `redis` ([`redis_flag`]): flag claims next to raw `SET NX PX`, on a Redis of the
//!   bench's own;
//! - `postgres` ([`postgres_record`]): three-step record claims, single-row next to
//!   coalesced; the transactional record, one transaction per delivery next to batched with
//!   per-delivery handlers and with a batch handler;
//! - `mysql` ([`mysql_record`]): the same record benchmarks on MariaDB or MySQL: three-step
//!   claims next to the raw `INSERT` they are made of, and the transactional record per
//!   delivery next to batched;
//! - `amqp` ([`amqp_end_to_end`]): end-to-end messages per second through the RabbitMQ
//!   runner with the full stack (the record per delivery, batched, batched with a batch
//!   handler; on PostgreSQL and on MariaDB) next to an at-least-once lapin consumer writing the
//!   same row, at the same prefetch (64 and the runner's default); the runner alone and with
//!   the Redis flag next to a consumer that only acks; duplicates near their original against
//!   far ones; and mq-bridge 1.3's deduplication route on the same workload;
//! - `rocketmq` ([`rocketmq_end_to_end`]): end-to-end messages per second through RocketMQ's
//!   concurrent listener with the full stack, next to an at-least-once listener writing the
//!   same row;
//! - `http` ([`http_endpoint`]): requests per second of an order endpoint behind
//!   oncely-http's layer (flag + transactional record + stored response) next to the same
//!   endpoint without it;
//! - `prefilter` ([`prefilter`]): at 1 %, 10 % and 50 % duplicates, how many envelopes make
//!   a Redis read and reach PostgreSQL with and without a Bloom pre-filter, and messages
//!   per second.
//!
//! Each adds its table and its targets to a [`report::Report`], which renders
//! `BENCHMARKS.md` itself and has [`chart`] draw `benchmarks.svg`.

mod amqp_end_to_end;
mod baseline;
mod chart;
mod cpu;
mod http_endpoint;
mod long_run;
mod machine;
mod measure;
mod mysql_record;
mod postgres_record;
mod prefilter;
mod redis_flag;
mod report;
mod rocketmq_end_to_end;
mod workload;

use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use report::{CHART, Report};

/// Measures each oncely tier against the raw limit of its own store and writes
/// BENCHMARKS.md and its chart.
#[derive(Parser)]
struct Args {
    /// The benchmarks to run, in the order below whatever the order given; all when none.
    #[arg(value_enum)]
    benchmarks: Vec<Benchmark>,
    /// Then a million messages through the RabbitMQ runner's full stack, sampling throughput
    /// and memory every 10 s (benchmarks-long.svg); alone when no benchmark is named.
    #[arg(long)]
    long: bool,
}

/// A benchmark, as the command line names it.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Benchmark {
    /// Every benchmark.
    All,
    /// Redis flag claims against raw SET NX PX.
    Redis,
    /// PostgreSQL record claims, coalesced against single-row.
    Postgres,
    /// MariaDB/MySQL record claims against raw inserts, and the transactional record.
    Mysql,
    /// RabbitMQ end to end, the runner with tiers (the record on PostgreSQL and on MariaDB)
    /// against a raw lapin consumer.
    Amqp,
    /// RocketMQ end to end, the concurrent listener with the full stack against a raw one.
    Rocketmq,
    /// An HTTP endpoint with the Idempotency-Key layer against the same without it.
    Http,
    /// The Bloom pre-filter at 1, 10 and 50 % duplicates.
    Prefilter,
}

impl Benchmark {
    /// The benchmarks in the order they run.
    const EACH: [Benchmark; 7] = [
        Benchmark::Redis,
        Benchmark::Postgres,
        Benchmark::Mysql,
        Benchmark::Amqp,
        Benchmark::Rocketmq,
        Benchmark::Http,
        Benchmark::Prefilter,
    ];

    /// The benchmarks `chosen` asks for, in running order.
    fn chosen(chosen: &[Benchmark]) -> Vec<Benchmark> {
        let all = chosen.is_empty() || chosen.contains(&Benchmark::All);
        (Benchmark::EACH.into_iter())
            .filter(|benchmark| all || chosen.contains(benchmark))
            .collect()
    }

    /// Runs the benchmark, adding its table and targets to `report`.
    async fn run(self, report: &mut Report) {
        match self {
            // Stands for the others; `chosen` replaces it with them.
            Benchmark::All => {}
            Benchmark::Redis => redis_flag::run(report).await,
            Benchmark::Postgres => postgres_record::run(report).await,
            Benchmark::Mysql => mysql_record::run(report).await,
            Benchmark::Amqp => amqp_end_to_end::run(report).await,
            Benchmark::Rocketmq => rocketmq_end_to_end::run(report).await,
            Benchmark::Http => http_endpoint::run(report).await,
            Benchmark::Prefilter => prefilter::run(report).await,
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    if metrics::set_global_recorder(&*prefilter::COUNTS).is_err() {
        eprintln!("another metrics recorder is installed; the pre-filter counts will read 0");
    }
    let mut report = Report::new(machine::machine());
    // `--long` alone is the long run alone: its minutes are what was asked for.
    let chosen = if args.long && args.benchmarks.is_empty() {
        Vec::new()
    } else {
        Benchmark::chosen(&args.benchmarks)
    };
    for benchmark in chosen {
        benchmark.run(&mut report).await;
    }
    if args.long {
        long_run::run(&mut report).await;
    }
    report.print_targets();
    match report.write(&Path::new(env!("CARGO_MANIFEST_DIR")).join("..")) {
        Ok(()) => {
            println!("\nwrote BENCHMARKS.md and {CHART}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("could not write the report: {error}");
            ExitCode::FAILURE
        }
    }
}
