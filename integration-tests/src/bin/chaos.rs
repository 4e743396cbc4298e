//! Run with: `make chaos` (the full run, then the flag-only run for comparison), or
//! `cargo run -p integration-tests --bin chaos -- [--messages N] [--keys K] [--stack full|flag-only]
//! [--rate PER_SECOND] [--fault-every-ms MS] [--time-limit-s S] [--report-only]` (build `amqp_consumer` first; it
//! is started from the same directory as this binary).
//!
//! The fault-injection ledger run. A publisher sends N messages over K business keys — each
//! key once, the rest duplicates: half producer retries (the same message id), half re-sent
//! orders (a new id, the same key) — and keeps its own ledger of what it sent. Four
//! consumers in two OS processes (`amqp_consumer`) run the stock-deduction stack. While they
//! run, faults are injected in turn: SIGKILL of a consumer process (restarted at once), Redis
//! stopped for a second and restarted empty, Redis flushed, the consumers' PostgreSQL
//! connections terminated, their AMQP connections closed by the broker. Redis is an
//! instance of the run's own on a free port; PostgreSQL and RabbitMQ are the shared servers,
//! where the run touches only its own schema, queues and connections (found by name).
//!
//! When every key is applied and the queues are empty (or the time limit passes), the
//! business table is compared with the ledger. Exits 1 if a key is missing or applied more
//! than once, unless `--report-only` (used for the flag-only run, which is expected to fail).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use integration_tests::amqp::{close_connections_named, connect, drain, scratch_topology};
use integration_tests::postgres::{ScratchSchema, database_url, pool};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::thousands;
use lapin::Channel;
use lapin::types::AMQPValue;
use oncely_amqp::{Producer, REASON_HEADER, Topology};

/// Consumer processes, each running two consumers.
const PROCESSES: usize = 2;

#[derive(Clone, Debug)]
struct Options {
    messages: usize,
    keys: usize,
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
            match flag.as_str() {
                "--messages" => options.messages = number(value()?)? as usize,
                "--keys" => options.keys = number(value()?)? as usize,
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

fn order_body(key: usize) -> Vec<u8> {
    format!(
        r#"{{"orderId":"order_{key}","sku":"sku_{}","quantity":1}}"#,
        key % 500
    )
    .into_bytes()
}

/// What the publisher sends, in order: each key once under its own message id, then the
/// copies spread over the keys, alternately under the original's id (a producer retry)
/// and under a new id (a re-sent order).
fn plan(options: &Options) -> Vec<(usize, String)> {
    let ids: Vec<String> = (0..options.keys).map(|_| Producer::new_message_id()).collect();
    let mut plan: Vec<(usize, String)> = ids.iter().cloned().enumerate().collect();
    for copy in 0..options.messages - options.keys {
        let key = (copy * 7919) % options.keys;
        let id = if copy % 2 == 0 {
            ids[key].clone()
        } else {
            Producer::new_message_id()
        };
        plan.push((key, id));
    }
    plan
}

/// The consumer processes, restarted after each kill.
struct Consumers {
    processes: Vec<Child>,
    command: Vec<String>,
    redis_url: String,
    database_url: String,
}

impl Consumers {
    fn spawn(&self) -> Child {
        let binary = std::env::current_exe()
            .expect("the path of this binary")
            .with_file_name("amqp_consumer");
        Command::new(&binary)
            .args(&self.command)
            .env("REDIS_URL", &self.redis_url)
            .env("DATABASE_URL", &self.database_url)
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
}

impl Drop for Consumers {
    fn drop(&mut self) {
        for process in &mut self.processes {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

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

/// Messages (ready and unacknowledged) in the run's work and retry queues.
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
}

impl Run {
    async fn start(options: &Options) -> Run {
        let id = oncely::Token::random();
        let pool = pool(2);
        let schema = ScratchSchema::new(&pool).await;
        schema
            .execute("CREATE TABLE stock_moves (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)")
            .await;
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
            redis_url: redis.url(),
            database_url: format!("{url}{separator}application_name={name}"),
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
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.redis.restart();
                true
            }
            Fault::FlushRedis => {
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
            Fault::TerminatePostgres => {
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

    async fn applied(&self) -> (i64, i64, i64) {
        let client = self.pool.get().await.expect("PostgreSQL");
        let row = client
            .query_one(
                &format!(
                    "SELECT count(*), count(DISTINCT order_id),
                            (SELECT count(*) FROM (SELECT 1 FROM {0}.stock_moves GROUP BY order_id HAVING count(*) > 1) d)
                     FROM {0}.stock_moves",
                    self.schema.name()
                ),
                &[],
            )
            .await
            .expect("count the effects");
        (row.get(0), row.get(1), row.get(2))
    }
}

/// Publishes the plan at `rate` messages a second on eight concurrent publishers sharing
/// one confirmed channel, so that the faults fall while messages still arrive.
async fn publish(plan: Vec<(usize, String)>, queue: String, rate: u64) {
    let producer = Arc::new(Producer::new(connect().await.expect("RabbitMQ")));
    let plan = Arc::new(plan);
    let publishers: Vec<_> = (0..8)
        .map(|lane| {
            let (producer, plan, queue) = (producer.clone(), plan.clone(), queue.clone());
            tokio::spawn(async move {
                let mut pace = tokio::time::interval(Duration::from_secs_f64(8.0 / rate as f64));
                for (key, id) in plan.iter().skip(lane).step_by(8) {
                    pace.tick().await;
                    let key_text = format!("order_{key}");
                    producer
                        .publish_with_id(id, "", &queue, &order_body(*key), Some(&key_text))
                        .await
                        .expect("publish");
                }
            })
        })
        .collect();
    for publisher in publishers {
        publisher.await.expect("a publisher");
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
    let mut run = Run::start(&options).await;
    let plan = plan(&options);
    let publishing = tokio::spawn(publish(plan, run.topology.queue().to_owned(), options.rate));

    // Faults until every key is applied after the last message went out (or the limit).
    let deadline = started + options.time_limit;
    let mut next_fault = Instant::now() + options.fault_every;
    let mut turn = 0;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if publishing.is_finished() && run.applied().await.1 >= options.keys as i64 {
            break;
        }
        if Instant::now() >= next_fault {
            run.inject(Fault::ALL[turn % Fault::ALL.len()]).await;
            turn += 1;
            next_fault = Instant::now() + options.fault_every;
        }
    }
    publishing.abort();

    // Then quiet: every copy still queued or in a retry queue gets answered.
    let mut quiet_checks = 0;
    while Instant::now() < deadline && quiet_checks < 3 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let queued = tokio::task::spawn_blocking({
            let topology = run.topology.clone();
            move || messages_in_queues(&topology)
        })
        .await
        .ok()
        .flatten();
        quiet_checks = if queued == Some(0) { quiet_checks + 1 } else { 0 };
    }
    let timed_out = Instant::now() >= deadline;
    let (effects, distinct, doubled) = run.applied().await;

    let mut dead: BTreeMap<String, u64> = BTreeMap::new();
    for message in drain(&run.channel, &run.topology.dead_letter_queue()).await {
        let reason = message
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|headers| match headers.inner().get(REASON_HEADER) {
                Some(AMQPValue::LongString(text)) => {
                    Some(String::from_utf8_lossy(text.as_bytes()).into_owned())
                }
                _ => None,
            })
            .unwrap_or_else(|| "no reason".into());
        let code = reason.split(':').next().unwrap_or_default().to_owned();
        *dead.entry(code).or_default() += 1;
    }
    run.topology
        .delete(&run.channel)
        .await
        .expect("delete the queues");

    let missing = options.keys as i64 - distinct;
    let duplicates = options.messages - options.keys;
    let stack = match options.stack.as_str() {
        "full" => "full stack: Redis flag, Redis lock, PostgreSQL record (transactional)",
        _ => "flag only: Redis flag, handler writes on its own",
    };
    let mut table = String::new();
    let _ = writeln!(table, "\nchaos run — {stack}\n");
    let _ = writeln!(table, "| measure | value |\n|---|---|");
    let _ = writeln!(
        table,
        "| messages sent | {} |",
        thousands(options.messages as f64)
    );
    let _ = writeln!(table, "| distinct keys | {} |", thousands(options.keys as f64));
    let _ = writeln!(
        table,
        "| duplicates sent | {} ({:.0} %): {} producer retries (same id), {} re-sent (new id) |",
        thousands(duplicates as f64),
        100.0 * duplicates as f64 / options.messages as f64,
        thousands(duplicates.div_ceil(2) as f64),
        thousands((duplicates / 2) as f64)
    );
    let _ = writeln!(table, "| effects applied | {} |", thousands(effects as f64));
    let _ = writeln!(table, "| missing keys | {missing} |");
    let _ = writeln!(
        table,
        "| keys applied more than once | {} |",
        thousands(doubled as f64)
    );
    let dead_total: u64 = dead.values().sum();
    let reasons: Vec<String> = dead.iter().map(|(code, n)| format!("{code} {n}")).collect();
    let reasons = if reasons.is_empty() {
        String::new()
    } else {
        format!(" ({})", reasons.join(", "))
    };
    let _ = writeln!(table, "| dead-lettered | {dead_total}{reasons} |");
    let faults: Vec<String> = run
        .faults
        .iter()
        .map(|(fault, n)| format!("{} ×{n}", fault.name()))
        .collect();
    let _ = writeln!(table, "| faults injected | {} |", faults.join(", "));
    let _ = writeln!(
        table,
        "| wall time | {:.0} s{} |",
        started.elapsed().as_secs_f64(),
        if timed_out { " (time limit reached)" } else { "" }
    );
    println!("{table}");

    if missing == 0 && doubled == 0 {
        println!("PASS: every key applied exactly once");
        ExitCode::SUCCESS
    } else if options.report_only {
        println!("(report only: {missing} missing, {doubled} applied more than once)");
        ExitCode::SUCCESS
    } else {
        println!("FAIL: {missing} keys missing, {doubled} applied more than once");
        ExitCode::FAILURE
    }
}
