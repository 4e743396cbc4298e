//! Run with: `make chaos` (the RabbitMQ runs of every stack, on RabbitMQ 4.0 too, the
//! batched one also at the runner's default prefetch, the same with the flag alone for
//! comparison, then the RocketMQ run), or `cargo run -p integration-tests --bin chaos --
//! [--broker amqp|rocketmq] [--messages N] [--keys K] [--stack full|batched|flag-record|flag-only]
//! [--store postgres|mysql] [--default-prefetch]
//! [--rate PER_SECOND] [--fault-every-ms MS] [--broker-restart-every-s S]
//! [--handler-faults PERCENT] [--poison P] [--time-limit-s S] [--report-only]` (build
//! `amqp_consumer` and `rocketmq_consumer` first; they are started from the same directory
//! as this binary). `chaos --help` lists the options with their defaults.
//!
//! The fault-injection ledger run. A publisher sends N messages over K business keys — each
//! key once, the rest duplicates: half producer retries (the same message id), half re-sent
//! orders (a new id, the same key) — plus P poison messages, and keeps its own ledger of
//! what it sent. Two consumer processes run a stack of `integration_tests::chaos_stack`
//! behind a `tower::timeout`, writing each effect as two rows in two statements:
//!
//! - `--broker amqp` (the default): RabbitMQ, two runners per process (`amqp_consumer`, at
//!   prefetch 16 each, or with `--default-prefetch` the runner's default) on
//!   the stock-deduction stack (Redis flag, Redis lock, the record on PostgreSQL, or with
//!   `--store mysql` on MySQL/MariaDB), or with `--stack flag-only` the Redis flag alone;
//! - `--broker rocketmq`: RocketMQ, one push consumer per process (`rocketmq_consumer`) with
//!   oncely's concurrent listener on the `rocketmq-points` stack (a delivery limit counted in
//!   Redis, the Redis flag, the PostgreSQL record), keyed by KEYS; smaller and slower by
//!   default (10,000 messages over 2,000 keys at 100 a second).
//!
//! While they run, faults are injected:
//!
//! - by this process, in turn every `--fault-every-ms`: SIGKILL of a consumer process
//!   (restarted at once), Redis stopped for a second and restarted empty, Redis flushed, the
//!   consumers' PostgreSQL connections terminated (with `--store mysql`: their MySQL/MariaDB
//!   sessions `KILL`ed), and with RabbitMQ the consumers' connections closed by the broker. With RocketMQ, the broker process is SIGKILLed and
//!   started again from its store (`integration-tests/services.sh`, which also starts it
//!   should the run end while it is down) on a period of its own: its clients refuse to
//!   reconnect for 30 s after it (see `rocketmq::CLIENT_LOCKOUT`);
//! - by the handler, on a random share of its calls (PERCENT % each, default 0.5): a panic
//!   between the two writes, a sleep past the timeout between them, a failed statement
//!   ignored before returning `Ok`; and on each poison message, a SIGKILL of its own
//!   process, which this process notices and restarts.
//!
//! Redis is an instance of the run's own on a free port (with RocketMQ, a second one, left
//! alone by the faults, holds the delivery counts); PostgreSQL (or MySQL/MariaDB) and the
//! broker are the shared servers, where the run touches only its own schema (database),
//! queues or topics and consumer group, and connections (found by name; on MySQL/MariaDB,
//! by the database they use).
//!
//! The faults stop once the last message is sent and, with RabbitMQ, every key is applied
//! (RocketMQ's retries back off to minutes; faults past the last message would only stretch
//! that tail). The run then waits, without faults, until it is quiet — with RabbitMQ: every
//! poison message dead-lettered and the queues empty over a quorum queue's count tick (7
//! checks); with RocketMQ, which has no such queue to watch: every key applied, every poison
//! message dead-lettered, and one broker retry round (15 s) without a change — or the time
//! limit passes, and compares the business table with the ledger. Exits 1 if a key is
//! missing, applied more than once or applied in part, a poison message was not
//! dead-lettered as `delivery_limit`, a 5-second window between the first panic and the last
//! message sent applied nothing (a stalled consumer; windows within a RocketMQ broker
//! restart's client lockout are left out), or a kind of fault (outside or in the handler)
//! asked for never took effect — unless `--report-only` (used for the flag-only run, which
//! is expected to fail).

mod amqp;
mod broker;
mod consumers;
mod dead_letters;
mod faults;
mod options;
mod plan;
mod report;
mod rocketmq;
mod run;
mod tables;

use std::process::ExitCode;
use std::time::Instant;

use broker::{publish, stop_publishing};
use options::Options;
use plan::plan;
use run::Run;

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
    println!("{report}");
    report.verdict()
}
