//! `prefilter`: at 1 %, 10 % and 50 % duplicates, how many envelopes make a Redis read and
//! reach PostgreSQL with and without a Bloom pre-filter in front of the flag (which then
//! skips its read for certainly new keys), and the messages per second through the whole
//! stack, in process.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use integration_tests::postgres::{ScratchSchema, insert_stock_move, pool, schema_pool};
use integration_tests::recorder::Counts;
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{redis_connection, unique};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::prefilter::{BloomPreFilter, PreFilterLayer};
use oncely::record::PgTransactionalLayer;
use oncely::{BoxError, Delivery, Envelope, KeyExtractor, Outcome, Route, Source, Token, handler_fn};
use tower::ServiceBuilder;

use crate::report::{Plot, Report, Row, Section};

/// Deliveries per measurement.
const MESSAGES: usize = 20_000;
/// Deliveries in flight, each from a task of its own.
const IN_FLIGHT: usize = 64;
/// The shares of duplicates measured, in percent.
const DUPLICATE_PERCENTS: [usize; 3] = [1, 10, 50];

/// The counts the tiers recorded, read per route; `main` installs it as the global recorder.
pub(crate) static COUNTS: LazyLock<Counts> = LazyLock::new(Default::default);

/// What stands in front of the flag.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Filter {
    /// Nothing: the baseline.
    None,
    /// A Bloom pre-filter sized for the run's keys at a 1 % false-positive rate.
    Bloom,
}

impl Filter {
    /// The baseline first: each share of duplicates is measured in this order.
    const ALL: [Filter; 2] = [Filter::None, Filter::Bloom];

    /// As the "where the envelopes went" table names it.
    fn name(self) -> &'static str {
        match self {
            Filter::None => "none",
            Filter::Bloom => "Bloom, 1 %",
        }
    }
}

/// Where one measurement's envelopes went.
struct Measured {
    per_second: f64,
    /// Envelopes the pre-filter answered "certainly new" (they skipped the Redis read).
    certainly_new: u64,
    /// Envelopes that made a Redis read (the flag's look).
    reads: u64,
    /// Envelopes that reached the PostgreSQL record.
    postgres: u64,
}

/// What the measurements share: a Redis of the bench's own and a schema of its own with the
/// handler's table.
struct Services {
    redis: ScratchRedis,
    schema: ScratchSchema,
    /// Connections that search the schema first.
    schema_pool: Pool,
}

/// Measures each share of duplicates without, then with, the pre-filter; adds the table and
/// where the envelopes went to `report`.
pub(crate) async fn run(report: &mut Report) {
    let schema = ScratchSchema::new(&pool(16)).await;
    let services = Services {
        redis: ScratchRedis::start(),
        schema_pool: schema_pool(schema.name(), 16),
        schema,
    };
    services
        .schema
        .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
        .await;
    let mut rows = Vec::new();
    let mut reach = String::from(
        "| duplicates | pre-filter | certainly new | Redis reads | reach PostgreSQL | messages/s |\n|---:|---|---:|---:|---:|---:|\n",
    );
    for percent in DUPLICATE_PERCENTS {
        let mut without = 0.0;
        for filter in Filter::ALL {
            let measured = measure(&services, percent, filter).await;
            let _ = writeln!(
                reach,
                "| {percent} % | {} | {} | {} | {} | {:.0} |",
                filter.name(),
                measured.certainly_new,
                measured.reads,
                measured.postgres,
                measured.per_second
            );
            match filter {
                Filter::None => without = measured.per_second,
                Filter::Bloom => rows.push(Row {
                    what: format!("{percent} % duplicates, with pre-filter"),
                    in_flight: IN_FLIGHT,
                    per_second: measured.per_second,
                    baseline: without,
                    lowest_ratio: None,
                }),
            }
        }
    }
    report.add(Section {
        title: format!(
            "Pre-filter: Redis flag + PostgreSQL record (transactional), {MESSAGES} deliveries, in process"
        ),
        baseline_name: "without pre-filter",
        unit: Some("messages"),
        rows,
        note: Some(format!(
            "Where the envelopes went ({MESSAGES} each run; a certainly new key skips the Redis read and is marked done with one write after PostgreSQL settled it):\n\n{reach}"
        )),
        plot: Plot::None,
    });
}

/// [`MESSAGES`] deliveries, `percent` % of them copies, through the Redis flag (skipping its
/// read for certainly new keys) and the PostgreSQL record, behind `filter`, on a route of
/// their own whose counts tell where the envelopes went.
async fn measure(services: &Services, percent: usize, filter: Filter) -> Measured {
    let name = format!(
        "prefilter-{percent}-{}-{}",
        filter == Filter::Bloom,
        Token::random()
    );
    let flag = FlagLayer::new(
        RedisFlagStore::new(redis_connection(&services.redis.url()).await).with_prefix(unique("bench")),
        Duration::from_secs(600),
    )
    .with_record_behind();
    let records = PgTransactionalLayer::new(services.schema_pool.clone(), services.schema.records());
    let handler = handler_fn(|envelope: Envelope| async move { insert_stock_move(&envelope).await });
    let bodies = bodies(&name, percent);
    let key = KeyExtractor::json_pointer("/orderId");
    let started = Instant::now();
    match filter {
        Filter::None => {
            let stack = ServiceBuilder::new().layer(flag).layer(records).service(handler);
            deliver_all(Route::new(name.clone(), key, stack), bodies).await;
        }
        Filter::Bloom => {
            let filter = PreFilterLayer::new(BloomPreFilter::new(MESSAGES, 0.01).expect("a valid size"));
            let stack = ServiceBuilder::new()
                .layer(filter)
                .layer(flag)
                .layer(records)
                .service(handler);
            deliver_all(Route::new(name.clone(), key, stack), bodies).await;
        }
    }
    let per_second = MESSAGES as f64 / started.elapsed().as_secs_f64();
    let envelopes = |tier: &str| {
        COUNTS.get(&format!(
            "oncely_tier_envelopes_total{{route={name},tier={tier}}}"
        ))
    };
    let certainly_new = COUNTS.get(&format!(
        "oncely_prefilter_verdicts_total{{route={name},verdict=certainly_new}}"
    ));
    Measured {
        per_second,
        certainly_new,
        reads: envelopes("flag") - certainly_new,
        postgres: envelopes("record"),
    }
}

/// The bodies of one measurement: distinct orders first, then the copies, spread over them,
/// so that a copy finds its order settled, as a redelivery or a producer retry would.
fn bodies(name: &str, percent: usize) -> Vec<String> {
    let distinct = MESSAGES * (100 - percent) / 100;
    (0..MESSAGES)
        .map(|n| {
            let order = if n < distinct { n } else { (n * 7919) % distinct };
            format!(r#"{{"orderId":"{name}-{order}"}}"#)
        })
        .collect()
}

/// Runs every body through `route` from [`IN_FLIGHT`] concurrent tasks.
async fn deliver_all<S>(route: Route<S>, bodies: Vec<String>)
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let bodies = Arc::new(bodies);
    let next = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (route, bodies, next) = (route.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                while let Some(body) = bodies.get(next.fetch_add(1, Ordering::Relaxed) as usize) {
                    let delivery = Delivery::new(Source::new("bench"), body.clone());
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
