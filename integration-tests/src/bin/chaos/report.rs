//! What the chaos run reads back at the end — the business table against the ledger, the
//! throughput windows, the dead letters — and the table and verdict it prints.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use integration_tests::chaos_stack::{DELIVERY_LIMIT as ROUTE_DELIVERY_LIMIT, HANDLER_TIMEOUT, HandlerFault};
use integration_tests::thousands;

use crate::{BrokerKind, DELIVERY_LIMIT, Fault, Options, WINDOW_SECONDS};

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
    fn lowest(&self) -> Option<i64> {
        self.windows.iter().copied().min()
    }
}

/// What the dead-letter queue or topic held at the end.
#[derive(Debug, Default)]
pub(crate) struct DeadLetters {
    by_code: BTreeMap<String, u64>,
    /// Poison keys dead-lettered with [`DELIVERY_LIMIT`].
    pub(crate) poison_at_limit: BTreeSet<String>,
    /// Orders dead-lettered (a copy given up; its key may still have been applied by
    /// another), with their reason codes.
    orders: BTreeSet<(String, String)>,
}

impl DeadLetters {
    /// Sorts dead letters, each given as its reason (`code` or `code: detail`, read as text
    /// so the run does not depend on the middleware's reason types) and its body.
    pub(crate) fn sort<'a>(letters: impl IntoIterator<Item = (Option<String>, &'a [u8])>) -> Self {
        let mut dead = DeadLetters::default();
        for (reason, body) in letters {
            let code = match reason {
                Some(reason) => reason.split(':').next().unwrap_or_default().to_owned(),
                None => "no reason".into(),
            };
            match order_key(body) {
                Some((key, true)) if code == DELIVERY_LIMIT => {
                    dead.poison_at_limit.insert(key);
                }
                Some((key, false)) => {
                    dead.orders.insert((key, code.clone()));
                }
                _ => {}
            }
            *dead.by_code.entry(code).or_default() += 1;
        }
        dead
    }
}

/// The key of a dead letter, read from its body, and whether it is a poison message.
fn order_key(body: &[u8]) -> Option<(String, bool)> {
    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    let poison = body.pointer("/poison").and_then(|poison| poison.as_bool()) == Some(true);
    Some((body.pointer("/orderId")?.as_str()?.to_owned(), poison))
}

/// The run's outcome against the ledger, and the faults it went through.
pub(crate) struct Report {
    pub(crate) options: Options,
    pub(crate) ledger: Ledger,
    pub(crate) throughput: Throughput,
    pub(crate) dead: DeadLetters,
    pub(crate) faults: BTreeMap<Fault, u32>,
    pub(crate) handler_faults: BTreeMap<HandlerFault, i64>,
    pub(crate) crashes: usize,
    pub(crate) wall_time: Duration,
    pub(crate) timed_out: bool,
}

impl Report {
    fn missing(&self) -> i64 {
        self.options.keys as i64 - self.ledger.applied_keys
    }

    /// The table's rows: measure and value.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let (options, ledger) = (&self.options, &self.ledger);
        let duplicates = options.messages - options.keys;
        let mut rows = vec![
            (
                "messages sent",
                format!(
                    "{} + {} poison",
                    thousands(options.messages as f64),
                    options.poison
                ),
            ),
            ("distinct keys", thousands(options.keys as f64)),
            (
                "duplicates sent",
                format!(
                    "{} ({:.0} %): {} producer retries (same id), {} re-sent (new id)",
                    thousands(duplicates as f64),
                    100.0 * duplicates as f64 / options.messages as f64,
                    thousands(duplicates.div_ceil(2) as f64),
                    thousands((duplicates / 2) as f64)
                ),
            ),
            ("effects applied", thousands(ledger.effects as f64)),
            ("missing keys", self.missing().to_string()),
            ("keys applied more than once", thousands(ledger.doubled as f64)),
            (
                "partial effects (one of two rows)",
                thousands(ledger.partial as f64),
            ),
        ];
        rows.extend(self.fault_rows());
        rows.push((
            "wall time",
            format!(
                "{:.0} s{}",
                self.wall_time.as_secs_f64(),
                if self.timed_out {
                    " (time limit reached)"
                } else {
                    ""
                }
            ),
        ));
        rows
    }

    /// The rows about dead letters, poison messages, throughput and the faults.
    fn fault_rows(&self) -> Vec<(&'static str, String)> {
        vec![
            ("dead-lettered", self.dead_letters()),
            (
                "poison messages dead-lettered (delivery_limit)",
                format!(
                    "{} / {} ({} consumer crashes restarted)",
                    self.dead.poison_at_limit.len(),
                    self.options.poison,
                    self.crashes
                ),
            ),
            (
                "lowest throughput after the first panic, while messages arrive",
                self.lowest_throughput(),
            ),
            ("faults injected (took effect)", self.faults_injected()),
        ]
    }

    fn dead_letters(&self) -> String {
        let total: u64 = self.dead.by_code.values().sum();
        let codes: Vec<String> = self
            .dead
            .by_code
            .iter()
            .map(|(code, n)| format!("{code} {n}"))
            .collect();
        let mut text = total.to_string();
        if !codes.is_empty() {
            let _ = write!(text, " ({})", codes.join(", "));
        }
        if !self.dead.orders.is_empty() {
            let orders: Vec<String> = (self.dead.orders.iter().take(5))
                .map(|(key, code)| format!("{key} {code}"))
                .collect();
            let more = if self.dead.orders.len() > 5 { ", …" } else { "" };
            let _ = write!(
                text,
                "; orders among them: {} ({}{more})",
                self.dead.orders.len(),
                orders.join(", ")
            );
        }
        text
    }

    fn lowest_throughput(&self) -> String {
        let Some(lowest) = self.throughput.lowest() else {
            return match self.throughput.locked_out {
                0 => "— (no whole window between the first panic and the last message sent)".into(),
                n => format!("— (each of the {n} windows within a broker restart's client lockout)"),
            };
        };
        let windows: Vec<String> = self
            .throughput
            .windows
            .iter()
            .map(|n| thousands(*n as f64))
            .collect();
        let left_out = match self.throughput.locked_out {
            0 => String::new(),
            n => format!("; {n} left out, within a broker restart's client lockout"),
        };
        format!(
            "{:.1} effects/s (effects per {WINDOW_SECONDS} s window: {}{left_out})",
            lowest as f64 / WINDOW_SECONDS as f64,
            windows.join(", ")
        )
    }

    fn faults_injected(&self) -> String {
        let injected: Vec<(&str, i64)> = (self.faults.iter())
            .map(|(fault, n)| (fault.name(), i64::from(*n)))
            .chain(self.handler_faults.iter().map(|(fault, n)| (fault.name(), *n)))
            .collect();
        let total: i64 = injected.iter().map(|(_, n)| n).sum();
        let kinds: Vec<String> = injected.iter().map(|(name, n)| format!("{name} ×{n}")).collect();
        format!("{total}: {}", kinds.join(", "))
    }

    /// The broker and the stack the run went through.
    fn title(&self) -> String {
        let timeout = HANDLER_TIMEOUT.as_secs_f64();
        match (self.options.broker, self.options.stack.as_str()) {
            (BrokerKind::Amqp, "full") => format!(
                "RabbitMQ, full stack: tower timeout ({timeout} s), Redis flag, Redis lock, PostgreSQL record (transactional)"
            ),
            (BrokerKind::Amqp, _) => format!(
                "RabbitMQ, flag only: tower timeout ({timeout} s), Redis flag, handler writes on its own"
            ),
            (BrokerKind::RocketMq, _) => format!(
                "RocketMQ, rocketmq-points stack: delivery limit {ROUTE_DELIVERY_LIMIT} (Redis), tower timeout ({timeout} s), Redis flag, PostgreSQL record (transactional)"
            ),
        }
    }

    pub(crate) fn table(&self) -> String {
        let mut table = String::new();
        let _ = writeln!(table, "\nchaos run — {}\n", self.title());
        let _ = writeln!(table, "| measure | value |\n|---|---|");
        for (measure, value) in self.rows() {
            let _ = writeln!(table, "| {measure} | {value} |");
        }
        table
    }

    /// Every broken promise of the run, and every fault kind asked for that never took
    /// effect (the run would prove nothing about it).
    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut check = |broken: bool, problem: String| {
            if broken {
                problems.push(problem);
            }
        };
        let (ledger, options) = (&self.ledger, &self.options);
        check(self.missing() != 0, format!("{} keys missing", self.missing()));
        check(
            ledger.doubled > 0,
            format!("{} applied more than once", ledger.doubled),
        );
        check(ledger.partial > 0, format!("{} applied in part", ledger.partial));
        let innocent_at_limit = (self.dead.orders.iter())
            .filter(|(_, code)| code == DELIVERY_LIMIT)
            .count();
        check(
            innocent_at_limit > 0,
            format!(
                "{innocent_at_limit} orders that never crashed anything dead-lettered as {DELIVERY_LIMIT}"
            ),
        );
        let poison_dead = self.dead.poison_at_limit.len();
        check(
            poison_dead < options.poison,
            format!(
                "{poison_dead} of {} poison messages dead-lettered as {DELIVERY_LIMIT}",
                options.poison
            ),
        );
        check(
            self.throughput.lowest() == Some(0),
            format!(
                "a {WINDOW_SECONDS} s window after the first panic applied nothing while messages arrived"
            ),
        );
        for fault in Fault::of(options.broker) {
            let fired = self.faults.get(fault).copied().unwrap_or(0);
            check(fired == 0, format!("no {} took effect", fault.name()));
        }
        for fault in HandlerFault::ALL {
            let asked = match fault {
                HandlerFault::Poison => options.poison > 0,
                _ => options.handler_faults > 0.0,
            };
            let fired = self.handler_faults.get(&fault).copied().unwrap_or(0);
            check(asked && fired == 0, format!("no {} took effect", fault.name()));
        }
        problems
    }

    pub(crate) fn verdict(&self) -> ExitCode {
        let problems = self.problems();
        if problems.is_empty() {
            println!("PASS: every key applied exactly once and whole; every poison message dead-lettered");
            ExitCode::SUCCESS
        } else if self.options.report_only {
            println!("(report only: {})", problems.join(", "));
            ExitCode::SUCCESS
        } else {
            println!("FAIL: {}", problems.join(", "));
            ExitCode::FAILURE
        }
    }
}
