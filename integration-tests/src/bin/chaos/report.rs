//! What a chaos run ends with — the business table against the ledger, the throughput
//! windows, the dead letters, the faults — and the table and verdict it prints.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::process::ExitCode;
use std::time::Duration;

use integration_tests::chaos_stack::{
    CHAOS_PREFETCH, ChaosStack, DELIVERY_LIMIT as ROUTE_DELIVERY_LIMIT, HANDLER_TIMEOUT, HandlerFault,
};
use integration_tests::thousands;
use oncely_amqp::DEFAULT_PREFETCH;

use crate::dead_letters::{DELIVERY_LIMIT, DeadLetters};
use crate::faults::Fault;
use crate::options::{BrokerKind, Options};
use crate::tables::{Ledger, Throughput, WINDOW};

/// The run's outcome against the ledger, and the faults it went through.
pub(crate) struct Report {
    pub(crate) options: Options,
    pub(crate) ledger: Ledger,
    pub(crate) throughput: Throughput,
    pub(crate) dead: DeadLetters,
    pub(crate) faults: BTreeMap<Fault, u32>,
    pub(crate) handler_faults: BTreeMap<HandlerFault, i64>,
    pub(crate) crashes: usize,
    /// What followed the last consumer kill, if there was one.
    pub(crate) recovery: Option<Recovery>,
    pub(crate) wall_time: Duration,
    pub(crate) timed_out: bool,
}

/// How long the consumers took to finish after the last consumer kill: from the kill to the
/// last effect written (none written after it: `None`), and to the last message sent (sent
/// before it: `None`), so the reader can tell recovery from keys still arriving.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recovery {
    pub(crate) after_kill: Option<Duration>,
    pub(crate) publishing_after_kill: Option<Duration>,
}

impl fmt::Display for Recovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.after_kill {
            Some(drained) => write!(f, "{:.1} s", drained.as_secs_f64())?,
            None => f.write_str("nothing was left")?,
        }
        match self.publishing_after_kill {
            Some(publishing) => write!(
                f,
                " (messages kept arriving for {:.1} s of it)",
                publishing.as_secs_f64()
            ),
            None => f.write_str(" (every message had been sent)"),
        }
    }
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
            (
                "time to drain after the last consumer kill (to the last effect)",
                self.recovery.map_or_else(
                    || "no consumer was killed".to_owned(),
                    |recovery| recovery.to_string(),
                ),
            ),
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
            "{:.1} effects/s (effects per {} s window: {}{left_out})",
            lowest as f64 / WINDOW.as_secs_f64(),
            WINDOW.as_secs(),
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

    /// The broker and the stack the run went through and, on RabbitMQ, the runners' prefetch.
    fn title(&self) -> String {
        let stack = self.stack();
        let title = match (self.options.broker, self.options.default_prefetch) {
            (BrokerKind::Amqp, true) => {
                format!("{stack}; the runner's default prefetch ({DEFAULT_PREFETCH})")
            }
            (BrokerKind::Amqp, false) => format!("{stack}; prefetch {CHAOS_PREFETCH}"),
            (BrokerKind::RocketMq, _) => stack,
        };
        match self.options.tls {
            true => format!("{title}; every consumer connection on TLS"),
            false => title,
        }
    }

    /// The tiers of the run's consumers.
    fn stack(&self) -> String {
        let timeout = HANDLER_TIMEOUT.as_secs_f64();
        let store = self.options.store.name();
        match (self.options.broker, self.options.stack) {
            (BrokerKind::Amqp, ChaosStack::Full) => format!(
                "RabbitMQ, full stack: tower timeout ({timeout} s), Redis flag, Redis lock, {store} record (transactional)"
            ),
            (BrokerKind::Amqp, ChaosStack::FlagOnly) => format!(
                "RabbitMQ, flag only: tower timeout ({timeout} s), Redis flag, handler writes on its own"
            ),
            (BrokerKind::Amqp, ChaosStack::FlagRecord) => format!(
                "RabbitMQ, flag and record: tower timeout ({timeout} s), Redis flag (record behind), {store} record (transactional)"
            ),
            (BrokerKind::Amqp, ChaosStack::Batched) => format!(
                "RabbitMQ, full stack, batched: tower timeout ({timeout} s), Redis flag, Redis lock, {store} record (transactional, batched)"
            ),
            (BrokerKind::RocketMq, _) => format!(
                "RocketMQ, rocketmq-points stack: delivery limit {ROUTE_DELIVERY_LIMIT} (Redis), tower timeout ({timeout} s), Redis flag (record behind), {store} record (transactional)"
            ),
        }
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
                "a {} s window after the first panic applied nothing while messages arrived",
                WINDOW.as_secs()
            ),
        );
        for fault in Fault::of(options.broker, options.store) {
            let fired = self.faults.get(&fault).copied().unwrap_or(0);
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

    /// Prints PASS or FAIL with every problem, and the exit status that goes with it
    /// (success whatever the problems with `--report-only`).
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

impl fmt::Display for Report {
    /// The run as a Markdown table, under a title naming the broker and the stack.
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(out, "\nchaos run — {}\n", self.title())?;
        writeln!(out, "| measure | value |\n|---|---|")?;
        for (measure, value) in self.rows() {
            writeln!(out, "| {measure} | {value} |")?;
        }
        Ok(())
    }
}
