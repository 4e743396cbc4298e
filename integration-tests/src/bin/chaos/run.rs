//! One run: the consumer processes and what they run against, the faults injected into
//! them, and what is read back at the end.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use integration_tests::chaos_stack::FAULTS_ENV;
use integration_tests::postgres::database_url;
use integration_tests::redis_server::ScratchRedis;
use tokio::task::JoinHandle;

use crate::broker::Broker;
use crate::consumers::Consumers;
use crate::faults::{Fault, Schedule};
use crate::options::Options;
use crate::report::{Recovery, Report};
use crate::tables::Tables;
use crate::{amqp, rocketmq};

/// Consumer processes.
const PROCESSES: usize = 2;

/// How often a consumer process that died on its own is looked for and restarted.
const SUPERVISION_PERIOD: Duration = Duration::from_millis(100);

/// The consumer processes and everything they run against. Fields drop in order: the
/// consumers stop before the broker side, their Redis and schema go away.
pub(crate) struct Run {
    consumers: Consumers,
    /// The run's queues or topics.
    pub(crate) broker: Broker,
    redis: ScratchRedis,
    tables: Tables,
    /// Names the consumers' PostgreSQL (`application_name`) and AMQP connections, so the
    /// faults hit only them (on MySQL/MariaDB, their sessions are those on the run's
    /// database).
    name: String,
    faults: BTreeMap<Fault, u32>,
    /// From each broker restart to the end of its clients' lockout.
    lockouts: Vec<(SystemTime, SystemTime)>,
    /// Consumer processes that died on their own and were restarted.
    crashes: usize,
    /// When a consumer process was last killed.
    last_kill: Option<SystemTime>,
}

impl Run {
    /// Creates the run's schema, queues or topics and Redis, and starts the consumer
    /// processes.
    pub(crate) async fn start(options: &Options) -> Run {
        let id = oncely::Token::random();
        let tables = Tables::create(options.store).await;
        let broker = Broker::start(options.broker).await;
        let redis = match options.tls {
            true => ScratchRedis::start_tls(),
            false => ScratchRedis::start(),
        };
        let name = format!("oncely-chaos-{id}");
        let url = match options.tls {
            true => integration_tests::tls::database_tls_url(),
            false => database_url(),
        };
        let separator = if url.contains('?') { '&' } else { '?' };
        let (binary, args, broker_environment) =
            broker.consumer(tables.name(), &format!("chaos-{id}"), options, &name);
        let environment = [
            ("REDIS_URL", redis.url()),
            ("DATABASE_URL", format!("{url}{separator}application_name={name}")),
            (FAULTS_ENV, options.handler_faults.to_string()),
        ];
        // The consumers' other connections on TLS too; the run's own (publisher, tables,
        // faults) stay on the plain listeners of the same servers.
        let tls_environment = match options.tls {
            true => vec![
                ("AMQP_ADDR", integration_tests::tls::amqp_tls_addr()),
                ("MYSQL_URL", integration_tests::tls::mysql_tls_url()),
            ],
            false => Vec::new(),
        };
        let environment = (environment.into_iter())
            .chain(broker_environment)
            .chain(tls_environment)
            .collect();
        let consumers = Consumers::start(binary, args, environment, PROCESSES);
        Run {
            consumers,
            broker,
            redis,
            tables,
            name,
            faults: BTreeMap::new(),
            lockouts: Vec::new(),
            crashes: 0,
            last_kill: None,
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
                self.last_kill = Some(SystemTime::now());
                true
            }
            Fault::RestartRedis => {
                self.redis.kill();
                self.supervise_for(Duration::from_secs(1)).await;
                self.redis.restart();
                true
            }
            Fault::FlushRedis => self.flush_redis().await,
            Fault::TerminatePostgres | Fault::KillMysql => {
                self.tables.end_consumer_sessions(&self.name).await
            }
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
            let client = integration_tests::redis_client(&self.redis.url());
            let mut connection = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("FLUSHALL")
                .query_async::<()>(&mut connection)
                .await
                .ok()
        };
        flushed.await.is_some()
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
    pub(crate) async fn inject_faults(
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
                && (!until_applied || self.tables.ledger().await.applied_keys >= options.keys as i64)
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
    pub(crate) async fn wait_until_quiet(&mut self, options: &Options, deadline: Instant) {
        let mut quiet_checks = 0;
        while Instant::now() < deadline && quiet_checks < self.broker.quiet_checks() {
            self.supervise_for(Duration::from_secs(1)).await;
            let ledger = self.tables.ledger().await;
            quiet_checks = if self.broker.idle(options, &ledger).await {
                quiet_checks + 1
            } else {
                0
            };
        }
    }

    /// Everything the report needs; then the consumers stopped and the broker side
    /// finished (queues deleted, or client shut down).
    pub(crate) async fn finish(self, options: &Options, started: Instant, published: SystemTime) -> Report {
        let readings = self.tables.read(published, &self.lockouts).await;
        let recovery = self.last_kill.map(|killed| Recovery {
            after_kill: (readings.last_effect_at).and_then(|at| at.duration_since(killed).ok()),
            publishing_after_kill: published.duration_since(killed).ok(),
        });
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
            ledger: readings.ledger,
            throughput: readings.throughput,
            dead,
            faults,
            handler_faults: readings.handler_faults,
            crashes,
            recovery,
            wall_time: started.elapsed(),
            timed_out: started.elapsed() >= options.time_limit,
        }
    }
}
