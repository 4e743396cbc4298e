//! Run with: `make chaos` (the full run, then the flag-only run for comparison), or
//! `cargo run -p integration-tests --bin chaos -- [--messages N] [--keys K] [--stack full|flag-only]
//! [--rate PER_SECOND] [--fault-every-ms MS] [--handler-faults PERCENT] [--poison P]
//! [--time-limit-s S] [--report-only]` (build `amqp_consumer` first; it is started from the
//! same directory as this binary).
//!
//! The fault-injection ledger run. A publisher sends N messages over K business keys — each
//! key once, the rest duplicates: half producer retries (the same message id), half re-sent
//! orders (a new id, the same key) — plus P poison messages, and keeps its own ledger of
//! what it sent. Four consumers in two OS processes (`amqp_consumer`) run the
//! stock-deduction stack of `integration_tests::chaos_stack` behind a `tower::timeout`,
//! writing each effect as two rows in two statements. While they run, faults are injected:
//!
//! - by this process, in turn: SIGKILL of a consumer process (restarted at once), Redis
//!   stopped for a second and restarted empty, Redis flushed, the consumers' PostgreSQL
//!   connections terminated, their AMQP connections closed by the broker;
//! - by the handler, on a random share of its calls (PERCENT % each, default 0.5): a panic
//!   between the two writes, a sleep past the timeout between them, a failed statement
//!   ignored before returning `Ok`; and on each poison message, a SIGKILL of its own
//!   process, which this process notices and restarts.
//!
//! Redis is an instance of the run's own on a free port; PostgreSQL and RabbitMQ are the
//! shared servers, where the run touches only its own schema, queues and connections (found
//! by name).
//!
//! When every key is applied and the queues are empty (or the time limit passes), the
//! business table is compared with the ledger. Exits 1 if a key is missing, applied more
//! than once or applied in part, a poison message was not dead-lettered as
//! `delivery_limit`, a 5-second window between the first panic and the last message sent
//! applied nothing (a stalled consumer), or a kind of handler fault asked for never took
//! effect — unless `--report-only` (used for the flag-only run, which is expected to fail).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres::Row;
use deadpool_postgres::tokio_postgres::types::ToSql;
use integration_tests::amqp::{close_connections_named, connect, drain, scratch_topology};
use integration_tests::chaos_stack::{FAULTS_ENV, HANDLER_TIMEOUT, HandlerFault, TABLES};
use integration_tests::postgres::{ScratchSchema, database_url, pool};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::thousands;
use lapin::Channel;
use lapin::message::BasicGetMessage;
use lapin::types::AMQPValue;
use oncely_amqp::{Producer, REASON_HEADER, Topology};
use tokio::task::JoinHandle;

/// Consumer processes, each running two consumers.
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

#[derive(Clone, Debug)]
struct Options {
    messages: usize,
    keys: usize,
    poison: usize,
    /// Percent of handler calls that get each handler fault.
    handler_faults: f64,
    stack: String,
    rate: u64,
    fault_every: Duration,
    time_limit: Duration,
    report_only: bool,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut options = Options {
            messages: 50_000,
            keys: 10_000,
            poison: 5,
            handler_faults: 0.5,
            stack: "full".into(),
            rate: 2_000,
            fault_every: Duration::from_millis(500),
            time_limit: Duration::from_secs(600),
            report_only: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or(format!("{flag} needs a value"));
            let number = |text: String| text.parse::<u64>().map_err(|error| format!("{flag}: {error}"));
            let percent = |text: String| match text.parse::<f64>() {
                Ok(percent) if (0.0..=33.0).contains(&percent) => Ok(percent),
                _ => Err(format!("{flag}: a percentage from 0 to 33")),
            };
            match flag.as_str() {
                "--messages" => options.messages = number(value()?)? as usize,
                "--keys" => options.keys = number(value()?)? as usize,
                "--poison" => options.poison = number(value()?)? as usize,
                "--handler-faults" => options.handler_faults = percent(value()?)?,
                "--stack" => options.stack = value()?,
                "--rate" => options.rate = number(value()?)?.max(1),
                "--fault-every-ms" => options.fault_every = Duration::from_millis(number(value()?)?),
                "--time-limit-s" => options.time_limit = Duration::from_secs(number(value()?)?),
                "--report-only" => options.report_only = true,
                other => return Err(format!("unknown option {other}")),
            }
        }
        if options.keys == 0 || options.messages < options.keys {
            return Err("--messages must be at least --keys, and --keys at least 1".into());
        }
        if !["full", "flag-only"].contains(&options.stack.as_str()) {
            return Err("--stack is full or flag-only".into());
        }
        Ok(options)
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

/// What the publisher sends, in order:
/// - each key once under its own message id, spread evenly over the run, so that new
///   effects keep arriving for as long as the publisher runs (the throughput windows count
///   them);
/// - between them the copies, each of one of the keys sent shortly before it (the last
///   tenth of the keys so far), as retries and re-sends follow their original: alternately
///   under the original's id (a producer retry) and under a new id (a re-sent order);
/// - the poison messages spread over the first four fifths, so that orders keep flowing
///   after each of them.
fn plan(options: &Options) -> Vec<(Message, String)> {
    let recent = (options.keys / 10).max(1);
    let mut ids: Vec<String> = Vec::with_capacity(options.keys);
    let mut plan = Vec::with_capacity(options.messages + options.poison);
    for slot in 0..options.messages {
        // Exactly `keys` of the `messages` slots, evenly spaced, the first one among them.
        let original = slot * options.keys % options.messages < options.keys;
        let (key, id) = if original {
            ids.push(Producer::new_message_id());
            (ids.len() - 1, ids[ids.len() - 1].clone())
        } else {
            let copy = slot - ids.len();
            let key = ids.len() - 1 - (copy * 7919) % recent.min(ids.len());
            let id = if copy.is_multiple_of(2) {
                ids[key].clone()
            } else {
                Producer::new_message_id()
            };
            (key, id)
        };
        plan.push((Message::Order(key), id));
    }
    // From the last position back, so that each insertion leaves the earlier ones in place.
    for poison in (0..options.poison).rev() {
        let at = plan.len() * 4 * (poison + 1) / (5 * (options.poison + 1));
        plan.insert(at, (Message::Poison(poison), Producer::new_message_id()));
    }
    plan
}

/// The consumer processes: restarted after each kill, and whenever one dies on its own.
struct Consumers {
    processes: Vec<Child>,
    command: Vec<String>,
    environment: Vec<(&'static str, String)>,
}

impl Consumers {
    fn spawn(&self) -> Child {
        let binary = std::env::current_exe()
            .expect("the path of this binary")
            .with_file_name("amqp_consumer");
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
}

impl Fault {
    const ALL: [Fault; 5] = [
        Fault::KillConsumer,
        Fault::RestartRedis,
        Fault::FlushRedis,
        Fault::TerminatePostgres,
        Fault::DropAmqp,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::KillConsumer => "consumer SIGKILL",
            Fault::RestartRedis => "Redis stop+restart",
            Fault::FlushRedis => "Redis FLUSHALL",
            Fault::TerminatePostgres => "pg_terminate_backend",
            Fault::DropAmqp => "AMQP connections closed",
        }
    }
}

/// Messages (ready and unacknowledged) in the run's work, suspect and retry queues.
fn messages_in_queues(topology: &Topology) -> Option<u64> {
    let listed = Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "--no-table-headers", "name", "messages"])
        .output()
        .ok()?;
    let listing = String::from_utf8_lossy(&listed.stdout);
    let mut total = 0;
    for line in listing.lines() {
        let mut fields = line.split_whitespace();
        let (Some(name), Some(count)) = (fields.next(), fields.next()) else {
            continue;
        };
        if name.starts_with(topology.queue()) && name != topology.dead_letter_queue() {
            total += count.parse::<u64>().ok()?;
        }
    }
    Some(total)
}

/// The business table against the publisher's ledger, per order key.
#[derive(Clone, Copy, Debug, Default)]
struct Ledger {
    /// First parts written: one per effect applied.
    effects: i64,
    /// Keys with at least one part.
    applied_keys: i64,
    /// Keys with either part written more than once.
    doubled: i64,
    /// Keys with more of one part than of the other: an effect applied in half.
    partial: i64,
}

/// Effects applied per throughput window between the first handler panic and the last
/// message sent; none without a panic, or with less than a window between the two.
#[derive(Clone, Debug, Default)]
struct Throughput {
    windows: Vec<i64>,
}

impl Throughput {
    /// The fewest effects applied in one window.
    fn lowest(&self) -> Option<i64> {
        self.windows.iter().copied().min()
    }
}

/// What the dead-letter queue held at the end.
#[derive(Debug, Default)]
struct DeadLetters {
    by_code: BTreeMap<String, u64>,
    /// Poison keys dead-lettered with [`DELIVERY_LIMIT`].
    poison_at_limit: BTreeSet<String>,
}

impl DeadLetters {
    /// Takes every message from `topology`'s dead-letter queue and sorts it by reason.
    async fn drain(channel: &Channel, topology: &Topology) -> Self {
        let mut dead = DeadLetters::default();
        for message in drain(channel, &topology.dead_letter_queue()).await {
            let code = reason_code(&message);
            if code == DELIVERY_LIMIT
                && let Some(key) = poison_key(&message)
            {
                dead.poison_at_limit.insert(key);
            }
            *dead.by_code.entry(code).or_default() += 1;
        }
        dead
    }
}

/// The code of a dead letter's reason header (`code: detail`), read as text so the run does
/// not depend on the middleware's reason types.
fn reason_code(message: &BasicGetMessage) -> String {
    let reason = message
        .delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| match headers.inner().get(REASON_HEADER) {
            Some(AMQPValue::LongString(text)) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
            _ => None,
        });
    match reason {
        Some(reason) => reason.split(':').next().unwrap_or_default().to_owned(),
        None => "no reason".into(),
    }
}

/// The key of a dead-lettered poison message, read from its body.
fn poison_key(message: &BasicGetMessage) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(&message.delivery.data).ok()?;
    if body.pointer("/poison")?.as_bool()? {
        Some(body.pointer("/orderId")?.as_str()?.to_owned())
    } else {
        None
    }
}

/// Fields drop in order: the consumers stop before their Redis and schema go away.
struct Run {
    consumers: Consumers,
    redis: ScratchRedis,
    schema: ScratchSchema,
    topology: Topology,
    /// The run's own PostgreSQL pool, not terminated by the faults.
    pool: Pool,
    channel: Channel,
    /// Names the consumers' PostgreSQL (`application_name`) and AMQP connections, so the
    /// faults hit only them.
    name: String,
    faults: BTreeMap<Fault, u32>,
    /// Consumer processes that died on their own and were restarted.
    crashes: usize,
}

impl Run {
    async fn start(options: &Options) -> Run {
        let id = oncely::Token::random();
        let pool = pool(2);
        let schema = ScratchSchema::new(&pool).await;
        schema.execute(TABLES).await;
        let topology = scratch_topology("chaos");
        let channel = connect()
            .await
            .expect("RabbitMQ")
            .create_channel()
            .await
            .expect("a channel");
        topology.declare(&channel).await.expect("declare the queues");
        let redis = ScratchRedis::start();
        let name = format!("oncely-chaos-{id}");
        let url = database_url();
        let separator = if url.contains('?') { '&' } else { '?' };
        let mut consumers = Consumers {
            processes: Vec::new(),
            command: vec![
                topology.queue().to_owned(),
                schema.name().to_owned(),
                format!("chaos-{id}"),
                options.stack.clone(),
                name.clone(),
            ],
            environment: vec![
                ("REDIS_URL", redis.url()),
                ("DATABASE_URL", format!("{url}{separator}application_name={name}")),
                (FAULTS_ENV, options.handler_faults.to_string()),
            ],
        };
        consumers.processes = (0..PROCESSES).map(|_| consumers.spawn()).collect();
        Run {
            consumers,
            redis,
            schema,
            topology,
            pool,
            channel,
            name,
            faults: BTreeMap::new(),
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
            Fault::DropAmqp => {
                let name = self.name.clone();
                tokio::task::spawn_blocking(move || close_connections_named(&name))
                    .await
                    .unwrap_or(0)
                    > 0
            }
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

    /// Injects the faults in turn until every key is applied after the publisher finished,
    /// or the deadline passes.
    async fn inject_until_applied(
        &mut self,
        options: &Options,
        publishing: &JoinHandle<SystemTime>,
        deadline: Instant,
    ) {
        let mut next_fault = Instant::now() + options.fault_every;
        let mut turn = 0;
        while Instant::now() < deadline {
            self.supervise_for(Duration::from_millis(250)).await;
            if publishing.is_finished() && self.ledger().await.applied_keys >= options.keys as i64 {
                break;
            }
            if Instant::now() >= next_fault {
                self.inject(Fault::ALL[turn % Fault::ALL.len()]).await;
                turn += 1;
                next_fault = Instant::now() + options.fault_every;
            }
        }
    }

    /// Waits, without faults, until every copy still queued or in a retry or suspect queue
    /// is answered: the queues empty at three checks in a row, a second apart.
    async fn wait_until_quiet(&mut self, deadline: Instant) {
        let mut quiet_checks = 0;
        while Instant::now() < deadline && quiet_checks < 3 {
            self.supervise_for(Duration::from_secs(1)).await;
            let topology = self.topology.clone();
            let queued = tokio::task::spawn_blocking(move || messages_in_queues(&topology))
                .await
                .ok()
                .flatten();
            quiet_checks = if queued == Some(0) { quiet_checks + 1 } else { 0 };
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
    /// also the empty ones. While messages arrive, new keys keep arriving, so a healthy
    /// consumer applies some in every window; after the last one, only the retries of a
    /// few keys are left, some waiting out a lease, and a quiet window there is no stall.
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
                 SELECT count(m.id) AS applied
                 FROM windows w LEFT JOIN {schema}.stock_moves m
                   ON m.part = 1 AND m.created_at >= w.opens AND m.created_at < w.opens + w.width
                 GROUP BY w.opens ORDER BY w.opens",
                &[&HandlerFault::Panic.code(), &(WINDOW_SECONDS as f64), &published],
            )
            .await;
        Throughput {
            windows: rows.iter().map(|row| row.get(0)).collect(),
        }
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

    /// Everything the report needs, then the queues deleted.
    async fn finish(self, options: &Options, started: Instant, published: SystemTime) -> Report {
        let ledger = self.ledger().await;
        let throughput = self.throughput(published).await;
        let handler_faults = self.handler_faults().await;
        let dead = DeadLetters::drain(&self.channel, &self.topology).await;
        self.topology
            .delete(&self.channel)
            .await
            .expect("delete the queues");
        Report {
            options: options.clone(),
            ledger,
            throughput,
            dead,
            faults: self.faults,
            handler_faults,
            crashes: self.crashes,
            wall_time: started.elapsed(),
            timed_out: started.elapsed() >= options.time_limit,
        }
    }
}

/// Publishes the plan at `rate` messages a second on eight concurrent publishers sharing
/// one confirmed channel, so that the faults fall while messages still arrive; answers when
/// the last message was confirmed.
async fn publish(plan: Vec<(Message, String)>, queue: String, rate: u64) -> SystemTime {
    let producer = Arc::new(Producer::new(connect().await.expect("RabbitMQ")));
    let plan = Arc::new(plan);
    let publishers: Vec<_> = (0..8)
        .map(|lane| {
            let (producer, plan, queue) = (producer.clone(), plan.clone(), queue.clone());
            tokio::spawn(async move {
                let mut pace = tokio::time::interval(Duration::from_secs_f64(8.0 / rate as f64));
                for (message, id) in plan.iter().skip(lane).step_by(8) {
                    pace.tick().await;
                    producer
                        .publish_with_id(id, "", &queue, &message.body(), Some(&message.key()))
                        .await
                        .expect("publish");
                }
            })
        })
        .collect();
    for publisher in publishers {
        publisher.await.expect("a publisher");
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

/// The run's outcome against the ledger, and the faults it went through.
struct Report {
    options: Options,
    ledger: Ledger,
    throughput: Throughput,
    dead: DeadLetters,
    faults: BTreeMap<Fault, u32>,
    handler_faults: BTreeMap<HandlerFault, i64>,
    crashes: usize,
    wall_time: Duration,
    timed_out: bool,
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
        let dead_total: u64 = self.dead.by_code.values().sum();
        let codes: Vec<String> = self
            .dead
            .by_code
            .iter()
            .map(|(code, n)| format!("{code} {n}"))
            .collect();
        let dead = if codes.is_empty() {
            dead_total.to_string()
        } else {
            format!("{dead_total} ({})", codes.join(", "))
        };
        let lowest = match self.throughput.lowest() {
            Some(lowest) => {
                let windows: Vec<String> = self
                    .throughput
                    .windows
                    .iter()
                    .map(|n| thousands(*n as f64))
                    .collect();
                format!(
                    "{:.1} effects/s (effects per {WINDOW_SECONDS} s window: {})",
                    lowest as f64 / WINDOW_SECONDS as f64,
                    windows.join(", ")
                )
            }
            None => "— (no whole window between the first panic and the last message sent)".into(),
        };
        let injected: Vec<(&str, i64)> = (self.faults.iter())
            .map(|(fault, n)| (fault.name(), i64::from(*n)))
            .chain(self.handler_faults.iter().map(|(fault, n)| (fault.name(), *n)))
            .collect();
        let total: i64 = injected.iter().map(|(_, n)| n).sum();
        let kinds: Vec<String> = injected.iter().map(|(name, n)| format!("{name} ×{n}")).collect();
        vec![
            ("dead-lettered", dead),
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
                lowest,
            ),
            (
                "faults injected (took effect)",
                format!("{total}: {}", kinds.join(", ")),
            ),
        ]
    }

    fn table(&self) -> String {
        let timeout = HANDLER_TIMEOUT.as_secs_f64();
        let stack = match self.options.stack.as_str() {
            "full" => format!(
                "full stack: tower timeout ({timeout} s), Redis flag, Redis lock, PostgreSQL record (transactional)"
            ),
            _ => format!("flag only: tower timeout ({timeout} s), Redis flag, handler writes on its own"),
        };
        let mut table = String::new();
        let _ = writeln!(table, "\nchaos run — {stack}\n");
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

    fn verdict(&self) -> ExitCode {
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
        run.topology.queue().to_owned(),
        options.rate,
    ));
    run.inject_until_applied(&options, &publishing, deadline).await;
    let published = stop_publishing(publishing).await;
    run.wait_until_quiet(deadline).await;
    let report = run.finish(&options, started, published).await;
    println!("{}", report.table());
    report.verdict()
}
