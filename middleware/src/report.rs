//! What a consumer run did, for the runners' reports and drain mode.
//!
//! A runner (`oncely_amqp::Runner`, the `oncely_rocketmq` listeners) counts every delivery
//! it settles in a [`Tally`], and returns or shows a [`RunReport`] of it: processed,
//! duplicates per tier, stale, retries per reason, dead letters per reason, wall time. The
//! tally also tracks what is in flight and when the last delivery arrived, which is what
//! drain mode ([`Tally::wait_until_drained`]) waits on together with the broker's queues.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::outcome::{Outcome, RetryReason};

/// The counts of one run, by what the stack answered and the runner did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// Deliveries processed: the handler ran and its effect is done.
    pub processed: u64,
    /// Duplicates acknowledged without running the handler, by the tier that caught them
    /// (`flag`, `record`, …).
    pub duplicates: BTreeMap<&'static str, u64>,
    /// Events acknowledged as stale by the state guard.
    pub stale: u64,
    /// Deliveries sent back for a later try, by reason code (`handler_failed`, `in_flight`,
    /// …; with the tier for `in_flight`, `conflict` and `store_unavailable`, as
    /// `in_flight:flag`). The AMQP runner also counts `returned_unsettled`: a delivery that
    /// came back after its consumer died, moved to the suspect queue.
    pub retries: BTreeMap<String, u64>,
    /// Deliveries dead-lettered, by reason code (`bad_body`, `rejected`, …).
    pub dead_letters: BTreeMap<&'static str, u64>,
    /// Deliveries the runner answered but could not settle with the broker (an ack that
    /// failed, a retry or dead-letter copy the broker did not take): they come again.
    pub unsettled: u64,
    /// Deliveries still running when a shutdown's grace ran out, left unacknowledged: they
    /// come again.
    pub abandoned: u64,
    /// From the start of the run to the report.
    pub wall_time: Duration,
    /// True when the run ended because it was drained (drain mode), false when it was shut
    /// down or is still running.
    pub drained: bool,
}

impl RunReport {
    /// Every delivery settled: processed, duplicates, stale, retries and dead letters.
    pub fn settled(&self) -> u64 {
        let sum = |counts: &mut dyn Iterator<Item = &u64>| counts.sum::<u64>();
        self.processed
            + sum(&mut self.duplicates.values())
            + self.stale
            + sum(&mut self.retries.values())
            + sum(&mut self.dead_letters.values())
    }

    fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Processed => self.processed += 1,
            Outcome::Duplicate { tier } => *self.duplicates.entry(tier.as_str()).or_default() += 1,
            Outcome::Stale { .. } => self.stale += 1,
            Outcome::RetryLater(retry) => *self.retries.entry(retry_label(retry.reason)).or_default() += 1,
            Outcome::DeadLetter(dead) => *self.dead_letters.entry(dead.reason.code()).or_default() += 1,
        }
    }
}

/// A retry reason's code, with the tier where the reason names one.
fn retry_label(reason: RetryReason) -> String {
    match reason {
        RetryReason::InFlight(tier) | RetryReason::Conflict(tier) | RetryReason::StoreUnavailable(tier) => {
            format!("{}:{tier}", reason.code())
        }
        RetryReason::LockBusy
        | RetryReason::LeaseLost
        | RetryReason::HandlerFailed
        | RetryReason::HandlerPanicked
        | RetryReason::NotRun => reason.code().to_owned(),
    }
}

impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ended = if self.drained { "drained" } else { "ran" };
        writeln!(f, "{ended} in {:.1} s", self.wall_time.as_secs_f64())?;
        writeln!(f, "  processed     {}", self.processed)?;
        line(f, "duplicates", self.duplicates.iter().map(|(k, v)| (*k, *v)))?;
        writeln!(f, "  stale         {}", self.stale)?;
        line(f, "retries", self.retries.iter().map(|(k, v)| (k.as_str(), *v)))?;
        line(f, "dead letters", self.dead_letters.iter().map(|(k, v)| (*k, *v)))?;
        writeln!(f, "  unsettled     {}", self.unsettled)?;
        write!(f, "  abandoned     {}", self.abandoned)
    }
}

/// `  name  total (a 1, b 2)`.
fn line<'a>(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    counts: impl Iterator<Item = (&'a str, u64)> + Clone,
) -> fmt::Result {
    let total: u64 = counts.clone().map(|(_, count)| count).sum();
    let parts: Vec<String> = counts.map(|(what, count)| format!("{what} {count}")).collect();
    if parts.is_empty() {
        writeln!(f, "  {name:<13} {total}")
    } else {
        writeln!(f, "  {name:<13} {total} ({})", parts.join(", "))
    }
}

/// A run's counts and activity, shared by a runner's tasks (cheap to clone: one `Arc`).
#[derive(Clone, Debug)]
pub struct Tally(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    report: Mutex<RunReport>,
    started: Instant,
    in_flight: AtomicUsize,
    /// When a delivery last arrived or finished.
    last_activity: Mutex<Instant>,
    drained: AtomicBool,
}

impl Default for Tally {
    fn default() -> Self {
        Tally::new()
    }
}

impl Tally {
    /// An empty tally; the run's wall time starts now.
    pub fn new() -> Self {
        let now = Instant::now();
        Tally(Arc::new(Shared {
            report: Mutex::new(RunReport::default()),
            started: now,
            in_flight: AtomicUsize::new(0),
            last_activity: Mutex::new(now),
            drained: AtomicBool::new(false),
        }))
    }

    /// A delivery arrived: it counts as in flight until the returned guard is dropped.
    pub fn arrived(&self) -> InFlight {
        self.0.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        InFlight(self.clone())
    }

    /// Counts a settled delivery by the stack's outcome.
    pub fn settled(&self, outcome: &Outcome) {
        self.lock().count(outcome);
    }

    /// Counts a retry the runner decided without the stack, by `label`.
    pub fn retried(&self, label: &str) {
        *self.lock().retries.entry(label.to_owned()).or_default() += 1;
    }

    /// Counts a delivery handed back to the broker unsettled.
    pub fn unsettled(&self) {
        self.lock().unsettled += 1;
    }

    /// Counts `deliveries` left running at shutdown, unacknowledged.
    pub fn abandoned(&self, deliveries: usize) {
        self.lock().abandoned += deliveries as u64;
    }

    /// How long nothing has been in flight and nothing arrived; `None` while a delivery is
    /// in flight.
    pub fn idle_for(&self) -> Option<Duration> {
        if self.0.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let last = *self
            .0
            .last_activity
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // A delivery that arrived between the two reads is in flight now.
        (self.0.in_flight.load(Ordering::SeqCst) == 0).then(|| last.elapsed())
    }

    /// Waits until the run is drained: nothing in flight, nothing arrived for `idle`, and
    /// `broker_empty` (the adapter's look at the broker: work queue, retry queues) answered
    /// true at two checks in a row, the second after that idle time. Then marks the tally
    /// drained and returns. `broker_empty` is polled about four times per `idle` (at most
    /// once a second, at least every 50 ms) once the runner is idle.
    pub async fn wait_until_drained<F, Fut>(&self, idle: Duration, mut broker_empty: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let period = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut empty_checks = 0;
        loop {
            tokio::time::sleep(period).await;
            let idle_now = self.idle_for().is_some_and(|quiet| quiet >= idle);
            empty_checks = if idle_now && broker_empty().await {
                empty_checks + 1
            } else {
                0
            };
            // The second check also proves nothing arrived while the first one ran.
            if empty_checks >= 2 && self.idle_for().is_some_and(|quiet| quiet >= idle) {
                self.0.drained.store(true, Ordering::SeqCst);
                return;
            }
        }
    }

    /// True once [`wait_until_drained`](Tally::wait_until_drained) returned.
    pub fn is_drained(&self) -> bool {
        self.0.drained.load(Ordering::SeqCst)
    }

    /// The counts so far, with the wall time up to now.
    pub fn report(&self) -> RunReport {
        let mut report = self.lock().clone();
        report.wall_time = self.0.started.elapsed();
        report.drained = self.is_drained();
        report
    }

    fn touch(&self) {
        *self
            .0
            .last_activity
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Instant::now();
    }

    fn lock(&self) -> MutexGuard<'_, RunReport> {
        // Counting never panics while holding the lock; a poisoned lock still has good counts.
        self.0
            .report
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One delivery in flight in a [`Tally`]; dropping it ends it (settled, abandoned or
/// cancelled).
#[derive(Debug)]
pub struct InFlight(Tally);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeadLetterReason, Tier};

    #[test]
    fn outcomes_are_counted_by_tier_and_reason() {
        let tally = Tally::new();
        tally.settled(&Outcome::Processed);
        tally.settled(&Outcome::Duplicate { tier: Tier::Flag });
        tally.settled(&Outcome::Duplicate { tier: Tier::Flag });
        tally.settled(&Outcome::Duplicate { tier: Tier::Record });
        tally.settled(&Outcome::retry_later(RetryReason::InFlight(Tier::Flag), "", None));
        tally.settled(&Outcome::dead_letter(DeadLetterReason::BadBody, "not json"));
        tally.retried("returned_unsettled");
        let report = tally.report();
        assert_eq!(report.processed, 1);
        assert_eq!(report.duplicates, BTreeMap::from([("flag", 2), ("record", 1)]));
        assert_eq!(report.retries["in_flight:flag"], 1);
        assert_eq!(report.retries["returned_unsettled"], 1);
        assert_eq!(report.dead_letters, BTreeMap::from([("bad_body", 1)]));
        assert_eq!(report.settled(), 7);
        let text = report.to_string();
        assert!(text.contains("duplicates    3 (flag 2, record 1)"), "{text}");
    }

    #[tokio::test(start_paused = true)]
    async fn drained_waits_for_deliveries_in_flight_and_the_broker() {
        let tally = Tally::new();
        let delivery = tally.arrived();
        assert_eq!(tally.idle_for(), None);
        let waiting = tokio::spawn({
            let tally = tally.clone();
            async move {
                tally
                    .wait_until_drained(Duration::from_secs(1), || async { true })
                    .await
            }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "a delivery is in flight");
        drop(delivery);
        waiting.await.unwrap();
        assert!(tally.report().drained);

        let tally = Tally::new();
        let never_empty = tokio::time::timeout(
            Duration::from_secs(10),
            tally.wait_until_drained(Duration::from_secs(1), || async { false }),
        );
        assert!(never_empty.await.is_err(), "messages wait in the broker");
    }
}
