//! Run with: `make bench` (or `cargo run --release -p integration-tests --bin bench -- [TIER...]`).
//!
//! Measures each tier against the raw limit of its own store on this machine, in the same
//! run, and prints a table per tier with the ratio. Tiers: `redis`.
//!
//! The Redis tier runs against a `redis-server` the bench starts itself on a free port,
//! emptied before every measurement, so each one starts from the same empty keyspace and
//! the machine's shared Redis is left alone.

use std::future::Future;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use integration_tests::redis_connection;
use integration_tests::redis_server::ScratchRedis;
use oncely::flag::{FlagStore, RedisFlagStore};
use oncely::{BusinessKey, Fingerprint, Token};

/// How long each measurement runs, after a warm-up of a tenth of it.
const RUN: Duration = Duration::from_millis(1500);
/// Each measurement is repeated this many times, alternating with its baseline; the median
/// is reported, which keeps one noisy run on a shared 2-core machine from deciding.
const ROUNDS: usize = 5;
/// Bench keys expire on their own; nothing to clean up.
const KEY_TTL: Duration = Duration::from_secs(20);

/// Runs `op` from `in_flight` tasks for `RUN` and returns operations per second.
async fn throughput<F, Fut>(in_flight: usize, op: F) -> f64
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let counter = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let warm_up = RUN / 10;
    let tasks: Vec<_> = (0..in_flight)
        .map(|_| {
            let (op, counter, measuring) = (op.clone(), counter.clone(), measuring.clone());
            tokio::spawn(async move {
                while started.elapsed() < warm_up + RUN {
                    op(counter.fetch_add(1, Ordering::Relaxed)).await;
                    if started.elapsed() >= warm_up {
                        measuring.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a bench task");
    }
    measuring.load(Ordering::Relaxed) as f64 / RUN.as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A row of a tier's table.
struct Row {
    what: String,
    in_flight: usize,
    per_second: f64,
    baseline: f64,
}

fn print_table(title: &str, baseline_name: &str, rows: &[Row]) {
    println!("\n### {title}\n");
    println!("| measured | in flight | ops/s | {baseline_name} ops/s | ratio |");
    println!("|---|---:|---:|---:|---:|");
    for row in rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2}× |",
            row.what,
            row.in_flight,
            row.per_second,
            row.baseline,
            row.per_second / row.baseline
        );
    }
}

async fn bench_redis() -> Vec<Row> {
    let server = ScratchRedis::start();
    let url = server.url();
    let connection = redis_connection(&url).await;
    let store = RedisFlagStore::new(connection.clone());
    let flush = || {
        let mut connection = connection.clone();
        async move {
            let () = redis::cmd("FLUSHALL")
                .query_async(&mut connection)
                .await
                .expect("FLUSHALL");
        }
    };
    let raw_set = {
        let connection = connection.clone();
        move |i: u64| {
            let (mut connection, key) = (connection.clone(), format!("oncely:raw:{{{i}}}"));
            async move {
                let _: Option<String> = redis::cmd("SET")
                    .arg(key)
                    .arg("i:00000000000000000000000000000000")
                    .arg("NX")
                    .arg("PX")
                    .arg(KEY_TTL.as_millis() as u64)
                    .query_async(&mut connection)
                    .await
                    .expect("raw SET");
            }
        }
    };
    // The first measurement in a fresh process and server runs visibly faster than the rest;
    // one discarded run keeps it from favouring whichever comes first.
    throughput(64, raw_set.clone()).await;
    let mut rows = Vec::new();
    for in_flight in [1, 64] {
        let (mut raw, mut claims, mut settled) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            flush().await;
            raw.push(throughput(in_flight, raw_set.clone()).await);
            flush().await;
            let store = store.clone();
            claims.push(
                throughput(in_flight, {
                    let store = store.clone();
                    move |i| {
                        let (store, key) = (store.clone(), BusinessKey::new(i.to_string()));
                        async move {
                            store.claim(&key, Token::random(), KEY_TTL).await.expect("claim");
                        }
                    }
                })
                .await,
            );
            flush().await;
            settled.push(
                throughput(in_flight, move |i| {
                    let (store, key) = (store.clone(), BusinessKey::new(i.to_string()));
                    async move {
                        let token = Token::random();
                        store.claim(&key, token, KEY_TTL).await.expect("claim");
                        store
                            .complete(&key, token, Fingerprint::of(b"bench"), KEY_TTL)
                            .await
                            .expect("complete");
                    }
                })
                .await,
            );
        }
        let baseline = median(raw);
        rows.push(Row {
            what: "flag claim (`SET NX GET PX`)".into(),
            in_flight,
            per_second: median(claims),
            baseline,
        });
        rows.push(Row {
            what: "flag claim + complete (2 round trips)".into(),
            in_flight,
            per_second: median(settled),
            baseline,
        });
    }
    print_table("Redis flag tier", "raw `SET NX PX`", &rows);
    if let Some(line) = redis_benchmark(&url) {
        println!(
            "\nFor scale, redis-benchmark on the same server (64 connections, no client library): {line}"
        );
    }
    rows
}

/// The server's own limit for the same command, measured by redis-benchmark when present.
fn redis_benchmark(url: &str) -> Option<String> {
    let address = url.trim_start_matches("redis://");
    let (host, port) = address.split_once(':').unwrap_or((address, "6379"));
    let port = port.trim_end_matches(|c: char| !c.is_ascii_digit());
    let output = Command::new("redis-benchmark")
        .args([
            "-h",
            host,
            "-p",
            port,
            "-c",
            "64",
            "-n",
            "200000",
            "-r",
            "100000000",
            "-q",
        ])
        .args(["SET", "oncely:rb:__rand_int__", "v", "NX", "PX", "20000"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .rev()
        .find(|line| line.contains("requests per second"))
        .map(|line| line.rsplit('\r').next().unwrap_or(line).trim().to_owned())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let tiers: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |tier: &str| tiers.is_empty() || tiers.iter().any(|t| t == tier || t == "all");
    println!(
        "## oncely benchmarks ({} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if wanted("redis") {
        let rows = bench_redis().await;
        let at_64 = rows
            .iter()
            .find(|row| row.in_flight == 64)
            .expect("a 64-in-flight row");
        let ratio = at_64.per_second / at_64.baseline;
        println!("\nRedis flag claims at 64 in flight: {ratio:.2}× raw SET NX PX (target ≥ 0.80×)");
    }
    ExitCode::SUCCESS
}
