//! Run with: `make bench` (or `cargo run --release -p integration-tests --bin bench -- [TIER...]`).
//!
//! Measures each tier against the raw limit of its own store on this machine, in the same
//! run, prints a table per tier with the ratio and writes them to `BENCHMARKS.md`. Tiers:
//! `redis`, `postgres`, `amqp`, `prefilter`.
//!
//! - `redis`: flag claims next to raw `SET NX PX`, on a `redis-server` the bench starts
//!   itself on a free port and empties before every measurement, so each starts from the
//!   same empty keyspace and the machine's shared Redis is left alone.
//! - `postgres`: three-step record claims, single-row next to coalesced, on `DATABASE_URL`
//!   in a schema of the bench's own, dropped afterwards.
//! - `prefilter`: at 1 %, 10 % and 50 % duplicates, how many envelopes make a Redis claim
//!   and reach PostgreSQL with and without a Bloom pre-filter, and messages per second.
//! - `amqp`: end-to-end messages per second through the RabbitMQ runner with no tiers, with
//!   the Redis flag, and with the flag and the PostgreSQL record (transactional), next to a
//!   raw lapin consumer with the same prefetch that acks each message from its own task.

mod report;

use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use integration_tests::postgres::{ScratchSchema, pool};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{redis_connection, unique};
use oncely::flag::{FlagStore, RedisFlagStore};
use oncely::record::{PgRecordStore, RecordStore};
use oncely::{BusinessKey, Fingerprint, Token};
use report::{CHART, Report, Row, Section, chart, machine, markdown};

/// How long each measurement runs, after a warm-up of a tenth of it.
const RUN: Duration = Duration::from_millis(1500);
/// Each measurement is repeated this many times, alternating with its baseline; the median
/// is reported, which keeps one noisy run on a shared 2-core machine from deciding.
const ROUNDS: usize = 5;
/// Bench keys in Redis expire on their own.
const KEY_TTL: Duration = Duration::from_secs(20);

/// One operation of a measurement, given a number unique across the whole run.
type Op = Arc<dyn Fn(u64) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

fn op<F, Fut>(f: F) -> Op
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Arc::new(move |i| Box::pin(f(i)))
}

/// Numbers handed to operations: unique across measurements, so keys never repeat.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Runs `op` from `in_flight` tasks for `RUN` and returns operations per second.
async fn throughput(in_flight: usize, op: &Op) -> f64 {
    let measured = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let warm_up = RUN / 10;
    let tasks: Vec<_> = (0..in_flight)
        .map(|_| {
            let (op, measured) = (op.clone(), measured.clone());
            tokio::spawn(async move {
                while started.elapsed() < warm_up + RUN {
                    op(NEXT.fetch_add(1, Ordering::Relaxed)).await;
                    if started.elapsed() >= warm_up {
                        measured.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a bench task");
    }
    measured.load(Ordering::Relaxed) as f64 / RUN.as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Measures `baseline` and each of `measured` in alternation, `ROUNDS` times, running
/// `reset` before every measurement; one row per measured operation, with medians.
async fn compare(in_flight: usize, reset: &Op, baseline: &Op, measured: &[(&'static str, Op)]) -> Vec<Row> {
    let mut baselines = Vec::new();
    let mut results = vec![Vec::new(); measured.len()];
    for _ in 0..ROUNDS {
        reset(0).await;
        baselines.push(throughput(in_flight, baseline).await);
        for ((_, op), result) in measured.iter().zip(&mut results) {
            reset(0).await;
            result.push(throughput(in_flight, op).await);
        }
    }
    let baseline = median(baselines);
    measured
        .iter()
        .zip(results)
        .map(|((what, _), result)| Row {
            what,
            in_flight,
            per_second: median(result),
            baseline,
        })
        .collect()
}

async fn bench_redis(report: &mut Report) {
    let server = ScratchRedis::start();
    let connection = redis_connection(&server.url()).await;
    let store = RedisFlagStore::new(connection.clone());
    let flush = op({
        let connection = connection.clone();
        move |_| {
            let mut connection = connection.clone();
            async move {
                let () = redis::cmd("FLUSHALL")
                    .query_async(&mut connection)
                    .await
                    .expect("FLUSHALL");
            }
        }
    });
    let raw_set = op({
        let connection = connection.clone();
        move |i| {
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
    });
    let claim = op({
        let store = store.clone();
        move |i| {
            let (store, key) = (store.clone(), BusinessKey::new(i.to_string()));
            async move {
                store.claim(&key, Token::random(), KEY_TTL).await.expect("claim");
            }
        }
    });
    let claim_and_complete = op(move |i| {
        let (store, key) = (store.clone(), BusinessKey::new(i.to_string()));
        async move {
            let token = Token::random();
            store.claim(&key, token, KEY_TTL).await.expect("claim");
            store
                .complete(&key, token, Fingerprint::of(b"bench"), KEY_TTL)
                .await
                .expect("complete");
        }
    });
    // The first measurement in a fresh process and server runs visibly faster than the rest;
    // one discarded run keeps it from favouring whichever comes first.
    throughput(64, &raw_set).await;
    let measured = [
        ("flag claim (`SET NX GET PX`)", claim),
        ("flag claim + complete (2 round trips)", claim_and_complete),
    ];
    let mut rows = Vec::new();
    for level in IN_FLIGHT {
        rows.extend(compare(level, &flush, &raw_set, &measured).await);
    }
    let claims_at_64 = rows
        .iter()
        .rfind(|row| row.what == measured[0].0)
        .expect("a row at 64");
    report.summary.push(format!(
        "Redis flag claims at 64 in flight: {}",
        against(
            claims_at_64.per_second / claims_at_64.baseline,
            "raw SET NX PX",
            0.80
        )
    ));
    report.add_curves("Redis: ", "raw `SET NX PX`", &rows);
    report.add(Section {
        title: "Redis flag tier".into(),
        baseline_name: "raw `SET NX PX`",
        rows,
        note: redis_benchmark(&server.url()).map(|line| {
            format!(
                "For scale, redis-benchmark on the same server (64 connections, no client library): {line}"
            )
        }),
    });
}

/// The server's own limit for the same command, measured by redis-benchmark when present.
fn redis_benchmark(url: &str) -> Option<String> {
    let port = url.rsplit(':').next()?;
    let output = Command::new("redis-benchmark")
        .args(["-p", port, "-c", "64", "-n", "200000", "-r", "100000000", "-q"])
        .args(["SET", "oncely:rb:__rand_int__", "v", "NX", "PX", "20000"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .rev()
        .find(|line| line.contains("requests per second"))?;
    Some(line.rsplit('\r').next().unwrap_or(line).trim().to_owned())
}

async fn bench_postgres(report: &mut Report) {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    let single = PgRecordStore::new(pool.clone(), schema.records());
    let coalesced = single.clone().with_coalescing(64, 4);
    let claim = |store: PgRecordStore| {
        op(move |i| {
            let (store, key) = (store.clone(), BusinessKey::new(i.to_string()));
            async move {
                store
                    .begin(&key, Fingerprint::of(b"bench"), Duration::from_secs(60), None)
                    .await
                    .expect("claim");
            }
        })
    };
    let nothing = op(|_| async {});
    let measured = [(
        "record claim, coalesced (≤ 64 rows, ≤ 4 batches on the wire)",
        claim(coalesced),
    )];
    let mut rows = Vec::new();
    for level in IN_FLIGHT {
        rows.extend(compare(level, &nothing, &claim(single.clone()), &measured).await);
    }
    let at_64 = rows.last().expect("a row at 64");
    report.summary.push(format!(
        "PostgreSQL coalesced claims at 64 in flight: {}",
        against(at_64.per_second / at_64.baseline, "single-row claims", 10.0)
    ));
    report.add_curves("PostgreSQL: ", "single-row claim", &rows);
    report.add(Section {
        title: "PostgreSQL record tier (three-step claims, pool of 16)".into(),
        baseline_name: "single-row claim",
        rows,
        note: None,
    });
}

/// The in-flight levels the tier benchmarks measure at, for the chart.
const IN_FLIGHT: [usize; 4] = [1, 4, 16, 64];

/// Messages per AMQP measurement, published before the clock starts.
const AMQP_MESSAGES: usize = 10_000;
/// Prefetch, and so messages in flight, of every AMQP consumer measured.
const AMQP_PREFETCH: u16 = 64;

/// Fills a fresh queue of `topology` with `AMQP_MESSAGES` orders never seen before
/// (unconfirmed publishes, then a wait until the broker counts them all).
async fn fill(channel: &lapin::Channel, topology: &oncely_amqp::Topology) {
    topology.declare(channel).await.expect("declare");
    let batch = Token::random();
    for n in 0..AMQP_MESSAGES {
        let body = format!(r#"{{"orderId":"{batch}-{n}"}}"#);
        // Unconfirmed on purpose: filling is not measured, and the wait below counts what
        // the broker stored.
        drop(
            channel
                .basic_publish(
                    "".into(),
                    topology.queue().into(),
                    Default::default(),
                    body.as_bytes(),
                    Default::default(),
                )
                .await
                .expect("publish"),
        );
    }
    while (integration_tests::amqp::ready_messages(channel, topology.queue()).await as usize) < AMQP_MESSAGES
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Consumes a full queue with a plain lapin loop that acks every delivery from its own task.
async fn raw_consumer(channel: &lapin::Channel, queue: &str) -> f64 {
    use futures_lite::StreamExt;
    channel
        .basic_qos(AMQP_PREFETCH, Default::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(queue.into(), "raw".into(), Default::default(), Default::default())
        .await
        .expect("consume");
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut received = 0;
    while received < AMQP_MESSAGES {
        let delivery = consumer.next().await.expect("a delivery").expect("a delivery");
        received += 1;
        let acked = acked.clone();
        tokio::spawn(async move {
            delivery.acker.ack(Default::default()).await.expect("ack");
            acked.fetch_add(1, Ordering::Relaxed);
        });
    }
    while (acked.load(Ordering::Relaxed) as usize) < AMQP_MESSAGES {
        tokio::task::yield_now().await;
    }
    let rate = AMQP_MESSAGES as f64 / started.elapsed().as_secs_f64();
    let _ = channel.basic_cancel("raw".into(), Default::default()).await;
    rate
}

/// Consumes a full queue through a runner of `route`, counting settled deliveries with the
/// handler's own counter.
async fn runner_consumer<S>(
    channel: &lapin::Channel,
    topology: &oncely_amqp::Topology,
    route: oncely::Route<S>,
    handled: Arc<AtomicU64>,
) -> f64
where
    S: tower::Service<oncely::Envelope, Response = oncely::Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    let shutdown = tokio_util::sync::CancellationToken::new();
    let runner = oncely_amqp::Runner::new(route, topology.clone())
        .with_prefetch(AMQP_PREFETCH)
        .with_concurrency(AMQP_PREFETCH.into());
    let started = Instant::now();
    let running = {
        let (channel, shutdown) = (channel.clone(), shutdown.clone());
        tokio::spawn(async move { runner.run(&channel, &shutdown).await })
    };
    while (handled.load(Ordering::Relaxed) as usize) < AMQP_MESSAGES
        || integration_tests::amqp::ready_messages(channel, topology.queue()).await > 0
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = AMQP_MESSAGES as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    running.await.expect("the runner task").expect("the runner");
    rate
}

async fn bench_amqp(report: &mut Report) {
    use oncely::flag::{FlagLayer, RedisFlagStore};
    use oncely::record::PgTransactionalLayer;
    use oncely::{Envelope, HandlerError, KeyExtractor, Route, handler_fn};
    use tower::ServiceBuilder;

    let connection = integration_tests::amqp::connect().await.expect("RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    let redis = ScratchRedis::start();
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    let schema_pool = integration_tests::postgres::schema_pool(schema.name(), 16);
    schema
        .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
        .await;
    let key = || KeyExtractor::json_pointer("/orderId");
    let counting = |handled: Arc<AtomicU64>| {
        handler_fn(move |_: Envelope| {
            handled.fetch_add(1, Ordering::Relaxed);
            async { Ok::<(), HandlerError>(()) }
        })
    };

    let mut results: Vec<(&'static str, Vec<f64>)> = [
        "raw lapin consumer",
        "runner, no tiers",
        "runner, Redis flag",
        "runner, Redis flag + PostgreSQL record",
    ]
    .map(|name| (name, Vec::new()))
    .to_vec();
    for _ in 0..3 {
        for (variant, (_, rates)) in results.iter_mut().enumerate() {
            let topology = integration_tests::amqp::scratch_topology("bench");
            fill(&channel, &topology).await;
            let handled = Arc::new(AtomicU64::new(0));
            let flags =
                RedisFlagStore::new(redis_connection(&redis.url()).await).with_prefix(unique("bench"));
            let flag = FlagLayer::new(flags, Duration::from_secs(600));
            let rate = match variant {
                0 => raw_consumer(&channel, topology.queue()).await,
                1 => {
                    runner_consumer(
                        &channel,
                        &topology,
                        Route::new("bench", key(), counting(handled.clone())),
                        handled,
                    )
                    .await
                }
                2 => {
                    let stack = ServiceBuilder::new()
                        .layer(flag)
                        .service(counting(handled.clone()));
                    runner_consumer(&channel, &topology, Route::new("bench", key(), stack), handled).await
                }
                _ => {
                    let recorded = handled.clone();
                    let handler = handler_fn(move |envelope: Envelope| {
                        let recorded = recorded.clone();
                        async move {
                            integration_tests::postgres::insert_stock_move(&envelope).await?;
                            recorded.fetch_add(1, Ordering::Relaxed);
                            Ok::<(), HandlerError>(())
                        }
                    });
                    let stack = ServiceBuilder::new()
                        .layer(flag)
                        .layer(PgTransactionalLayer::new(schema_pool.clone(), schema.records()))
                        .service(handler);
                    runner_consumer(&channel, &topology, Route::new("bench", key(), stack), handled).await
                }
            };
            rates.push(rate);
            topology.delete(&channel).await.expect("delete the bench queues");
        }
    }
    let raw = median(results[0].1.clone());
    let rows: Vec<Row> = results
        .into_iter()
        .skip(1)
        .map(|(what, rates)| Row {
            what,
            in_flight: usize::from(AMQP_PREFETCH),
            per_second: median(rates),
            baseline: raw,
        })
        .collect();
    report.summary.push(format!(
        "RabbitMQ runner with the Redis flag: {}",
        against(
            rows[1].per_second / rows[1].baseline,
            "a raw lapin consumer",
            0.70
        )
    ));
    report.add(Section {
        title: format!("RabbitMQ end to end ({AMQP_MESSAGES} messages, prefetch {AMQP_PREFETCH})"),
        baseline_name: "raw lapin consumer, messages",
        rows,
        note: None,
    });
}

/// Deliveries per pre-filter measurement.
const PREFILTER_MESSAGES: usize = 20_000;

/// The counts the tiers recorded, for the pre-filter bench (installed as the global
/// recorder by `main`).
static COUNTS: std::sync::LazyLock<integration_tests::recorder::Counts> =
    std::sync::LazyLock::new(Default::default);

/// Runs every body through `route` from 64 concurrent tasks.
async fn deliver_all<S>(route: oncely::Route<S>, bodies: Vec<String>)
where
    S: tower::Service<oncely::Envelope, Response = oncely::Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<oncely::BoxError>,
    S::Future: Send,
{
    let bodies = Arc::new(bodies);
    let next = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..64)
        .map(|_| {
            let (route, bodies, next) = (route.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                while let Some(body) = bodies.get(next.fetch_add(1, Ordering::Relaxed) as usize) {
                    let delivery = oncely::Delivery::new(oncely::Source::new("bench"), body.clone());
                    // A copy that meets its order in flight answers "retry later"; the order
                    // itself is settled by the other delivery, so nothing is redelivered here.
                    let _ = route.handle(delivery).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a bench worker");
    }
}

/// At 1 %, 10 % and 50 % duplicates: how many envelopes make a Redis claim and reach
/// PostgreSQL, with and without a Bloom pre-filter in front of the flag (which then skips its
/// claim for certainly new keys), and the messages per second through the whole stack.
async fn bench_prefilter(report: &mut Report) {
    use oncely::flag::FlagLayer;
    use oncely::prefilter::{BloomPreFilter, PreFilterLayer};
    use oncely::record::PgTransactionalLayer;
    use oncely::{Envelope, KeyExtractor, Route, handler_fn};
    use tower::ServiceBuilder;

    let redis = ScratchRedis::start();
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    let schema_pool = integration_tests::postgres::schema_pool(schema.name(), 16);
    schema
        .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
        .await;
    let handler = handler_fn(|envelope: Envelope| async move {
        integration_tests::postgres::insert_stock_move(&envelope).await
    });

    let mut rows = Vec::new();
    let mut reach = String::from(
        "| duplicates | pre-filter | certainly new | Redis claims | reach PostgreSQL | messages/s |\n|---:|---|---:|---:|---:|---:|\n",
    );
    for duplicate_percent in [1_usize, 10, 50] {
        let mut without = 0.0;
        for with_filter in [false, true] {
            let name = format!("prefilter-{duplicate_percent}-{with_filter}-{}", Token::random());
            let flag = FlagLayer::new(
                RedisFlagStore::new(redis_connection(&redis.url()).await).with_prefix(unique("bench")),
                Duration::from_secs(600),
            )
            .skip_claim_when_certainly_new();
            let records = PgTransactionalLayer::new(schema_pool.clone(), schema.records());
            // Distinct orders first, then the copies, spread over them: a copy finds its
            // order settled, as a redelivery or a producer retry would.
            let distinct = PREFILTER_MESSAGES * (100 - duplicate_percent) / 100;
            let bodies: Vec<String> = (0..PREFILTER_MESSAGES)
                .map(|n| {
                    let order = if n < distinct { n } else { (n * 7919) % distinct };
                    format!(r#"{{"orderId":"{name}-{order}"}}"#)
                })
                .collect();
            let key = KeyExtractor::json_pointer("/orderId");
            let started = Instant::now();
            if with_filter {
                let filter =
                    PreFilterLayer::new(BloomPreFilter::new(PREFILTER_MESSAGES, 0.01).expect("a valid size"));
                let stack = ServiceBuilder::new()
                    .layer(filter)
                    .layer(flag)
                    .layer(records)
                    .service(handler.clone());
                deliver_all(Route::new(name.clone(), key, stack), bodies).await;
            } else {
                let stack = ServiceBuilder::new()
                    .layer(flag)
                    .layer(records)
                    .service(handler.clone());
                deliver_all(Route::new(name.clone(), key, stack), bodies).await;
            }
            let per_second = PREFILTER_MESSAGES as f64 / started.elapsed().as_secs_f64();
            let count =
                |metric: &str, tier: &str| COUNTS.get(&format!("{metric}{{route={name},tier={tier}}}"));
            let certainly_new = COUNTS.get(&format!(
                "oncely_prefilter_verdicts_total{{route={name},verdict=certainly_new}}"
            ));
            let claims = count("oncely_tier_envelopes_total", "flag") - certainly_new;
            let postgres = count("oncely_tier_envelopes_total", "record");
            let _ = writeln!(
                reach,
                "| {duplicate_percent} % | {} | {certainly_new} | {claims} | {postgres} | {per_second:.0} |",
                if with_filter { "Bloom, 1 %" } else { "none" }
            );
            if with_filter {
                rows.push(Row {
                    what: [
                        "1 % duplicates, with pre-filter",
                        "10 % duplicates, with pre-filter",
                        "50 % duplicates, with pre-filter",
                    ][[1, 10, 50]
                        .iter()
                        .position(|p| *p == duplicate_percent)
                        .expect("a rate")],
                    in_flight: 64,
                    per_second,
                    baseline: without,
                });
            } else {
                without = per_second;
            }
        }
    }
    report.add(Section {
        title: format!(
            "Pre-filter: Redis flag + PostgreSQL record (transactional), {PREFILTER_MESSAGES} deliveries, in process"
        ),
        baseline_name: "without pre-filter, messages",
        rows,
        note: Some(format!(
            "Where the envelopes went ({PREFILTER_MESSAGES} each run; a certainly new key skips the Redis claim and is marked done with one write after PostgreSQL settled it):\n\n{reach}"
        )),
    });
}

/// `ratio` next to the target an issue set for it.
fn against(ratio: f64, baseline: &str, target: f64) -> String {
    let verdict = if ratio >= target { "met" } else { "not met" };
    format!("{ratio:.2}× {baseline} (target ≥ {target:.2}×: {verdict})")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let tiers: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |tier: &str| tiers.is_empty() || tiers.iter().any(|t| t == tier || t == "all");
    if metrics::set_global_recorder(&*COUNTS).is_err() {
        eprintln!("another metrics recorder is installed; the pre-filter counts will read 0");
    }
    let machine = machine();
    println!("## oncely benchmarks\n\n{machine}");
    let mut report = Report::default();
    if wanted("redis") {
        bench_redis(&mut report).await;
    }
    if wanted("postgres") {
        bench_postgres(&mut report).await;
    }
    if wanted("amqp") {
        bench_amqp(&mut report).await;
    }
    if wanted("prefilter") {
        bench_prefilter(&mut report).await;
    }
    println!();
    for line in &report.summary {
        println!("{line}");
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let written = std::fs::write(root.join(CHART), chart(&report.series))
        .and_then(|()| std::fs::write(root.join("BENCHMARKS.md"), markdown(&machine, &report)));
    match written {
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
