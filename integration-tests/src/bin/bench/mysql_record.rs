//! `mysql`: the record tier on MariaDB (or MySQL, on `MYSQL_URL`), in a database of the
//! bench's own: three-step claims next to the raw `INSERT` they are made of; and the
//! transactional record with an effect row written in its XA transaction, one transaction
//! per delivery next to batched, with per-delivery handlers and with a set handler.

use std::time::Duration;

use integration_tests::mysql::{StockDatabase, stock_move, stock_moves};
use integration_tests::postgres::boxed;
use oncely::mysql::sqlx::{self, MySqlPool};
use oncely::record::{MysqlRecordStore, MysqlTransactionalLayer, RecordStore};
use oncely::{BusinessKey, Delivery, Fingerprint, KeyExtractor, Outcome, Route, Source};

use crate::measure::{Op, compare_at_each_level, op};
use crate::report::{Plot, Report, Row, Section, Target, batched_defaults};

/// Both MySQL record benchmarks.
pub(crate) async fn run(report: &mut Report) {
    claims(report).await;
    transactions(report).await;
}

/// Measures three-step claims against the raw `INSERT` of a key at each in-flight level, on
/// a pool of 16.
async fn claims(report: &mut Report) {
    let database = StockDatabase::new().await;
    let pool = database.pool(16).await;
    sqlx::raw_sql("CREATE TABLE raw_keys (message_key VARBINARY(1024) NOT NULL PRIMARY KEY) ENGINE = InnoDB")
        .execute(&pool)
        .await
        .expect("the raw table");
    let raw = op(pool.clone(), |pool, i| async move {
        sqlx::query("INSERT INTO raw_keys (message_key) VALUES (?)")
            .bind(i.to_string())
            .execute(&pool)
            .await
            .expect("insert");
    });
    let store = MysqlRecordStore::new(pool, StockDatabase::records());
    let single = "record claim (INSERT … PROCESSING)";
    let coalesced = "record claim, coalesced (≤ 64 rows, ≤ 4 batches on the wire)";
    let measured = [
        (single, claim_op(store.clone(), "single")),
        (coalesced, claim_op(store.with_coalescing(64, 4), "coalesced")),
    ];
    let nothing = op((), |(), _| async {});
    let rows = compare_at_each_level(&nothing, &raw, &measured).await;
    report.add_target(Target {
        what: "MariaDB record claims at 64 in flight".into(),
        ratio: Row::last_ratio(&rows, single),
        baseline: "raw INSERT of a key".into(),
        at_least: 0.8,
    });
    report.add_target(Target {
        what: "MariaDB coalesced record claims at 64 in flight".into(),
        ratio: Row::last_ratio(&rows, coalesced),
        baseline: "raw INSERT of a key".into(),
        at_least: 2.0,
    });
    report.add(Section {
        title: "MariaDB record tier (three-step claims, pool of 16)".into(),
        baseline_name: "raw INSERT of a key, autocommit",
        unit: None,
        rows,
        note: None,
        plot: Plot::Curves("MariaDB: "),
    });
}

/// A claim of a new key (`prefix` and a number: each measured store its own keys) through
/// `store`.
fn claim_op(store: MysqlRecordStore, prefix: &'static str) -> Op {
    op(store, move |store, i| async move {
        let lease = Duration::from_secs(60);
        let key = BusinessKey::new(format!("{prefix}-{i}"));
        store
            .begin(&key, Fingerprint::of(b"bench"), lease, None)
            .await
            .expect("claim");
    })
}

/// How the transactional record commits the deliveries it is given.
#[derive(Clone, Copy)]
enum Commits {
    /// The baseline: one XA transaction per delivery.
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
    fn op(self, pool: &MySqlPool) -> Op {
        let per_delivery = MysqlTransactionalLayer::new(pool.clone(), StockDatabase::records());
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
    let database = StockDatabase::new().await;
    let pool = database.pool(16).await;
    let nothing = op((), |(), _| async {});
    let measured =
        [Commits::Batched, Commits::BatchHandler].map(|commits| (commits.name(), commits.op(&pool)));
    let rows = compare_at_each_level(&nothing, &Commits::PerDelivery.op(&pool), &measured).await;
    report.add_target(Target {
        what: "MariaDB batched record at 64 in flight".into(),
        ratio: Row::last_ratio(&rows, Commits::Batched.name()),
        baseline: "one transaction per delivery".into(),
        at_least: 3.0,
    });
    report.add(Section {
        title: "MariaDB transactional record (a stock-move row written in the XA transaction, pool of 16)"
            .into(),
        baseline_name: Commits::PerDelivery.name(),
        unit: None,
        rows,
        note: Some(batched_defaults()),
        plot: Plot::Curves("MariaDB: "),
    });
}
