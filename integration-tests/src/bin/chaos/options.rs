//! The command line: which broker and stack, how many messages, how fast, which faults how
//! often; the defaults depend on the broker.

use std::time::Duration;

use clap::{Parser, ValueEnum};
use integration_tests::chaos_stack::{ChaosStack, ChaosStore};

/// The broker a run goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BrokerKind {
    /// RabbitMQ, through `amqp_consumer`.
    Amqp,
    /// RocketMQ, through `rocketmq_consumer`.
    #[value(name = "rocketmq")]
    RocketMq,
}

/// The fault-injection ledger run: publishes orders with duplicates and poison messages
/// through two consumer processes while faults are injected, then compares the business
/// table with the publisher's ledger.
#[derive(Parser)]
// A flag given twice takes its last value, as it always has.
#[command(args_override_self = true)]
struct Args {
    /// The broker the run goes through; the other options' defaults depend on it.
    #[arg(long, value_enum, default_value_t = BrokerKind::Amqp)]
    broker: BrokerKind,
    /// Messages published, duplicates included [default: 50000 (amqp), 10000 (rocketmq)].
    #[arg(long)]
    messages: Option<usize>,
    /// Distinct business keys among them [default: 10000 (amqp), 2000 (rocketmq)].
    #[arg(long)]
    keys: Option<usize>,
    /// Poison messages, on top of the messages [default: 5].
    #[arg(long)]
    poison: Option<usize>,
    /// Percent of handler calls that get each handler fault, from 0 to 33 [default: 0.5].
    #[arg(long, value_parser = percent)]
    handler_faults: Option<f64>,
    /// The consumers' stack: full, batched, flag-record or flag-only (amqp only) [default: full].
    #[arg(long)]
    stack: Option<ChaosStack>,
    /// Where the record and the effects are: postgres (`DATABASE_URL`) or mysql (`MYSQL_URL`,
    /// MySQL or MariaDB; amqp only, not with flag-only).
    #[arg(long, value_enum, default_value_t = ChaosStore::Postgres)]
    store: ChaosStore,
    /// Messages published per second [default: 2000 (amqp), 100 (rocketmq)].
    #[arg(long)]
    rate: Option<u64>,
    /// Milliseconds between two outside faults [default: 500 (amqp), 1000 (rocketmq)].
    #[arg(long)]
    fault_every_ms: Option<u64>,
    /// RocketMQ: seconds between two broker restarts [default: 45].
    #[arg(long)]
    broker_restart_every_s: Option<u64>,
    /// Seconds after which the run stops waiting and reports [default: 600].
    #[arg(long)]
    time_limit_s: Option<u64>,
    /// Report, and exit 0 whatever the verdict (the flag-only run is expected to fail).
    #[arg(long)]
    report_only: bool,
    /// RabbitMQ: the consumers' runners keep the runner's default prefetch and concurrency
    /// (`oncely_amqp::DEFAULT_PREFETCH`), as a user's do, rather than `CHAOS_PREFETCH` (16)
    /// deliveries in flight each; a killed consumer then leaves many more to redeliver.
    #[arg(long)]
    default_prefetch: bool,
    /// RabbitMQ: every connection of the consumer processes on TLS — `amqps://`
    /// (`AMQP_TLS_ADDR`), a Redis of the run's own on `rediss://`, PostgreSQL with
    /// `sslmode=require` and MariaDB with `ssl-mode=VERIFY_IDENTITY` — trusting the test CA
    /// and presenting its client certificate (`services.sh tls`).
    #[arg(long)]
    tls: bool,
}

/// A percentage of handler calls: at most a third, as each of three faults gets it.
fn percent(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(percent) if (0.0..=33.0).contains(&percent) => Ok(percent),
        _ => Err("a percentage from 0 to 33".into()),
    }
}

/// A run's settings: the command line over the broker's defaults.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub(crate) broker: BrokerKind,
    pub(crate) messages: usize,
    pub(crate) keys: usize,
    pub(crate) poison: usize,
    /// Percent of handler calls that get each handler fault.
    pub(crate) handler_faults: f64,
    pub(crate) stack: ChaosStack,
    pub(crate) store: ChaosStore,
    pub(crate) rate: u64,
    pub(crate) fault_every: Duration,
    /// RocketMQ: how often the broker is restarted, apart from the other faults.
    pub(crate) broker_restart_every: Duration,
    pub(crate) time_limit: Duration,
    pub(crate) report_only: bool,
    /// RabbitMQ: the runners at the runner's default prefetch rather than 16.
    pub(crate) default_prefetch: bool,
    /// RabbitMQ: the consumers' connections on TLS.
    pub(crate) tls: bool,
}

impl Options {
    /// The defaults of `make chaos`' run on `broker`. RocketMQ brings a retried message back
    /// after 10 s at the earliest and restarting its broker takes seconds, so its run is
    /// smaller and slower, to end in a few minutes.
    fn defaults(broker: BrokerKind) -> Self {
        let (messages, keys, rate, fault_every_ms) = match broker {
            BrokerKind::Amqp => (50_000, 10_000, 2_000, 500),
            BrokerKind::RocketMq => (10_000, 2_000, 100, 1_000),
        };
        Options {
            broker,
            messages,
            keys,
            poison: 5,
            handler_faults: 0.5,
            stack: ChaosStack::Full,
            store: ChaosStore::Postgres,
            rate,
            fault_every: Duration::from_millis(fault_every_ms),
            broker_restart_every: Duration::from_secs(45),
            time_limit: Duration::from_secs(600),
            report_only: false,
            default_prefetch: false,
            tls: false,
        }
    }

    /// The options of this process's command line; clap exits (status 2) on a malformed
    /// one, and this says what is wrong with a well-formed one that makes no sense.
    pub(crate) fn parse() -> Result<Self, String> {
        let args = Args::parse();
        let defaults = Options::defaults(args.broker);
        let options = Options {
            broker: args.broker,
            messages: args.messages.unwrap_or(defaults.messages),
            keys: args.keys.unwrap_or(defaults.keys),
            poison: args.poison.unwrap_or(defaults.poison),
            handler_faults: args.handler_faults.unwrap_or(defaults.handler_faults),
            stack: args.stack.unwrap_or(defaults.stack),
            store: args.store,
            rate: args.rate.map_or(defaults.rate, |rate| rate.max(1)),
            fault_every: args
                .fault_every_ms
                .map_or(defaults.fault_every, Duration::from_millis),
            broker_restart_every: args
                .broker_restart_every_s
                .map_or(defaults.broker_restart_every, |s| Duration::from_secs(s.max(1))),
            time_limit: args.time_limit_s.map_or(defaults.time_limit, Duration::from_secs),
            report_only: args.report_only,
            default_prefetch: args.default_prefetch,
            tls: args.tls,
        };
        options.check()?;
        Ok(options)
    }

    fn check(&self) -> Result<(), String> {
        if self.keys == 0 || self.messages < self.keys {
            return Err("--messages must be at least --keys, and --keys at least 1".into());
        }
        match (self.broker, self.stack, self.store) {
            (BrokerKind::RocketMq, _, ChaosStore::Mysql) => {
                Err("--broker rocketmq runs with --store postgres only".into())
            }
            (BrokerKind::RocketMq, ..) if self.default_prefetch => Err(
                "--broker rocketmq takes no --default-prefetch (it sets the RabbitMQ runners' prefetch)"
                    .into(),
            ),
            (BrokerKind::RocketMq, ..) if self.tls => {
                Err("--tls runs with --broker amqp only (RocketMQ over TLS is not set up here yet)".into())
            }
            (BrokerKind::RocketMq, ChaosStack::Full, _) => Ok(()),
            (BrokerKind::RocketMq, _, _) => Err("--broker rocketmq runs the full stack only".into()),
            (BrokerKind::Amqp, ChaosStack::FlagOnly, ChaosStore::Mysql) => {
                Err("--stack flag-only runs with --store postgres only".into())
            }
            (BrokerKind::Amqp, _, _) => Ok(()),
        }
    }
}
