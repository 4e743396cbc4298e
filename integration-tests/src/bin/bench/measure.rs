//! How the tier benchmarks measure: an operation run from many tasks for a fixed time, in
//! alternation with its baseline, the median of several rounds kept.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::report::Row;

/// How long each measurement runs, after a warm-up of a tenth of it.
const RUN: Duration = Duration::from_millis(1500);
/// Each measurement is repeated this many times, alternating with its baseline; the median
/// is reported, which keeps one noisy run on a shared 2-core machine from deciding.
pub(crate) const ROUNDS: usize = 5;

/// The in-flight levels the tier benchmarks measure at (and the chart's x axis).
pub(crate) const IN_FLIGHT: [usize; 4] = [1, 4, 16, 64];

/// One operation of a measurement, given a number unique across the whole run.
pub(crate) type Op = Arc<dyn Fn(u64) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// An operation that runs `f` on its own clone of `state` (a client or store handle, cheap to
/// clone) each time, so that the tasks running it share nothing but what `state` shares.
pub(crate) fn op<T, F, Fut>(state: T, f: F) -> Op
where
    T: Clone + Send + Sync + 'static,
    F: Fn(T, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Arc::new(move |i| Box::pin(f(state.clone(), i)))
}

/// Numbers handed to operations: unique across measurements, so keys never repeat.
static NEXT: AtomicU64 = AtomicU64::new(0);

/// Runs `op` from `in_flight` tasks for `RUN` and returns operations per second.
pub(crate) async fn throughput(in_flight: usize, op: &Op) -> f64 {
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

/// The middle value (the upper one of an even count).
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Measures `baseline` and each of `measured` in alternation, `ROUNDS` times, running
/// `reset` before every measurement; one row per measured operation, with medians.
pub(crate) async fn compare(
    in_flight: usize,
    reset: &Op,
    baseline: &Op,
    measured: &[(&'static str, Op)],
) -> Vec<Row> {
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
    let lowest_ratio = |result: &[f64]| {
        let ratios = result
            .iter()
            .zip(&baselines)
            .map(|(measured, baseline)| measured / baseline);
        ratios.reduce(f64::min)
    };
    let rows = measured.iter().zip(results).map(|((what, _), result)| Row {
        what: (*what).into(),
        in_flight,
        lowest_ratio: lowest_ratio(&result),
        per_second: median(result),
        baseline: median(baselines.clone()),
    });
    rows.collect()
}

/// [`compare`] at every level of [`IN_FLIGHT`], the rows in that order.
pub(crate) async fn compare_at_each_level(
    reset: &Op,
    baseline: &Op,
    measured: &[(&'static str, Op)],
) -> Vec<Row> {
    let mut rows = Vec::new();
    for level in IN_FLIGHT {
        rows.extend(compare(level, reset, baseline, measured).await);
    }
    rows
}
