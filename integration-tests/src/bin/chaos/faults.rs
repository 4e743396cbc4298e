//! The faults this process injects from outside the consumers, and when.

use std::time::{Duration, Instant};

use integration_tests::chaos_stack::ChaosStore;

use crate::options::{BrokerKind, Options};

/// A fault this process injects from outside the consumers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Fault {
    /// A consumer process SIGKILLed, and started again at once.
    KillConsumer,
    /// The run's Redis stopped for a second and started again empty.
    RestartRedis,
    /// The run's Redis emptied (`FLUSHALL`).
    FlushRedis,
    /// The consumers' PostgreSQL connections terminated (`pg_terminate_backend`).
    TerminatePostgres,
    /// The consumers' MySQL/MariaDB sessions killed (`KILL`).
    KillMysql,
    /// RabbitMQ: the consumers' connections closed by the broker.
    DropAmqp,
    /// RocketMQ: the broker SIGKILLed and started again from its store.
    RestartBroker,
}

impl Fault {
    /// The faults of a run on `broker` with the record on `store`, in the order they are
    /// injected.
    pub(crate) fn of(broker: BrokerKind, store: ChaosStore) -> [Fault; 5] {
        let database = match store {
            ChaosStore::Postgres => Fault::TerminatePostgres,
            ChaosStore::Mysql => Fault::KillMysql,
        };
        let broker = match broker {
            BrokerKind::Amqp => Fault::DropAmqp,
            BrokerKind::RocketMq => Fault::RestartBroker,
        };
        [
            Fault::KillConsumer,
            Fault::RestartRedis,
            Fault::FlushRedis,
            database,
            broker,
        ]
    }

    /// The fault as the report names it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Fault::KillConsumer => "consumer SIGKILL",
            Fault::RestartRedis => "Redis stop+restart",
            Fault::FlushRedis => "Redis FLUSHALL",
            Fault::TerminatePostgres => "pg_terminate_backend",
            Fault::KillMysql => "MySQL KILL",
            Fault::DropAmqp => "AMQP connections closed",
            Fault::RestartBroker => "broker SIGKILL+restart",
        }
    }
}

/// When the outside faults come: the broker's faults in turn, one every `--fault-every-ms`,
/// except the broker restart, which comes on its own period. A restarted RocketMQ broker
/// locks its clients out for [`CLIENT_LOCKOUT`](crate::rocketmq::CLIENT_LOCKOUT), so
/// restarts in the rotation would keep them locked out nearly all the time.
pub(crate) struct Schedule {
    rotation: Vec<Fault>,
    turn: usize,
    every: Duration,
    next: Instant,
    /// The broker restart's period and when it is next due, on RocketMQ.
    restart: Option<(Duration, Instant)>,
}

impl Schedule {
    /// The schedule of a run with `options`, starting now.
    pub(crate) fn new(options: &Options) -> Self {
        let faults = Fault::of(options.broker, options.store);
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
    pub(crate) fn due(&mut self, now: Instant) -> Option<Fault> {
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
