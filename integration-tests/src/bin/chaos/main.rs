//! Run with: `make chaos` (the RabbitMQ run of the full stack, the same with the flag alone
//! for comparison, then the RocketMQ run), or `cargo run -p integration-tests --bin chaos --
//! [--broker amqp|rocketmq] [--messages N] [--keys K] [--stack full|flag-only]
//! [--rate PER_SECOND] [--fault-every-ms MS] [--broker-restart-every-s S]
//! [--handler-faults PERCENT] [--poison P] [--time-limit-s S] [--report-only]` (build
//! `amqp_consumer` and `rocketmq_consumer` first; they are started from the same directory
//! as this binary).
//!
//! The fault-injection ledger run. A publisher sends N messages over K business keys — each
//! key once, the rest duplicates: half producer retries (the same message id), half re-sent
//! orders (a new id, the same key) — plus P poison messages, and keeps its own ledger of
//! what it sent. Two consumer processes run a stack of `integration_tests::chaos_stack`
//! behind a `tower::timeout`, writing each effect as two rows in two statements:
//!
//! - `--broker amqp` (the default): RabbitMQ, two runners per process (`amqp_consumer`) on
//!   the stock-deduction stack (Redis flag, Redis lock, PostgreSQL record), or with
//!   `--stack flag-only` the Redis flag alone;
//! - `--broker rocketmq`: RocketMQ, one push consumer per process (`rocketmq_consumer`) with
//!   oncely's concurrent listener on the `rocketmq-points` stack (a delivery limit counted in
//!   Redis, the Redis flag, the PostgreSQL record), keyed by KEYS; smaller and slower by
//!   default (10,000 messages over 2,000 keys at 100 a second).
//!
//! While they run, faults are injected:
//!
//! - by this process, in turn every `--fault-every-ms`: SIGKILL of a consumer process
//!   (restarted at once), Redis stopped for a second and restarted empty, Redis flushed, the
//!   consumers' PostgreSQL connections terminated, and with RabbitMQ the consumers'
//!   connections closed by the broker. With RocketMQ, the broker process is SIGKILLed and
//!   started again from its store (`integration-tests/services.sh`, which also starts it
//!   should the run end while it is down) on a period of its own: its clients refuse to
//!   reconnect for 30 s after it (see `rocketmq::CLIENT_LOCKOUT`);
//! - by the handler, on a random share of its calls (PERCENT % each, default 0.5): a panic
//!   between the two writes, a sleep past the timeout between them, a failed statement
//!   ignored before returning `Ok`; and on each poison message, a SIGKILL of its own
//!   process, which this process notices and restarts.
//!
//! Redis is an instance of the run's own on a free port (with RocketMQ, a second one, left
//! alone by the faults, holds the delivery counts); PostgreSQL and the broker are the shared
//! servers, where the run touches only its own schema, queues or topics and consumer group,
//! and connections (found by name).
//!
//! The faults stop once the last message is sent and, with RabbitMQ, every key is applied
//! (RocketMQ's retries back off to minutes; faults past the last message would only stretch
//! that tail). The run then waits, without faults, until it is quiet — with RabbitMQ: the
//! queues empty; with RocketMQ, which has no such queue to watch: every key applied, every
//! poison message dead-lettered, and one broker retry round (15 s) without a change — or the
//! time limit passes, and compares the business table with the ledger. Exits 1 if a key is
//! missing, applied more than once or applied in part, a poison message was not
//! dead-lettered as `delivery_limit`, a 5-second window between the first panic and the last
//! message sent applied nothing (a stalled consumer; windows within a RocketMQ broker
//! restart's client lockout are left out), or a kind of fault (outside or in the handler)
//! asked for never took effect — unless `--report-only` (used for the flag-only run, which
//! is expected to fail).

mod amqp;
mod report;
mod rocketmq;

use std::collections::BTreeMap;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::Row;
use deadpool_postgres::tokio_postgres::types::ToSql;
use integration_tests::chaos_stack::{FAULTS_ENV, HandlerFault, TABLES};
use integration_tests::postgres::{ScratchSchema, database_url, pool};
use integration_tests::redis_server::ScratchRedis;
use report::{DeadLetters, Ledger, Report, Throughput};
use tokio::task::JoinHandle;

/// Consumer processes.
const PROCESSES: usize = 2;

/// The throughput window, in seconds: longer than the pauses the faults cause by design (Redis
/// down for a second, a consumer process restarting, a claim waiting out its 3-second
/// lease), short enough that a stalled consumer shows.
const WINDOW_SECONDS: i64 = 5;

/// The dead-letter reason code of a message that came back unsettled too often: what a
/// poison message must end as.
const DELIVERY_LIMIT: &str = "delivery_limit";

/// How often a consumer process that died on its own is looked for and restarted.
const SUPERVISION_PERIOD: Duration = Duration::from_millis(100);

/// The broker a run goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BrokerKind {
    Amqp,
    RocketMq,
}

impl BrokerKind {
    fn parse(name: &str) -> Result<Self, String> {
        match name {
            "amqp" => Ok(BrokerKind::Amqp),
            "rocketmq" => Ok(BrokerKind::RocketMq),
            _ => Err("--broker is amqp or rocketmq".into()),
        }
    }

    /// A new message id, as the broker's producers make them.
    fn new_message_id(self) -> String {
        match self {
            BrokerKind::Amqp => amqp::new_message_id(),
            BrokerKind::RocketMq => rocketmq::new_message_id(),
        }
    }
}

#[derive(Clone, Debug)]
struct Options {
    broker: BrokerKind,
    messages: usize,
    keys: usize,
    poison: usize,
    /// Percent of handler calls that get each handler fault.
    handler_faults: f64,
    stack: String,
    rate: u64,
    fault_every: Duration,
    /// RocketMQ: how often the broker is restarted, apart from the other faults.
    broker_restart_every: Duration,
    time_limit: Duration,
    report_only: bool,
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
            stack: "full".into(),
            rate,
            fault_every: Duration::from_millis(fault_every_ms),
            broker_restart_every: Duration::from_secs(45),
            time_limit: Duration::from_secs(600),
            report_only: false,
        }
    }

    fn parse() -> Result<Self, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let broker = match args.iter().position(|arg| arg == "--broker") {
            Some(at) => BrokerKind::parse(args.get(at + 1).map_or("", String::as_str))?,
            None => BrokerKind::Amqp,
        };
        let mut options = Options::defaults(broker);
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or(format!("{flag} needs a value"));
            let number = |text: String| text.parse::<u64>().map_err(|error| format!("{flag}: {error}"));
            let percent = |text: String| match text.parse::<f64>() {
                Ok(percent) if (0.0..=33.0).contains(&percent) => Ok(percent),
                _ => Err(format!("{flag}: a percentage from 0 to 33")),
            };
            match flag.as_str() {
                "--broker" => drop(value()?),
                "--messages" => options.messages = number(value()?)? as usize,
                "--keys" => options.keys = number(value()?)? as usize,
                "--poison" => options.poison = number(value()?)? as usize,
                "--handler-faults" => options.handler_faults = percent(value()?)?,
                "--stack" => options.stack = value()?,
                "--rate" => options.rate = number(value()?)?.max(1),
                "--fault-every-ms" => options.fault_every = Duration::from_millis(number(value()?)?),
                "--broker-restart-every-s" => {
                    options.broker_restart_every = Duration::from_secs(number(value()?)?.max(1));
                }
                "--time-limit-s" => options.time_limit = Duration::from_secs(number(value()?)?),
                "--report-only" => options.report_only = true,
                other => return Err(format!("unknown option {other}")),
            }
        }
        options.check()?;
        Ok(options)
    }

    fn check(&self) -> Result<(), String> {
        if self.keys == 0 || self.messages < self.keys {
            return Err("--messages must be at least --keys, and --keys at least 1".into());
        }
        match (self.broker, self.stack.as_str()) {
            (BrokerKind::Amqp, "full" | "flag-only") | (BrokerKind::RocketMq, "full") => Ok(()),
            (BrokerKind::Amqp, _) => Err("--stack is full or flag-only".into()),
            (BrokerKind::RocketMq, _) => Err("--broker rocketmq runs the full stack only".into()),
        }
    }
}

/// What one published message is.
#[derive(Clone, Copy, Debug)]
enum Message {
    /// An order, its business key `order_N`: once, or a copy.
    Order(usize),
    /// A poison message, its key `poison_N`: whichever consumer process handles it dies.
    /// Its own SKU, so that the lock its dead handlers leave behind blocks no order.
    Poison(usize),
}

impl Message {
    fn key(self) -> String {
        match self {
            Message::Order(key) => format!("order_{key}"),
            Message::Poison(key) => format!("poison_{key}"),
        }
    }

    fn body(self) -> Vec<u8> {
        let key = self.key();
        match self {
            Message::Order(order) => {
                format!(
                    r#"{{"orderId":"{key}","sku":"sku_{}","quantity":1}}"#,
                    order % 500
                )
            }
            Message::Poison(_) => {
                format!(r#"{{"orderId":"{key}","sku":"{key}","quantity":1,"poison":true}}"#)
            }
        }
        .into_bytes()
    }
}

/// What the publisher sends, in order, each with its message id (made as `broker`'s
/// producers make them):
/// - each key once under its own message id, spread evenly over the run, so that new
///   effects keep arriving for as long as the publisher runs (the throughput windows count
///   them);
/// - between them the copies, each of one of the keys sent shortly before it (the last
///   tenth of the keys so far), as retries and re-sends follow their original: alternately
///   under the original's id (a producer retry) and under a new id (a re-sent order);
/// - the poison messages spread over the first four fifths, so that orders keep flowing
///   after each of them.
fn plan(options: &Options) -> Vec<(Message, String)> {
    let new_id = || options.broker.new_message_id();
    let recent = (options.keys / 10).max(1);
    let mut ids: Vec<String> = Vec::with_capacity(options.keys);
    let mut plan = Vec::with_capacity(options.messages + options.poison);
    for slot in 0..options.messages {
        // Exactly `keys` of the `messages` slots, evenly spaced, the first one among them.
        let original = slot * options.keys % options.messages < options.keys;
        let (key, id) = if original {
            ids.push(new_id());
            (ids.len() - 1, ids[ids.len() - 1].clone())
        } else {
            let copy = slot - ids.len();
            let key = ids.len() - 1 - (copy * 7919) % recent.min(ids.len());
            let id = if copy.is_multiple_of(2) {
                ids[key].clone()
            } else {
                new_id()
            };
            (key, id)
        };
        plan.push((Message::Order(key), id));
    }
    // From the last position back, so that each insertion leaves the earlier ones in place.
    for poison in (0..options.poison).rev() {
        let at = plan.len() * 4 * (poison + 1) / (5 * (options.poison + 1));
        plan.insert(at, (Message::Poison(poison), new_id()));
    }
    plan
}

/// The consumer processes: restarted after each kill, and whenever one dies on its own.
struct Consumers {
    processes: Vec<Child>,
    /// The consumer binary, beside this one.
    binary: &'static str,
    command: Vec<String>,
    environment: Vec<(&'static str, String)>,
}

impl Consumers {
    fn spawn(&self) -> Child {
        let binary = std::env::current_exe()
            .expect("the path of this binary")
            .with_file_name(self.binary);
        Command::new(&binary)
            .args(&self.command)
            .envs(self.environment.iter().map(|(name, value)| (name, value)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("{} does not start ({error}); build it first", binary.display()))
    }

    fn kill_and_restart(&mut self, index: usize) {
        let _ = self.processes[index].kill();
        let _ = self.processes[index].wait();
        self.processes[index] = self.spawn();
    }

    /// Restarts every process that has exited since the last look (a poison message's
    /// SIGKILL, or any other crash) and says how many.
    fn restart_exited(&mut self) -> usize {
        let exited: Vec<usize> = (0..self.processes.len())
            .filter(|&index| matches!(self.processes[index].try_wait(), Ok(Some(_))))
            .collect();
        for &index in &exited {
            self.processes[index] = self.spawn();
        }
        exited.len()
    }
}

impl Drop for Consumers {
    fn drop(&mut self) {
        for process in &mut self.processes {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

/// A fault this process injects from outside the consumers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillConsumer,
    RestartRedis,
    FlushRedis,
    TerminatePostgres,
    DropAmqp,
    RestartBroker,
}

impl Fault {
    /// The faults of a run on `broker`, in the order they are injected.
    fn of(broker: BrokerKind) -> &'static [Fault] {
        match broker {
            BrokerKind::Amqp => &[
                Fault::KillConsumer,
                Fault::RestartRedis,
                Fault::FlushRedis,
                Fault::TerminatePostgres,
                Fault::DropAmqp,
            ],
            BrokerKind::RocketMq => &[
                Fault::KillConsumer,
                Fault::RestartRedis,
                Fault::FlushRedis,
                Fault::TerminatePostgres,
                Fault::RestartBroker,
            ],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Fault::KillConsumer => "consumer SIGKILL",
            Fault::RestartRedis => "Redis stop+restart",
            Fault::FlushRedis => "Redis FLUSHALL",
            Fault::TerminatePostgres => "pg_terminate_backend",
            Fault::DropAmqp => "AMQP connections closed",
            Fault::RestartBroker => "broker SIGKILL+restart",
        }
    }
}

/// When the outside faults come: the broker's faults in turn, one every `--fault-every-ms`,
/// except the broker restart, which comes on its own period. A restarted RocketMQ broker
/// locks its clients out for [`rocketmq::CLIENT_LOCKOUT`], so restarts in the rotation would
/// keep them locked out nearly all the time.
struct Schedule {
    rotation: Vec<Fault>,
    turn: usize,
    every: Duration,
    next: Instant,
    /// The broker restart's period and when it is next due, on RocketMQ.
    restart: Option<(Duration, Instant)>,
}

impl Schedule {
    fn new(options: &Options) -> Self {
        let faults = Fault::of(options.broker);
        let now = Instant::now();
        Schedule {
            rotation: faults
                .iter()
                .copied()
                .filter(|fault| *fault != Fault::RestartBroker)
                .collect(),
            turn: 0,
            every: options.fault_every,
            next: now + options.fault_every,
            // The first one three quarters through the publisher's planned time at the
            // latest, so that it falls while messages arrive, after throughput windows that
            // its clients' lockout leaves alone.
            restart: faults.contains(&Fault::RestartBroker).then(|| {
                let every = options.broker_restart_every;
                let publishing = Duration::from_secs_f64(options.messages as f64 / options.rate as f64);
                (every, now + every.min(publishing * 3 / 4))
            }),
        }
    }

    /// The fault due now, if any; the next one of its kind is due a period after `now`.
    fn due(&mut self, now: Instant) -> Option<Fault> {
        if let Some((every, next)) = &mut self.restart
            && now >= *next
        {
            *next = now + *every;
            return Some(Fault::RestartBroker);
        }
        if now < self.next || self.rotation.is_empty() {
            return None;
        }
        self.next = now + self.every;
        self.turn += 1;
        Some(self.rotation[(self.turn - 1) % self.rotation.len()])
    }
}

/// A consumer binary, its arguments and environment variables.
type ConsumerCommand = (&'static str, Vec<String>, Vec<(&'static str, String)>);

/// What differs between the brokers: where messages go, how the consumers are started,
/// when the run is quiet, where dead letters are read.
enum Broker {
    Amqp(amqp::Amqp),
    RocketMq(Box<rocketmq::RocketMq>),
}

impl Broker {
    async fn start(kind: BrokerKind) -> Self {
        match kind {
            BrokerKind::Amqp => Broker::Amqp(amqp::Amqp::start().await),
            BrokerKind::RocketMq => Broker::RocketMq(Box::new(rocketmq::RocketMq::start().await)),
        }
    }

    /// The consumer binary, its arguments, and its environment beside the run's own.
    fn consumer(&self, schema: &str, prefix: &str, stack: &str, name: &str) -> ConsumerCommand {
        match self {
            Broker::Amqp(amqp) => (
                "amqp_consumer",
                amqp.consumer_args(schema, prefix, stack, name),
                Vec::new(),
            ),
            Broker::RocketMq(rocketmq) => (
                "rocketmq_consumer",
                rocketmq.consumer_args(schema, prefix),
                rocketmq.consumer_environment(),
            ),
        }
    }

    async fn publisher(&self) -> Publisher {
        match self {
            Broker::Amqp(amqp) => Publisher::Amqp(Box::new(amqp.publisher().await)),
            Broker::RocketMq(rocketmq) => Publisher::RocketMq(rocketmq.publisher()),
        }
    }

    /// Whether the outside faults go on after the last message was sent, until every key
    /// is applied: with RabbitMQ, whose retries come back within a second; not with
    /// RocketMQ, whose retries back off by the broker's delay levels (10 s, 30 s, 1 min,
    /// 2 min, …), so that faults past the last message would only stretch that tail.
    fn faults_after_publishing(&self) -> bool {
        matches!(self, Broker::Amqp(_))
    }

    /// True when nothing is left to answer but what the ledger already shows (see the
    /// crate docs), at [`quiet_checks`](Self::quiet_checks) checks in a row, a second apart.
    /// RabbitMQ: the run's queues are empty. RocketMQ: every key is applied and every
    /// poison message dead-lettered.
    async fn idle(&self, options: &Options, ledger: &Ledger) -> bool {
        match self {
            Broker::Amqp(amqp) => amqp.idle().await,
            Broker::RocketMq(rocketmq) => {
                ledger.applied_keys >= options.keys as i64 && rocketmq.idle(options.poison)
            }
        }
    }

    /// RabbitMQ: three (the queues stay empty). RocketMQ: fifteen, longer than its first
    /// retry delay (10 s), so copies sent back meanwhile are answered.
    fn quiet_checks(&self) -> usize {
        match self {
            Broker::Amqp(_) => 3,
            Broker::RocketMq(_) => 15,
        }
    }

    /// The dead letters; the run's queues deleted, or its client shut down.
    async fn finish(self) -> DeadLetters {
        match self {
            Broker::Amqp(amqp) => amqp.finish().await,
            Broker::RocketMq(rocketmq) => rocketmq.finish().await,
        }
    }
}

/// Sends the plan's messages to the run's queue or topic.
enum Publisher {
    Amqp(Box<amqp::Publisher>),
    RocketMq(rocketmq::Publisher),
}

impl Publisher {
    /// Sends `message` under `id` and waits until the broker stored it.
    async fn send(&self, message: Message, id: &str) {
        let (body, key) = (message.body(), message.key());
        match self {
            Publisher::Amqp(publisher) => publisher.send(&body, &key, id).await,
            Publisher::RocketMq(publisher) => publisher.send(&body, &key, id).await,
        }
    }
}

/// Fields drop in order: the consumers stop before the broker side, their Redis and schema
/// go away.
struct Run {
    consumers: Consumers,
    broker: Broker,
    redis: ScratchRedis,
    schema: ScratchSchema,
    /// The run's own PostgreSQL pool, not terminated by the faults.
    pool: Pool,
    /// Names the consumers' PostgreSQL (`application_name`) and AMQP connections, so the
    /// faults hit only them.
    name: String,
    faults: BTreeMap<Fault, u32>,
    /// From each broker restart to the end of its clients' lockout.
    lockouts: Vec<(SystemTime, SystemTime)>,
    /// Consumer processes that died on their own and were restarted.
    crashes: usize,
}

impl Run {
    async fn start(options: &Options) -> Run {
        let id = oncely::Token::random();
        let pool = pool(2);
        let schema = ScratchSchema::new(&pool).await;
        schema.execute(TABLES).await;
        let broker = Broker::start(options.broker).await;
        let redis = ScratchRedis::start();
        let name = format!("oncely-chaos-{id}");
        let url = database_url();
        let separator = if url.contains('?') { '&' } else { '?' };
        let (binary, command, environment) =
            broker.consumer(schema.name(), &format!("chaos-{id}"), &options.stack, &name);
        let mut consumers = Consumers {
            processes: Vec::new(),
            binary,
            command,
            environment: [
                ("REDIS_URL", redis.url()),
                ("DATABASE_URL", format!("{url}{separator}application_name={name}")),
                (FAULTS_ENV, options.handler_faults.to_string()),
            ]
            .into_iter()
            .chain(environment)
            .collect(),
        };
        consumers.processes = (0..PROCESSES).map(|_| consumers.spawn()).collect();
        Run {
            consumers,
            broker,
            redis,
            schema,
            pool,
            name,
            faults: BTreeMap::new(),
            lockouts: Vec::new(),
            crashes: 0,
        }
    }

    /// Waits `duration` while restarting any consumer process that dies meanwhile.
    async fn supervise_for(&mut self, duration: Duration) {
        let until = Instant::now() + duration;
        loop {
            self.crashes += self.consumers.restart_exited();
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            tokio::time::sleep(left.min(SUPERVISION_PERIOD)).await;
        }
    }

    /// Injects `fault` and counts it if it took effect: a flush, a termination or a close
    /// that found nothing to act on (Redis down, no connection open at that moment) is not
    /// reported as a fault.
    async fn inject(&mut self, fault: Fault) {
        let took_effect = match fault {
            Fault::KillConsumer => {
                let victim = self.faults.get(&fault).copied().unwrap_or(0) as usize % PROCESSES;
                self.consumers.kill_and_restart(victim);
                true
            }
            Fault::RestartRedis => {
                self.redis.kill();
                self.supervise_for(Duration::from_secs(1)).await;
                self.redis.restart();
                true
            }
            Fault::FlushRedis => self.flush_redis().await,
            Fault::TerminatePostgres => self.terminate_postgres().await,
            Fault::DropAmqp => amqp::close_connections(&self.name).await,
            Fault::RestartBroker => self.restart_broker().await,
        };
        if took_effect {
            *self.faults.entry(fault).or_default() += 1;
        }
    }

    /// `FLUSHALL` on the run's Redis; false if Redis did not answer.
    async fn flush_redis(&self) -> bool {
        let flushed = async {
            let client = redis::Client::open(self.redis.url()).ok()?;
            let mut connection = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("FLUSHALL")
                .query_async::<()>(&mut connection)
                .await
                .ok()
        };
        flushed.await.is_some()
    }

    /// Terminates the consumers' PostgreSQL connections; false if none was open.
    async fn terminate_postgres(&self) -> bool {
        let terminated = async {
            let client = self.pool.get().await.ok()?;
            let row = client
                .query_one(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
                    &[&self.name],
                )
                .await
                .ok()?;
            Some(row.get::<_, i64>(0))
        };
        terminated.await.unwrap_or(0) > 0
    }

    /// Restarts the RocketMQ broker, restarting consumer processes that die meanwhile, and
    /// notes when its clients are locked out; true if a broker was killed.
    async fn restart_broker(&mut self) -> bool {
        let began = SystemTime::now();
        let restart = tokio::task::spawn_blocking(rocketmq::restart_broker);
        while !restart.is_finished() {
            self.supervise_for(SUPERVISION_PERIOD).await;
        }
        let killed = restart.await.unwrap_or(false);
        if killed {
            self.lockouts
                .push((began, SystemTime::now() + rocketmq::CLIENT_LOCKOUT));
        }
        killed
    }

    /// Injects the faults as they come due until the publisher finished and, with RabbitMQ,
    /// every key is applied (see [`Broker::faults_after_publishing`]), or the deadline
    /// passes.
    async fn inject_faults(
        &mut self,
        options: &Options,
        publishing: &JoinHandle<SystemTime>,
        deadline: Instant,
    ) {
        let mut schedule = Schedule::new(options);
        let until_applied = self.broker.faults_after_publishing();
        while Instant::now() < deadline {
            self.supervise_for(Duration::from_millis(250)).await;
            if publishing.is_finished()
                && (!until_applied || self.ledger().await.applied_keys >= options.keys as i64)
            {
                break;
            }
            if let Some(fault) = schedule.due(Instant::now()) {
                self.inject(fault).await;
            }
        }
    }

    /// Waits, without faults, until the broker side is idle at enough checks in a row, a
    /// second apart (see [`Broker::idle`]).
    async fn wait_until_quiet(&mut self, options: &Options, deadline: Instant) {
        let mut quiet_checks = 0;
        while Instant::now() < deadline && quiet_checks < self.broker.quiet_checks() {
            self.supervise_for(Duration::from_secs(1)).await;
            let ledger = self.ledger().await;
            quiet_checks = if self.broker.idle(options, &ledger).await {
                quiet_checks + 1
            } else {
                0
            };
        }
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

    async fn ledger(&self) -> Ledger {
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

    /// Effects applied per window, in whole windows counted back from `published` (when the
    /// last message was sent) to the first panic that took effect, every window counted,
    /// also the empty ones, except those that overlap a broker restart's lockout (no client
    /// can reach the broker then). While messages arrive, new keys keep arriving, so a
    /// healthy consumer applies some in every window; after the last one, only the retries
    /// of a few keys are left, some waiting out a lease, and a quiet window there is no stall.
    async fn throughput(&self, published: SystemTime) -> Throughput {
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
            |opens: SystemTime| (self.lockouts.iter()).any(|(from, to)| opens < *to && opens + width > *from);
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
    async fn handler_faults(&self) -> BTreeMap<HandlerFault, i64> {
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

    /// Everything the report needs; then the consumers stopped and the broker side
    /// finished (queues deleted, or client shut down).
    async fn finish(self, options: &Options, started: Instant, published: SystemTime) -> Report {
        let ledger = self.ledger().await;
        let throughput = self.throughput(published).await;
        let handler_faults = self.handler_faults().await;
        let Run {
            consumers,
            broker,
            faults,
            crashes,
            ..
        } = self;
        drop(consumers);
        let dead = broker.finish().await;
        Report {
            options: options.clone(),
            ledger,
            throughput,
            dead,
            faults,
            handler_faults,
            crashes,
            wall_time: started.elapsed(),
            timed_out: started.elapsed() >= options.time_limit,
        }
    }
}

/// Publishes the plan at `rate` messages a second on eight concurrent publishers sharing
/// one publisher (one confirmed channel, or one producer), so that the faults fall while
/// messages still arrive; answers when the last message was stored.
async fn publish(plan: Vec<(Message, String)>, publisher: Publisher, rate: u64) -> SystemTime {
    let publisher = Arc::new(publisher);
    let plan = Arc::new(plan);
    let lanes: Vec<_> = (0..8)
        .map(|lane| {
            let (publisher, plan) = (publisher.clone(), plan.clone());
            tokio::spawn(async move {
                let mut pace = tokio::time::interval(Duration::from_secs_f64(8.0 / rate as f64));
                for (message, id) in plan.iter().skip(lane).step_by(8) {
                    pace.tick().await;
                    publisher.send(*message, id).await;
                }
            })
        })
        .collect();
    for lane in lanes {
        lane.await.expect("a publisher");
    }
    SystemTime::now()
}

/// When the publisher sent its last message, or now if it is still sending (the time limit
/// passed): then it is stopped.
async fn stop_publishing(publishing: JoinHandle<SystemTime>) -> SystemTime {
    if publishing.is_finished() {
        publishing.await.expect("the publisher")
    } else {
        publishing.abort();
        SystemTime::now()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let options = match Options::parse() {
        Ok(options) => options,
        Err(problem) => {
            eprintln!("chaos: {problem}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    let deadline = started + options.time_limit;
    let mut run = Run::start(&options).await;
    let publishing = tokio::spawn(publish(
        plan(&options),
        run.broker.publisher().await,
        options.rate,
    ));
    run.inject_faults(&options, &publishing, deadline).await;
    let published = stop_publishing(publishing).await;
    run.wait_until_quiet(&options, deadline).await;
    let report = run.finish(&options, started, published).await;
    println!("{}", report.table());
    report.verdict()
}
