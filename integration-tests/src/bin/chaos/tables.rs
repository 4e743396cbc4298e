//! The run's schema and what the run reads back from it: the business table against the
//! ledger, the throughput windows, the handler faults that fired.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::Row;
use deadpool_postgres::tokio_postgres::types::ToSql;
use integration_tests::chaos_stack::{HandlerFault, TABLES};
use integration_tests::postgres::{ScratchSchema, pool};

/// The throughput window, in seconds: longer than the pauses the faults cause by design (Redis
/// down for a second, a consumer process restarting, a claim waiting out its 3-second
/// lease), short enough that a stalled consumer shows.
pub(crate) const WINDOW_SECONDS: i64 = 5;

/// The business table against the publisher's ledger, per order key.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ledger {
    /// First parts written: one per effect applied.
    pub(crate) effects: i64,
    /// Keys with at least one part.
    pub(crate) applied_keys: i64,
    /// Keys with either part written more than once.
    pub(crate) doubled: i64,
    /// Keys with more of one part than of the other: an effect applied in half.
    pub(crate) partial: i64,
}

/// Effects applied per throughput window between the first handler panic and the last
/// message sent; none without a panic, or with less than a window between the two.
#[derive(Clone, Debug, Default)]
pub(crate) struct Throughput {
    pub(crate) windows: Vec<i64>,
    /// Windows left out: they overlap a RocketMQ broker restart's client lockout.
    pub(crate) locked_out: usize,
}

impl Throughput {
    /// The fewest effects applied in one window.
    pub(crate) fn lowest(&self) -> Option<i64> {
        self.windows.iter().copied().min()
    }
}

/// The run's schema with the chaos stack's tables, and a pool of the run's own to it that
/// the faults leave alone. Dropping it drops the schema.
pub(crate) struct Tables {
    schema: ScratchSchema,
    pool: Pool,
}

impl Tables {
    /// A fresh schema with [`TABLES`] in it.
    pub(crate) async fn create() -> Self {
        let pool = pool(2);
        let schema = ScratchSchema::new(&pool).await;
        schema.execute(TABLES).await;
        Tables { schema, pool }
    }

    /// The schema's name.
    pub(crate) fn schema(&self) -> &str {
        self.schema.name()
    }

    /// Terminates the connections whose `application_name` is `name`; false if none was
    /// open.
    pub(crate) async fn terminate_connections(&self, name: &str) -> bool {
        let terminated = async {
            let client = self.pool.get().await.ok()?;
            let row = client
                .query_one(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
                    &[&name],
                )
                .await
                .ok()?;
            Some(row.get::<_, i64>(0))
        };
        terminated.await.unwrap_or(0) > 0
    }

    /// The rows `sql` returns with `params`, `{schema}` in it replaced by the run's schema.
    async fn query(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<Row> {
        let sql = sql.replace("{schema}", self.schema.name());
        let client = self.pool.get().await.expect("PostgreSQL");
        client
            .query(&sql, params)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
    }

    /// The business table, per key, as the ledger counts it.
    pub(crate) async fn ledger(&self) -> Ledger {
        let rows = self
            .query(
                "SELECT count(*), coalesce(sum(first), 0)::bigint,
                        count(*) FILTER (WHERE first > 1 OR second > 1),
                        count(*) FILTER (WHERE first <> second)
                 FROM (SELECT count(*) FILTER (WHERE part = 1) AS first,
                              count(*) FILTER (WHERE part = 2) AS second
                       FROM {schema}.stock_moves GROUP BY order_id) per_key",
                &[],
            )
            .await;
        Ledger {
            applied_keys: rows[0].get(0),
            effects: rows[0].get(1),
            doubled: rows[0].get(2),
            partial: rows[0].get(3),
        }
    }

    /// When the last effect row was written, if any was.
    pub(crate) async fn last_effect_at(&self) -> Option<SystemTime> {
        let rows = self
            .query("SELECT max(created_at) FROM {schema}.stock_moves", &[])
            .await;
        rows[0].get(0)
    }

    /// Effects applied per window, in whole windows counted back from `published` (when the
    /// last message was sent) to the first panic that took effect, every window counted,
    /// also the empty ones, except those that overlap one of `lockouts`, a broker restart's
    /// (no client can reach the broker then). While messages arrive, new keys keep arriving,
    /// so a healthy consumer applies some in every window; after the last one, only the
    /// retries of a few keys are left, some waiting out a lease, and a quiet window there is
    /// no stall.
    pub(crate) async fn throughput(
        &self,
        published: SystemTime,
        lockouts: &[(SystemTime, SystemTime)],
    ) -> Throughput {
        let rows = self
            .query(
                "WITH bounds AS (
                     SELECT (SELECT min(at) FROM {schema}.chaos_faults WHERE kind = $1) AS start,
                            $3::timestamptz AS stop,
                            make_interval(secs => $2) AS width
                 ), windows AS (
                     SELECT stop - (n + 1) * width AS opens, width
                     FROM bounds,
                          generate_series(0, floor(extract(epoch FROM stop - start) / $2)::int - 1) AS n
                     WHERE stop > start
                 )
                 SELECT w.opens, count(m.id) AS applied
                 FROM windows w LEFT JOIN {schema}.stock_moves m
                   ON m.part = 1 AND m.created_at >= w.opens AND m.created_at < w.opens + w.width
                 GROUP BY w.opens ORDER BY w.opens",
                &[&HandlerFault::Panic.code(), &(WINDOW_SECONDS as f64), &published],
            )
            .await;
        let width = Duration::from_secs(WINDOW_SECONDS as u64);
        let locked_out =
            |opens: SystemTime| (lockouts.iter()).any(|(from, to)| opens < *to && opens + width > *from);
        let mut throughput = Throughput::default();
        for row in &rows {
            if locked_out(row.get(0)) {
                throughput.locked_out += 1;
            } else {
                throughput.windows.push(row.get(1));
            }
        }
        throughput
    }

    /// The handler faults that took effect, per kind, as the consumers logged them.
    pub(crate) async fn handler_faults(&self) -> BTreeMap<HandlerFault, i64> {
        let rows = self
            .query(
                "SELECT kind, count(*) FROM {schema}.chaos_faults GROUP BY kind",
                &[],
            )
            .await;
        rows.iter()
            .filter_map(|row| Some((HandlerFault::from_code(row.get(0))?, row.get(1))))
            .collect()
    }
}
