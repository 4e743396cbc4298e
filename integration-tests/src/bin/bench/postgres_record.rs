//! `postgres`: three-step record claims, single-row next to coalesced; and the transactional
//! record with an effect row written in its transaction, one transaction per delivery next to
//! batched, with per-delivery handlers and with a set handler. On `DATABASE_URL`, in schemas of
//! the bench's own, dropped afterwards.

use std::time::Duration;

use deadpool_postgres::Pool;
use integration_tests::postgres::{ScratchSchema, boxed, pool, schema_pool, stock_move, stock_moves};
use oncely::postgres::Table;
use oncely::record::{PgRecordStore, PgTransactionalLayer, RecordStore};
use oncely::{BusinessKey, Delivery, Fingerprint, KeyExtractor, Outcome, Route, Source};

use crate::measure::{Op, compare_at_each_level, op};
use crate::report::{Plot, Report, Row, Section, Target, batched_defaults};

/// How the record store sends its claims.
#[derive(Clone, Copy)]
enum Claims {
    /// The baseline: each claim its own statement.
    SingleRow,
    /// Concurrent claims coalesced into batches.
    Coalesced,
}

impl Claims {
    fn name(self) -> &'static str {
        match self {
            Claims::SingleRow => "single-row claim",
            Claims::Coalesced => "record claim, coalesced (≤ 64 rows, ≤ 4 batches on the wire)",
        }
    }

    /// A claim of a new key through `store`, configured for this way of sending.
    fn op(self, store: &PgRecordStore) -> Op {
        let store = match self {
            Claims::SingleRow => store.clone(),
            Claims::Coalesced => store.clone().with_coalescing(64, 4),
        };
        op(store, |store, i| async move {
            store
                .begin(
                    &BusinessKey::new(i.to_string()),
                    Fingerprint::of(b"bench"),
                    Duration::from_secs(60),
                    None,
                )
                .await
                .expect("claim");
        })
    }
}

/// Both PostgreSQL record benchmarks.
pub(crate) async fn run(report: &mut Report) {
    claims(report).await;
    transactions(report).await;
}

/// Measures coalesced claims against single-row claims at each in-flight level, on a pool
/// of 16, and adds the table and the coalescing's target to `report`.
async fn claims(report: &mut Report) {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    let store = PgRecordStore::new(pool.clone(), schema.records());
    // Keys never repeat, so nothing needs resetting between measurements.
    let nothing = op((), |(), _| async {});
    let measured = [(Claims::Coalesced.name(), Claims::Coalesced.op(&store))];
    let rows = compare_at_each_level(&nothing, &Claims::SingleRow.op(&store), &measured).await;
    report.add_target(Target {
        what: "PostgreSQL coalesced claims at 64 in flight".into(),
        ratio: Row::last_ratio(&rows, Claims::Coalesced.name()),
        baseline: "single-row claims".into(),
        at_least: 10.0,
    });
    report.add(Section {
        title: "PostgreSQL record tier (three-step claims, pool of 16)".into(),
        baseline_name: Claims::SingleRow.name(),
        unit: None,
        rows,
        note: None,
        plot: Plot::Curves("PostgreSQL: "),
    });
}

/// How the transactional record commits the deliveries it is given.
#[derive(Clone, Copy)]
enum Commits {
    /// The baseline: one transaction per delivery.
    PerDelivery,
    /// Batched, each delivery's handler writing its row.
    Batched,
    /// Batched, one set handler writing the rows of the whole batch.
    BatchHandler,
}

impl Commits {
    fn name(self) -> &'static str {
        match self {
            Commits::PerDelivery => "transactional record, one transaction per delivery",
            Commits::Batched => "batched record, per-delivery handler",
            Commits::BatchHandler => "batched record, batch handler",
        }
    }

    /// A delivery of a new order through the record in this mode to a handler writing its
    /// stock move in the record's transaction, answered processed.
    fn op(self, pool: &Pool, records: Table) -> Op {
        let per_delivery = PgTransactionalLayer::new(pool.clone(), records);
        let route = match self {
            Commits::PerDelivery => boxed(per_delivery.handler(stock_move)),
            Commits::Batched => boxed(per_delivery.batched().handler(stock_move)),
            Commits::BatchHandler => boxed(per_delivery.batched().batch_handler(stock_moves)),
        };
        let route = Route::new("bench", KeyExtractor::json_pointer("/orderId"), route);
        op(route, |route, i| async move {
            let body = format!(r#"{{"orderId":"{i}"}}"#);
            let outcome = route.handle(Delivery::new(Source::new("bench"), body)).await;
            assert_eq!(outcome, Outcome::Processed);
        })
    }
}

/// Measures the batched record, with either handler, against one transaction per delivery
/// at each in-flight level, on a pool of 16, and adds the table and the batching's targets.
async fn transactions(report: &mut Report) {
    let schema = ScratchSchema::new(&pool(2)).await;
    schema
        .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
        .await;
    let pool = schema_pool(schema.name(), 16);
    let nothing = op((), |(), _| async {});
    let measured = [Commits::Batched, Commits::BatchHandler]
        .map(|commits| (commits.name(), commits.op(&pool, schema.records())));
    let baseline = Commits::PerDelivery.op(&pool, schema.records());
    let rows = compare_at_each_level(&nothing, &baseline, &measured).await;
    report.add_target(Target {
        what: "PostgreSQL batched record at 64 in flight".into(),
        ratio: Row::last_ratio(&rows, Commits::Batched.name()),
        baseline: "one transaction per delivery".into(),
        at_least: 5.0,
    });
    report.add_target(Target {
        what: "PostgreSQL batched record, a lone delivery (1 in flight; latency ≤ 1.1×)".into(),
        ratio: Row::ratio_at(&rows, Commits::Batched.name(), 1),
        baseline: "one transaction per delivery".into(),
        at_least: 1.0 / 1.1,
    });
    report.add(Section {
        title: "PostgreSQL transactional record (a stock-move row written in the transaction, pool of 16)"
            .into(),
        baseline_name: Commits::PerDelivery.name(),
        unit: None,
        rows,
        note: Some(format!(
            "{}{}",
            batched_defaults(),
            pgbench_ceiling(&schema)
                .await
                .map(|tps| format!(
                    " For scale, pgbench on the same server (16 clients, each transaction one \
                     `INSERT … ON CONFLICT DO NOTHING` of a new key): {tps:.0} transactions per second."
                ))
                .unwrap_or_default()
        )),
        plot: Plot::Curves("PostgreSQL: "),
    });
}

/// The server's own limit for one-insert transactions, measured by pgbench when present: 16
/// clients for 5 s, each transaction an `INSERT … ON CONFLICT DO NOTHING` of a random key
/// into a table of `schema`'s. `None` without pgbench or when it fails.
async fn pgbench_ceiling(schema: &ScratchSchema) -> Option<f64> {
    schema
        .execute("CREATE TABLE pgbench_keys (key TEXT PRIMARY KEY)")
        .await;
    let script = std::env::temp_dir().join(format!("oncely-pgbench-{}.sql", schema.name()));
    let insert = format!(
        "INSERT INTO {}.pgbench_keys VALUES (md5(random()::text)) ON CONFLICT DO NOTHING;\n",
        schema.name()
    );
    std::fs::write(&script, insert).ok()?;
    let output = std::process::Command::new("pgbench")
        .args(["-n", "-c", "16", "-j", "2", "-T", "5", "-f"])
        .arg(&script)
        .arg(integration_tests::postgres::database_url())
        .output();
    let _ = std::fs::remove_file(&script);
    let text = String::from_utf8(output.ok()?.stdout).ok()?;
    // "tps = 3925.123456 (without initial connection time)"
    text.lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|tps| tps.parse().ok())
}
