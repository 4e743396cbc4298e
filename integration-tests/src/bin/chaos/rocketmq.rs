//! The RocketMQ side of the chaos run: a topic, consumer group and dead-letter topic of the
//! run's own, a publisher that keeps re-sending while the broker is down, the broker's own
//! fault (its process SIGKILLed and started again), and the dead letters as they arrive.
//!
//! RocketMQ has no queue to watch for "every copy answered" (copies a consumer sent back
//! wait in the broker's schedule for 10 s, 30 s, 1 min, …): the run is quiet once every key
//! is applied, every poison message is dead-lettered and a first retry round has passed
//! since.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration_tests::chaos_stack::DELIVERIES_REDIS_ENV;
use integration_tests::redis_server::ScratchRedis;
use integration_tests::rocketmq::{ScratchRocketMq, message, property};
use oncely_rocketmq::rocketmq_client_rust::DefaultMQProducer;
use oncely_rocketmq::rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use oncely_rocketmq::rocketmq_model::common::message::message_ext::MessageExt;
use oncely_rocketmq::rocketmq_model::common::message::{MessageConst, MessageTrait};
use oncely_rocketmq::rocketmq_model::result::SendStatus;

use crate::dead_letters::{DeadLetters, reason_code};
use crate::options::BrokerKind;

/// The broker's port, as `integration-tests/services.sh` starts it.
const BROKER_PORT: u16 = 10911;

/// The script that starts the broker the way the tests expect it (loopback, its store under
/// `/tmp/oncely-rocketmq`, so messages survive a restart).
const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/services.sh");

/// Queues of the run's topic: two for each consumer process.
const QUEUES: i32 = 4;

/// How long clients cannot reach the broker after it restarted: `rocketmq-client-rust` 1.0
/// (its transport's circuit breaker, `rocketmq-transport`'s `CircuitBreaker::default_breaker`)
/// refuses to connect to an address for 30 s after 5 failed connects, which a restart of a
/// second or less is enough for — producers and consumers alike. Measured here: nothing is
/// consumed or sent for 29 to 32 s after the broker is back. Plus a margin.
pub(crate) const CLIENT_LOCKOUT: Duration = Duration::from_secs(35);

/// How long the publisher waits before sending a message again that the broker did not
/// store (it is down, or restarting).
const RESEND_DELAY: Duration = Duration::from_millis(200);

/// The run's topics and client, and the dead letters read back so far.
pub(crate) struct RocketMq {
    scratch: ScratchRocketMq,
    dead_letters: Arc<Mutex<Vec<MessageExt>>>,
    /// The consumers' delivery counts, on a Redis the faults leave alone (see
    /// `integration_tests::chaos_stack::DELIVERIES_REDIS_ENV`).
    deliveries: ScratchRedis,
    /// Starts the broker again, should the run end while it is down.
    _broker: BrokerUp,
}

impl RocketMq {
    /// Creates the run's topic and dead-letter topic and starts reading dead letters.
    pub(crate) async fn start() -> Self {
        let broker = BrokerUp;
        tokio::task::spawn_blocking(ensure_broker)
            .await
            .expect("the broker started");
        let mut scratch = ScratchRocketMq::new("chaos").await;
        scratch.create_topics(QUEUES).await;
        let dead_letters = scratch.collect_dead_letters().await;
        RocketMq {
            scratch,
            dead_letters,
            deliveries: ScratchRedis::start(),
            _broker: broker,
        }
    }

    /// The arguments of `rocketmq_consumer`: the run's topic, consumer group and dead-letter
    /// topic, its schema and Redis prefix.
    pub(crate) fn consumer_args(&self, schema: &str, prefix: &str) -> Vec<String> {
        let scratch = &self.scratch;
        [
            &scratch.topic,
            &scratch.group,
            &scratch.dead_letter_topic,
            schema,
            prefix,
        ]
        .map(|arg| arg.to_owned())
        .to_vec()
    }

    /// The environment of `rocketmq_consumer` beside the run's own: the Redis of the delivery
    /// counts.
    pub(crate) fn consumer_environment(&self) -> Vec<(&'static str, String)> {
        vec![(DELIVERIES_REDIS_ENV, self.deliveries.url())]
    }

    /// A publisher to the run's topic.
    pub(crate) fn publisher(&self) -> Publisher {
        Publisher {
            producer: self.scratch.producer(),
            topic: self.scratch.topic.clone(),
        }
    }

    /// The dead letters read so far, sorted.
    pub(crate) fn dead_letters(&self) -> DeadLetters {
        let messages = self.dead_letters.lock().expect("not poisoned");
        let letters: Vec<(String, Vec<u8>)> = messages
            .iter()
            .map(|message| {
                let body = message.body().map(|body| body.to_vec()).unwrap_or_default();
                (
                    reason_code(BrokerKind::RocketMq, |name| property(message, name)),
                    body,
                )
            })
            .collect();
        DeadLetters::sort(letters.iter().map(|(code, body)| (code.clone(), &body[..])))
    }

    /// True once every poison message is dead-lettered.
    pub(crate) fn idle(&self, poison: usize) -> bool {
        self.dead_letters().poison_at_limit.len() >= poison
    }

    /// The dead letters, then the client shut down and the broker up. The topics are left
    /// behind, as the tests leave theirs: their names are the run's own.
    pub(crate) async fn finish(self) -> DeadLetters {
        let dead = self.dead_letters();
        self.scratch.shutdown().await;
        dead
    }
}

/// A new message id, as the RocketMQ producer makes them (`UNIQ_KEY`).
pub(crate) fn new_message_id() -> String {
    MessageClientIDSetter::create_uniq_id()
}

/// Publishes to the run's topic, re-sending until the broker stored the message.
pub(crate) struct Publisher {
    producer: Arc<DefaultMQProducer>,
    topic: String,
}

impl Publisher {
    /// Sends `body` with the unique id `id` and the KEYS `key`, again and again until the
    /// broker answers `SEND_OK`, as a producer that must not lose a message does: a send
    /// the broker stored but did not confirm (it went down meanwhile) makes one more
    /// producer retry, under the same id.
    pub(crate) async fn send(&self, body: &[u8], key: &str, id: &str) {
        loop {
            let mut message = message(&self.topic, Some(key), body);
            message.put_property(
                MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX.into(),
                id.into(),
            );
            match self.producer.send(message).await {
                Ok(Some(result)) if result.send_status == SendStatus::SendOk => return,
                _ => tokio::time::sleep(RESEND_DELAY).await,
            }
        }
    }
}

/// SIGKILLs the broker — the process listening on its port — and starts it again as
/// `services.sh` does, from its store; true if a broker was killed. Blocks for the restart
/// (about 3 s).
pub(crate) fn restart_broker() -> bool {
    let Some(pid) = listener_pid(BROKER_PORT) else {
        ensure_broker();
        return false;
    };
    let killed = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .is_ok_and(|status| status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while broker_listens() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    ensure_broker();
    killed
}

fn broker_listens() -> bool {
    TcpStream::connect(("127.0.0.1", BROKER_PORT)).is_ok()
}

/// Starts the name server and broker with `services.sh rocketmq` unless they are up; panics
/// with the script's output if it could not.
fn ensure_broker() {
    if let Err(problem) = start_broker() {
        panic!("{problem}");
    }
}

fn start_broker() -> Result<(), String> {
    match Command::new(SERVICES).arg("rocketmq").output() {
        Ok(Output { status, .. }) if status.success() => Ok(()),
        Ok(Output { stderr, .. }) => Err(format!(
            "{SERVICES} rocketmq failed (see /tmp/oncely-rocketmq/broker.log): {}",
            String::from_utf8_lossy(&stderr)
        )),
        Err(error) => Err(format!("{SERVICES} does not run: {error}")),
    }
}

/// Starts the broker again when dropped, if it is down: the run may end (or panic) while a
/// restart is under way.
struct BrokerUp;

impl Drop for BrokerUp {
    fn drop(&mut self) {
        if !broker_listens()
            && let Err(problem) = start_broker()
        {
            eprintln!("chaos: the RocketMQ broker is down and did not start again: {problem}");
        }
    }
}

/// The process listening on TCP `port` on this machine, found through `/proc`: the socket's
/// inode in `/proc/net/tcp` (or `tcp6`), then the process holding it among `/proc/*/fd`.
fn listener_pid(port: u16) -> Option<u32> {
    let inode = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| listening_inode(Path::new(table), port))?;
    let socket = format!("socket:[{inode}]");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|process| {
        let pid: u32 = process.file_name().to_str()?.parse().ok()?;
        let fds = std::fs::read_dir(process.path().join("fd")).ok()?;
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == socket.as_str()))
            .then_some(pid)
    })
}

/// The inode of the socket listening on `port` in a `/proc/net/tcp`-style `table`.
fn listening_inode(table: &Path, port: u16) -> Option<String> {
    const LISTEN: &str = "0A";
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let local_port = fields.get(1)?.rsplit(':').next()?;
        let listening = u16::from_str_radix(local_port, 16).ok()? == port && *fields.get(3)? == LISTEN;
        listening.then(|| fields.get(9).map(|inode| (*inode).to_owned()))?
    })
}
