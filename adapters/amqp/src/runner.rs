//! Consumes a queue through a route and settles every delivery with the broker.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::Confirmation;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    BasicRejectOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};
use oncely::report::{RunReport, Tally};
use oncely::tier::BoxFuture;
use oncely::{
    BoxError, BrokerAction, DeadLetter, DeadLetterReason, Envelope, Outcome, RetryReason, Route, dead_letter,
};
use tokio::sync::{OwnedRwLockReadGuard, OwnedSemaphorePermit, RwLock, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use crate::acks::Acks;
use crate::convert::{Counters, SEAL_HEADER, integer_of, to_delivery};
use crate::error::Error;
use crate::topology::Topology;

/// Header on every copy (retry, suspect, dead letter), beside the dead-letter schema of
/// [`oncely::dead_letter`]: the exchange the message was first published to. AMQP only. A
/// message replayed from the dead-letter queue (`oncely dlq replay`) starts afresh: its
/// copies name the default exchange `""` and the work queue, as the replay published it.
pub const ORIGINAL_EXCHANGE_HEADER: &str = "x-oncely-original-exchange";
/// Header on every copy (retry, suspect, dead letter), beside the dead-letter schema of
/// [`oncely::dead_letter`]: the routing key the message was first published with (the work
/// queue's name for a replayed message). AMQP only.
pub const ORIGINAL_ROUTING_KEY_HEADER: &str = "x-oncely-original-routing-key";

/// How many unacked deliveries the broker sends ahead (`basic.qos`), unless configured
/// otherwise ([`Runner::with_prefetch`]). Chosen by measurement (issue 25, RabbitMQ 3.10 on a
/// 2-core machine, quorum queues): against 64, 256 in flight ran the runner 1.8× as fast with
/// no tiers, 1.3× with the Redis flag and 1.2× with the full stack, with RabbitMQ spending
/// 10–40 % less CPU per message; 1,024 bought nothing more. Later, with the full stack
/// (the joint flag and lock coalesced, the record batched; a 2-core Intel Xeon, four runs of
/// eight rounds each, against the raw consumer at 64), 512 ran the batch handler's row at
/// 0.56–0.58× against 0.49–0.57× at 256 (10 % more on average, at 5–10 % less machine CPU a
/// message), and the per-delivery handlers' row at 0.33–0.36× either way; 1,024 ran them at
/// 0.56× and 0.34× in one run.
pub const DEFAULT_PREFETCH: u16 = 512;

/// How many deliveries the runner handles at once, unless configured otherwise
/// ([`Runner::with_concurrency`]): the whole default prefetch, so that none waits unstarted;
/// raise it with the prefetch.
pub const DEFAULT_CONCURRENCY: usize = DEFAULT_PREFETCH as usize;

/// How many times a message may come back unsettled before it is dead-lettered, unless
/// configured otherwise ([`Runner::with_max_deliveries`]).
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;

/// How many times in a row [`Runner::run_with_reconnect`] may fail to connect, open a
/// channel and declare the topology before it gives up, unless configured otherwise: with
/// its backoff (100 ms doubling to 10 s) about 45 s of trying.
pub const DEFAULT_MAX_CONNECT_FAILURES: u32 = 10;

/// How long the runner waits before returning a delivery it could not settle (its retry or
/// dead-letter copy was not confirmed) to its queue.
pub const SETTLE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// How often the runner looks for messages in an empty suspect queue.
const SUSPECT_POLL: Duration = Duration::from_millis(500);

/// The header quorum queues put on a message they deliver again: how many times it came
/// back unsettled to this queue.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Header on the runner's copies of a suspect (see [`Runner`]): how many times the message
/// came back unsettled while it ran alone. The broker's own count starts again with every
/// copy; this one carries it across retry hops, so a message that crashes its consumer only
/// after waiting (for a flag or lock its crash left behind) still reaches the limit. Read
/// only under a valid [`SEAL_HEADER`](crate::SEAL_HEADER).
pub const RETURNS_HEADER: &str = "x-oncely-returns";

/// Runs a route's stack over a RabbitMQ queue: the consumer loop you would write by hand,
/// with the acks decided by the stack's [`Outcome`]s.
///
/// | outcome | what the runner does |
/// |---|---|
/// | processed, duplicate, stale | `basic.ack` |
/// | retry later | publishes a copy to a retry queue of the [`Topology`], waits for the broker's confirm, then acks; the copy's attempt is one more, except for a wait (in flight elsewhere, lock busy), which uses up no attempt |
/// | dead letter | publishes a copy to the dead-letter queue with the dead-letter metadata of [`oncely::dead_letter`] as headers (source: the work queue), waits for the confirm, then acks |
///
/// A delivery is acked only after the stack answered for it and, for a retry or a dead
/// letter, only after the broker confirmed the copy. A copy is published once: a confirm
/// that is slow to come is waited for (about 15 s beyond the confirm timeout, warning as it
/// goes) rather than answered with a second copy, and only a copy the broker refused (a
/// negative confirm, such as a memory alarm's) is published again, for about 15 s, without
/// running the stack again. If it still fails, or no queue takes it, the delivery goes back
/// to its queue after [`SETTLE_RETRY_DELAY`] with `basic.reject` (which every RabbitMQ
/// version counts in `x-delivery-count`; `basic.nack` stops counting in 4.3), an unsettled
/// return (below). So a message is never lost between the two, a slow broker does not fill
/// the retry and dead-letter queues with copies of one message, and a broker that refuses
/// copies gets no hot loop.
///
/// **Batched acks.** On the channel it opens itself ([`run_with_reconnect`](Runner::run_with_reconnect))
/// the runner acks a run of consecutive settled deliveries with one `basic.ack`
/// (`multiple`), never past a delivery still running or not yet taken from the channel; one
/// settled behind a delivery still running waits about 5 ms for the run to reach it, then
/// is acked alone, so a slow delivery holds no one's ack for longer. Measured on the 2-core
/// machine (issue 25), this raised the runner's rate by about half with no tiers and by
/// 12–25 % with the record, and cut RabbitMQ's CPU per message by a quarter to a half. On a
/// channel you pass in ([`run`](Runner::run), [`run_consumer`](Runner::run_consumer)), which
/// another consumer may share, each delivery is acked alone: a `multiple` ack would settle
/// that consumer's deliveries too.
///
/// **Crashes and panics.** A panic in the stack is an outcome like any other failure
/// ([`Route::handle`]). A consumer process that dies (OOM, abort, SIGKILL, a fault in a C
/// library) leaves its deliveries unacked, and the broker delivers them again with
/// `x-delivery-count` — the ones that were running and the ones it had only received. Such
/// a delivery cannot be blamed yet: it is moved to the topology's suspect queue, and from
/// then on every copy of it (its retries carry [`RETURNS_HEADER`]) runs alone. The runner
/// takes a suspect (`basic.get`) only once nothing else runs behind its [`SuspectGate`] (the
/// runner's own, or one shared with other runners) and holds back
/// new work while it runs, so a crash while it runs is that message's own: only those
/// crashes count. A message that came back unsettled [`max_deliveries`](Runner::with_max_deliveries)
/// times while running alone — crashes, lost channels, or copies the broker kept refusing —
/// is dead-lettered with [`DeadLetterReason::DeliveryLimit`] without running again. A
/// message that is merely caught in another's crash runs alone afterwards and is not
/// dead-lettered for it. "Alone" means alone among the runners that share a
/// [`SuspectGate`]: each runner has its own unless given one with
/// [`with_suspect_gate`](Runner::with_suspect_gate), so a process that runs several runners
/// must give them one gate, or a crash that another runner's delivery causes counts against
/// the suspect running beside it.
///
/// **Headers a producer sets.** The runner's counters travel in headers of its own copies
/// under a [`SEAL_HEADER`](crate::SEAL_HEADER); `x-delivery-count` is read only on a
/// delivery the broker marks redelivered. A first delivery that carries such headers from
/// its producer runs as a first delivery.
///
/// **Reports and drain mode.** Every run returns a [`RunReport`]: processed, duplicates per
/// tier, retries and dead letters per reason, wall time. With
/// [`with_drain`](Runner::with_drain) the run also ends by itself once it is drained: see
/// there for what that means.
pub struct Runner<S> {
    // Behind pointers: every delivery's task holds them, and cloning a route (its key
    // rules) and a topology (its queue names) per delivery cost allocations on the hot path.
    route: Arc<Route<S>>,
    topology: Arc<Topology>,
    prefetch: u16,
    concurrency: usize,
    gate: SuspectGate,
    max_deliveries: u32,
    max_connect_failures: u32,
    shutdown_grace: Duration,
    confirm_timeout: Duration,
    drain_after: Option<Duration>,
}

/// Which of the runner's two consumers a delivery came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    /// The work queue, many deliveries at once.
    Work,
    /// The suspect queue, one delivery at a time.
    Suspect,
}

impl<S> Runner<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    /// A runner of `route` over `topology`'s work queue. Defaults: [`DEFAULT_PREFETCH`],
    /// [`DEFAULT_CONCURRENCY`] deliveries handled at once, [`DEFAULT_MAX_DELIVERIES`], 30 s
    /// for in-flight deliveries at shutdown, a warning after 10 s without a publisher confirm.
    pub fn new(route: Route<S>, topology: Topology) -> Self {
        Runner {
            route: Arc::new(route),
            topology: Arc::new(topology),
            prefetch: DEFAULT_PREFETCH,
            concurrency: DEFAULT_CONCURRENCY,
            gate: SuspectGate::new(),
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            max_connect_failures: DEFAULT_MAX_CONNECT_FAILURES,
            shutdown_grace: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(10),
            drain_after: None,
        }
    }

    /// How many unacked deliveries the broker sends ahead (`basic.qos`; default
    /// [`DEFAULT_PREFETCH`]). What more in flight costs:
    /// - memory: RabbitMQ counts messages, not bytes, so the runner may hold this many
    ///   bodies at once, each up to RabbitMQ's `max_message_size` (the route's maximum body
    ///   is checked once a body has arrived), and a running delivery holds its body twice
    ///   (the AMQP delivery and its envelope): lower it for large bodies;
    /// - RabbitMQ's consumer timeout (30 minutes by default) runs for each unacked delivery
    ///   from the moment it is sent: a consumer that handles fewer than prefetch ÷ 1,800
    ///   messages a second should lower it;
    /// - after a crash, a lost channel or a shutdown grace that ran out, every delivery the
    ///   runner held comes back redelivered and runs alone as a suspect, holding back new
    ///   work while it runs: up to this many, one after another.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many deliveries are handled at once (default [`DEFAULT_CONCURRENCY`]). Each holds
    /// what its tiers took (a flag's claim, a lock's lease, a pooled connection) while it
    /// waits for the ones in front of it: keep a route's leases longer than its slowest tier
    /// takes for this many deliveries. They are also what a batched record
    /// (oncely's `BatchedLayer`, on PostgreSQL or MySQL) batches: the deliveries in flight
    /// together share its transactions, so keep the prefetch and this at or above its maximum
    /// batch. Each is acked only once its stack answered, after its batch's commit.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.clamp(1, Semaphore::MAX_PERMITS);
        self
    }

    /// Shares `gate` with the other runners of this process that are given it: a suspect of
    /// any of them then runs only while no delivery of any of them runs. Give one gate to
    /// every runner of a process whose messages may crash it; while a suspect waits for its
    /// turn, all of them hold back new deliveries.
    pub fn with_suspect_gate(mut self, gate: SuspectGate) -> Self {
        self.gate = gate;
        self
    }

    /// How many times a message may come back unsettled while it runs alone — its consumer
    /// died, lost its channel, or could not publish its copy — before it is dead-lettered
    /// with [`DeadLetterReason::DeliveryLimit`] (default [`DEFAULT_MAX_DELIVERIES`]; values
    /// below 1 are read as 1). A message that kills its process therefore runs at most this
    /// many times alone, after the one run among others that made it a suspect.
    /// Independent of the route's attempts, which count failures the stack answered. Keep it
    /// below 20: RabbitMQ 4.x dead-letters a message itself (without oncely's reason) once a
    /// queue delivered it 20 times.
    pub fn with_max_deliveries(mut self, max_deliveries: u32) -> Self {
        self.max_deliveries = max_deliveries.max(1);
        self
    }

    /// How long a publisher confirm of a retry or dead-letter copy may take before the
    /// runner warns (default 10 s). The runner keeps waiting for that confirm about 15 s
    /// more (a second copy would be a duplicate in the queue if the first was stored); then
    /// it returns the delivery to its queue unsettled.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How many times in a row [`run_with_reconnect`](Runner::run_with_reconnect) may fail
    /// to get to consuming before it returns the last failure (default
    /// [`DEFAULT_MAX_CONNECT_FAILURES`]; values below 1 are read as 1).
    pub fn with_max_connect_failures(mut self, failures: u32) -> Self {
        self.max_connect_failures = failures.max(1);
        self
    }

    /// How long shutdown waits for in-flight deliveries before abandoning them unacked (the
    /// broker redelivers them, counted as returns). Deliveries the broker had sent ahead and
    /// that never started are handed back at once: a copy to the work queue, then an ack, so
    /// a deploy does not count against them. Keep it above the time the stack takes for
    /// [`concurrency`](Runner::with_concurrency) deliveries: each one abandoned comes back
    /// as a suspect that runs alone (see [`Runner`]).
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Drain mode: the run ends by itself, like a shutdown, once it has been idle for
    /// `idle` — nothing in flight in this runner, no delivery arrived, and no message ready
    /// in the work queue, the suspect queue or any retry queue (a retry waiting out its
    /// delay counts as not drained), seen at two checks in a row. The report then says
    /// `drained`. For batch jobs, tests and examples that must know when a backlog is done.
    ///
    /// Limits: it sees this runner's deliveries and the queues' ready messages. Deliveries
    /// another consumer holds unacknowledged are invisible to it, and so are the deliveries
    /// of a connection this runner lost until the broker notices the loss (heartbeat
    /// timeout): should they come back after the run ended, they wait in the queue for the
    /// next run. The check declares the queues passively on the runner's channel: a queue of
    /// the topology deleted under it closes the channel (the runner then reconnects and
    /// declares it again).
    pub fn with_drain(mut self, idle: Duration) -> Self {
        self.drain_after = Some(idle);
        self
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Consumes on `channel` until `shutdown` is cancelled, the run is drained (drain mode)
    /// or the channel fails, and returns the run's report.
    ///
    /// Shutdown is graceful: consuming stops, in-flight deliveries get the shutdown grace to
    /// finish and be settled, and the ones still running after it are abandoned unacked.
    /// Returns the channel's error if it failed.
    pub async fn run(&self, channel: &Channel, shutdown: &CancellationToken) -> Result<RunReport, Error> {
        let tally = Tally::new();
        self.run_tallied(channel, Ownership::Shared, shutdown, &tally)
            .await?;
        Ok(tally.report())
    }

    async fn run_tallied(
        &self,
        channel: &Channel,
        ownership: Ownership,
        shutdown: &CancellationToken,
        tally: &Tally,
    ) -> Result<(), Error> {
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let consumer = consume(channel, self.topology.queue()).await?;
        self.consume_tallied(channel, ownership, consumer, shutdown, tally)
            .await
    }

    /// Like [`run`](Runner::run), on a consumer you started yourself on `channel` (with your
    /// own `basic.qos`, consumer tag and arguments). It must consume the topology's work queue
    /// without `no_ack`; the runner settles every delivery. The runner also takes suspects
    /// from the suspect queue on `channel`, one at a time (`basic.get`).
    pub async fn run_consumer(
        &self,
        channel: &Channel,
        consumer: Consumer,
        shutdown: &CancellationToken,
    ) -> Result<RunReport, Error> {
        let tally = Tally::new();
        self.consume_tallied(channel, Ownership::Shared, consumer, shutdown, &tally)
            .await?;
        Ok(tally.report())
    }

    async fn consume_tallied(
        &self,
        channel: &Channel,
        ownership: Ownership,
        consumer: Consumer,
        shutdown: &CancellationToken,
        tally: &Tally,
    ) -> Result<(), Error> {
        // Retry and dead-letter copies are published on this channel and must be confirmed
        // before the original is acked.
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        // Every delivery's task holds the channel: one pointer to clone rather than a lapin
        // channel's many.
        let channel = &Arc::new(channel.clone());
        // When one lane ends (shutdown, a failed channel), the other stops too.
        let stop = shutdown.child_token();
        // How many of this run's deliveries run at once; a suspect runs alone behind the gate.
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let acks = &Arc::new(Acks::new(ownership == Ownership::Owned, self.prefetch));
        let lanes = Lanes {
            channel,
            acks,
            permits: &permits,
            stop: &stop,
            tally,
        };
        let (work, suspect, ()) = tokio::join!(
            self.work_lane(&lanes, consumer),
            self.suspect_lane(&lanes),
            self.stop_when_drained(channel, &stop, tally),
        );
        work.and(suspect)
    }

    /// In drain mode, cancels `stop` once the run is drained; returns when `stop` is
    /// cancelled.
    async fn stop_when_drained(&self, channel: &Channel, stop: &CancellationToken, tally: &Tally) {
        let Some(idle) = self.drain_after else {
            return stop.cancelled().await;
        };
        let topology_empty = || async {
            self.topology
                .ready_messages(channel)
                .await
                .is_ok_and(|ready| ready == 0)
        };
        if stop
            .run_until_cancelled(tally.wait_until_drained(idle, topology_empty))
            .await
            .is_some()
        {
            stop.cancel();
        }
    }

    /// Settles the work queue's deliveries until `stop` is cancelled or the consumer ends,
    /// hands back the ones received but not started, then drains what is in flight within
    /// the shutdown grace.
    async fn work_lane(&self, lanes: &Lanes<'_>, mut consumer: Consumer) -> Result<(), Error> {
        let Lanes {
            channel,
            acks,
            permits,
            stop,
            tally,
        } = *lanes;
        let _stop_the_other_lane = stop.clone().drop_guard();
        let tag = consumer.tag();
        let mut in_flight = JoinSet::new();
        // A delivery taken from the consumer that has not started: handed back at shutdown.
        let mut not_started = None;
        let ended = loop {
            let next = tokio::select! {
                () = stop.cancelled() => break Ok(()),
                next = consumer.next() => next,
            };
            let delivery = match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(error)) => break Err(Error::from(error)),
                None => break Ok(()),
            };
            acks.taken(&delivery);
            let in_flight_here = tally.arrived();
            // A returned delivery only moves to the suspect queue: it needs no turn, so that
            // it is not held (and caught in a suspect's crash) while it waits for one.
            let turn = match self.suspicious(&delivery) {
                true => None,
                false => match stop.run_until_cancelled(self.take_turn(permits)).await {
                    Some(turn) => Some(turn),
                    None => {
                        not_started = Some(delivery);
                        break Ok(());
                    }
                },
            };
            let settle = self.settle_one(lanes, delivery, Lane::Work);
            in_flight.spawn(async move {
                settle.await;
                drop((turn, in_flight_here));
            });
            while in_flight.try_join_next().is_some() {}
        };
        let cancelled = channel
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
            .await;
        if ended.is_ok() && cancelled.is_ok() {
            // Cancelled, the consumer yields what the broker had sent ahead, then ends.
            let mut sent_ahead: Vec<AmqpDelivery> = not_started.into_iter().collect();
            while let Ok(Some(Ok(delivery))) =
                tokio::time::timeout(self.confirm_timeout, consumer.next()).await
            {
                acks.taken(&delivery);
                sent_ahead.push(delivery);
            }
            self.hand_back(channel, acks, sent_ahead).await;
        }
        self.finish_in_flight(in_flight, tally).await;
        ended
    }

    /// Waits up to the shutdown grace for `in_flight`, then abandons what still runs.
    async fn finish_in_flight(&self, mut in_flight: JoinSet<()>, tally: &Tally) {
        let drained = tokio::time::timeout(self.shutdown_grace, async {
            while in_flight.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                abandoned = in_flight.len(),
                "shutdown grace ran out; abandoning deliveries unacked for redelivery"
            );
            tally.abandoned(in_flight.len());
            in_flight.shutdown().await;
        }
    }

    /// Returns deliveries that never started without a return counted against them: a copy
    /// with the same counters, then an ack — to the work queue, or to the suspect queue for
    /// one that came back unsettled. Takes at most the confirm timeout in all: what is not
    /// handed back by then stays unacked, and the broker redelivers it when the channel
    /// closes.
    async fn hand_back(&self, channel: &Channel, acks: &Acks, deliveries: Vec<AmqpDelivery>) {
        let mut handed_back = 0;
        let all = async {
            for delivery in &deliveries {
                let settle = self.settle(channel, acks, delivery);
                let counters = Counters::of(delivery, self.topology.queue());
                let (queue, counters) = match self.suspicious(delivery) {
                    true => (self.topology.suspect_queue(), suspect_counters(counters)),
                    false => (self.topology.queue(), counters),
                };
                match settle.forward(queue, settle.sealed_copy(counters)).await {
                    Ok(()) => handed_back += 1,
                    Err(error) => tracing::warn!(%error, "could not hand back a delivery that never started"),
                }
            }
        };
        let _ = tokio::time::timeout(self.confirm_timeout, all).await;
        if !deliveries.is_empty() {
            tracing::info!(
                handed_back,
                of = deliveries.len(),
                "handed back the deliveries received but not started"
            );
        }
    }

    /// Takes suspects one at a time, each only once nothing else runs behind the gate, until
    /// `stop` is cancelled; the one running then gets the shutdown grace.
    async fn suspect_lane(&self, lanes: &Lanes<'_>) -> Result<(), Error> {
        let Lanes {
            channel, acks, stop, ..
        } = *lanes;
        let _stop_the_other_lane = stop.clone().drop_guard();
        let queue = self.topology.suspect_queue();
        loop {
            // Looking holds nothing back; taking one waits until nothing runs.
            let Some(ready) = stop.run_until_cancelled(ready_in(channel, queue)).await else {
                return Ok(());
            };
            if ready? > 0 {
                let alone = self.gate.0.clone().write_owned();
                let Some(alone) = stop.run_until_cancelled(alone).await else {
                    return Ok(());
                };
                // Nothing else runs behind the gate from here on: a crash is this message's.
                let get = BasicGetOptions { no_ack: false };
                if let Some(suspect) = channel.basic_get(queue.into(), get).await? {
                    acks.taken(&suspect.delivery);
                    self.run_suspect(lanes, suspect.delivery).await;
                    drop(alone);
                    continue;
                }
                // Another consumer took it first: look again after the pause.
            }
            let pause = tokio::time::sleep(SUSPECT_POLL);
            if stop.run_until_cancelled(pause).await.is_none() {
                return Ok(());
            }
        }
    }

    /// Runs one suspect to its settlement; after a shutdown, within the grace.
    async fn run_suspect(&self, lanes: &Lanes<'_>, suspect: AmqpDelivery) {
        let Lanes { stop, tally, .. } = *lanes;
        let in_flight_here = tally.arrived();
        let settle = self.settle_one(lanes, suspect, Lane::Suspect);
        let grace_after_stop = async {
            stop.cancelled().await;
            tokio::time::sleep(self.shutdown_grace).await;
        };
        tokio::select! {
            () = settle => {}
            () = grace_after_stop => {
                tracing::warn!("shutdown grace ran out; abandoning the suspect unacked for redelivery");
                tally.abandoned(1);
            }
        }
        drop(in_flight_here);
    }

    /// A turn for one delivery of the work lane: one of the run's permits, and a share of
    /// the gate that keeps suspects out while it runs.
    async fn take_turn(&self, permits: &Arc<Semaphore>) -> (OwnedSemaphorePermit, OwnedRwLockReadGuard<()>) {
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        (permit, self.gate.0.clone().read_owned().await)
    }

    /// True when `delivery` goes to the suspect queue rather than run among others: it came
    /// back unsettled to the work queue, or it was a suspect before.
    fn suspicious(&self, delivery: &AmqpDelivery) -> bool {
        returned_here(delivery) > 0 || Counters::of(delivery, self.topology.queue()).returns.is_some()
    }

    fn settle<'a>(&'a self, channel: &'a Channel, acks: &'a Acks, delivery: &'a AmqpDelivery) -> Settle<'a> {
        Settle {
            channel,
            acks,
            delivery,
            topology: &self.topology,
            route: self.route.name(),
            confirm_timeout: self.confirm_timeout,
        }
    }

    /// Runs on connections from `connect` until `shutdown` is cancelled: declares the
    /// topology, consumes, and when the connection or channel is lost, connects again with
    /// exponential backoff (100 ms doubling to 10 s, back to 100 ms once consuming again).
    /// Deliveries left unacked by a lost channel come back from the broker, and the stack
    /// answers for what was already done.
    ///
    /// Returns the report of the whole run (all its connections) at shutdown, or once
    /// drained in drain mode ([`with_drain`](Runner::with_drain)). Returns the error when retrying cannot fix it — the broker
    /// refused the credentials, the virtual host or a declaration (a queue that exists with
    /// other arguments, say) — or when [`with_max_connect_failures`](Runner::with_max_connect_failures)
    /// attempts in a row failed before consuming ([`Error::ConnectGaveUp`]): a wrong address
    /// is a visible failure, not a silent hang. Each failure is also logged through
    /// `tracing` (target `oncely_amqp`), which shows only with a subscriber installed.
    pub async fn run_with_reconnect<F, Fut>(
        &self,
        mut connect: F,
        shutdown: &CancellationToken,
    ) -> Result<RunReport, Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Connection, lapin::Error>>,
    {
        let tally = Tally::new();
        let mut backoff = Duration::from_millis(100);
        let mut failures = 0;
        while !shutdown.is_cancelled() {
            let mut consumed = false;
            match self
                .connect_and_run(&mut connect, shutdown, &tally, &mut consumed)
                .await
            {
                Ok(()) if shutdown.is_cancelled() || tally.is_drained() => return Ok(tally.report()),
                Ok(()) => tracing::warn!("consumer ended by the broker; reconnecting"),
                // Only before consuming: once consuming, a channel the broker closed (an ack
                // past its consumer timeout is PRECONDITION_FAILED too) is worth reconnecting.
                Err(error) if !consumed && !error.is_retryable() => return Err(error),
                Err(error) if !consumed && failures + 1 >= self.max_connect_failures => {
                    return Err(Error::ConnectGaveUp {
                        attempts: failures + 1,
                        last: Box::new(error),
                    });
                }
                Err(error) => tracing::warn!(%error, ?backoff, "AMQP connection lost; reconnecting"),
            }
            (failures, backoff) = if consumed {
                (0, Duration::from_millis(100))
            } else {
                (failures + 1, (backoff * 2).min(Duration::from_secs(10)))
            };
            if shutdown
                .run_until_cancelled(tokio::time::sleep(backoff))
                .await
                .is_none()
            {
                break;
            }
        }
        Ok(tally.report())
    }

    /// One connection: connect, open a channel, declare the topology, then consume until
    /// shutdown or a failure; `consumed` tells whether it got as far as consuming.
    async fn connect_and_run<F, Fut>(
        &self,
        connect: &mut F,
        shutdown: &CancellationToken,
        tally: &Tally,
        consumed: &mut bool,
    ) -> Result<(), Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Connection, lapin::Error>>,
    {
        let connection = connect().await?;
        let channel = connection.create_channel().await?;
        self.topology.declare(&channel).await?;
        *consumed = true;
        let ran = self
            .run_tallied(&channel, Ownership::Owned, shutdown, tally)
            .await;
        let _ = connection.close(200, "oncely runner stopped".into()).await;
        ran
    }

    /// Handles one delivery and settles it; never fails: a failed settlement is a
    /// `basic.reject` back to the queue after [`SETTLE_RETRY_DELAY`], or, with the channel
    /// gone, a redelivery by the broker.
    fn settle_one(&self, lanes: &Lanes<'_>, delivery: AmqpDelivery, lane: Lane) -> BoxFuture<()> {
        let (channel, acks, tally) = (lanes.channel.clone(), lanes.acks.clone(), lanes.tally.clone());
        let route = self.route.clone();
        let topology = self.topology.clone();
        let max_deliveries = self.max_deliveries;
        let confirm_timeout = self.confirm_timeout;
        let suspicious = lane == Lane::Work && self.suspicious(&delivery);
        // Boxed where it is made: the state machine holds the stack's call and the
        // settlement's publish and timers, all of which moving it by value into its task
        // would copy again at every step of the spawn.
        Box::pin(async move {
            let settle = Settle {
                channel: &channel,
                acks: &acks,
                delivery: &delivery,
                topology: &topology,
                route: route.name(),
                confirm_timeout,
            };
            let counters = Counters::of(&delivery, topology.queue());
            let decision = match lane {
                Lane::Work if suspicious => Decision::ToSuspects(suspect_counters(counters)),
                Lane::Work => Decision::Answer {
                    outcome: route.handle(to_delivery(&delivery, topology.queue())).await,
                    counters,
                },
                Lane::Suspect => {
                    // Crashes while it ran alone: in earlier queues, and in this one.
                    let returns = counters
                        .returns
                        .unwrap_or(0)
                        .saturating_add(returned_here(&delivery));
                    let counters = Counters {
                        returns: Some(returns),
                        ..counters
                    };
                    let outcome = match returns >= max_deliveries {
                        true => Outcome::DeadLetter(DeadLetter {
                            reason: DeadLetterReason::DeliveryLimit,
                            detail: format!(
                                "came back {returns} times without being settled while it ran alone: its \
                                 consumer died or lost its channel, or the broker refused its copy, each time"
                            ),
                        }),
                        false => route.handle(to_delivery(&delivery, topology.queue())).await,
                    };
                    Decision::Answer { outcome, counters }
                }
            };
            if !settle.apply_until_settled(&decision).await {
                tally.unsettled();
                return;
            }
            match decision {
                Decision::ToSuspects(_) => tally.retried("returned_unsettled"),
                Decision::Answer { outcome, .. } => tally.settled(&outcome),
            }
        })
    }
}

/// Where suspects wait until they can run alone: a delivery runs holding a share of the
/// gate, a suspect holds it whole. Cheap to clone; clones are one gate. See
/// [`Runner::with_suspect_gate`].
///
/// Fair: once a suspect waits, new deliveries wait behind it, so a suspect waits at most for
/// the deliveries already running — and all of them hold back new work meanwhile; a handler
/// that never returns holds the suspect (and so the gate's runners) until it does.
#[derive(Clone, Debug, Default)]
pub struct SuspectGate(Arc<RwLock<()>>);

impl SuspectGate {
    /// A gate of its own, for the runners it is given to.
    pub fn new() -> Self {
        SuspectGate::default()
    }
}

/// What the lanes of one run share.
#[derive(Clone, Copy)]
struct Lanes<'a> {
    channel: &'a Arc<Channel>,
    /// The channel's acks, batched when the runner opened the channel.
    acks: &'a Arc<Acks>,
    /// How many of the run's deliveries run at once.
    permits: &'a Arc<Semaphore>,
    /// Ends both lanes: cancelled by the run's shutdown, by a lane that ended, or by drain.
    stop: &'a CancellationToken,
    tally: &'a Tally,
}

/// How a delivery is to be settled.
enum Decision {
    /// Moved to the suspect queue with these counters: it came back unsettled, or was a
    /// suspect before.
    ToSuspects(Counters),
    /// Settled by the action of the stack's outcome (or the delivery limit's); its copies
    /// start from `counters`.
    Answer { outcome: Outcome, counters: Counters },
}

/// The pauses before settling again in place when the broker did not confirm a copy (a
/// memory alarm, a busy broker): about 15 s in all, holding the delivery and without running
/// the stack again, before it goes back to the queue and counts as an unsettled delivery.
const SETTLE_BACKOFF: [Duration; 4] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
];

/// True when settling again on the same channel may pass: the broker refused the copy (a
/// memory alarm). Not after a confirm that never came: the copy may be stored, and a second
/// one would be a duplicate in its queue.
fn worth_settling_again(error: &Error) -> bool {
    match error {
        Error::Nacked => true,
        // The channel is gone (the broker redelivers), the copy has no queue, or it may be
        // stored already.
        Error::ConfirmTimeout(_)
        | Error::Amqp(_)
        | Error::Unroutable { .. }
        | Error::PublishGaveUp { .. }
        | Error::ConnectGaveUp { .. }
        | Error::QueueMismatch { .. } => false,
    }
}

/// Starts a consumer of `queue` on `channel` under a fresh tag.
async fn consume(channel: &Channel, queue: &str) -> Result<Consumer, Error> {
    let tag = format!("oncely-{}", oncely::Token::random());
    Ok(channel
        .basic_consume(
            queue.into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?)
}

/// The counters of a message moving to the suspect queue: its returns so far, now counted.
fn suspect_counters(counters: Counters) -> Counters {
    Counters {
        returns: Some(counters.returns.unwrap_or(0)),
        ..counters
    }
}

/// How many times the broker returned `delivery` to the queue it came from, unsettled. Read
/// only on a delivery the broker marks redelivered: on a first delivery the header is the
/// producer's. A redelivered message without a count (a classic queue counts nothing; a
/// quorum queue on RabbitMQ 4.3 does not count a nack) is taken as returned once: it came
/// back unsettled at least that often.
fn returned_here(delivery: &AmqpDelivery) -> u32 {
    if !delivery.redelivered {
        return 0;
    }
    let count = delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(DELIVERY_COUNT_HEADER).and_then(integer_of));
    count.map_or(1, |count| u32::try_from(count.max(1)).unwrap_or(u32::MAX))
}

/// How many messages are ready in `queue`, by a passive declaration.
async fn ready_in(channel: &Channel, queue: &str) -> Result<u32, Error> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?;
    Ok(declared.message_count())
}

/// Whether the runner opened the channel it consumes on: only then may its acks be batched
/// (a `multiple` ack settles every delivery of the channel up to its tag, another
/// consumer's too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ownership {
    /// Opened by the runner for this run.
    Owned,
    /// The caller's channel.
    Shared,
}

/// One delivery's settlement with the broker.
struct Settle<'a> {
    channel: &'a Channel,
    acks: &'a Acks,
    delivery: &'a AmqpDelivery,
    topology: &'a Topology,
    /// The route's name, for the dead-letter metadata.
    route: &'a str,
    confirm_timeout: Duration,
}

impl Settle<'_> {
    /// Settles by `decision`, again in place while the broker only failed to confirm, and
    /// returns the delivery to its queue after [`SETTLE_RETRY_DELAY`] if it still cannot
    /// (false).
    async fn apply_until_settled(&self, decision: &Decision) -> bool {
        let mut settled = self.apply(decision).await;
        for pause in SETTLE_BACKOFF {
            match &settled {
                Err(error) if worth_settling_again(error) => {
                    tracing::warn!(%error, ?pause, "could not settle the delivery; trying again");
                    tokio::time::sleep(pause).await;
                    settled = self.apply(decision).await;
                }
                _ => break,
            }
        }
        if let Err(error) = settled {
            tracing::warn!(%error, "could not settle the delivery; returning it to the queue");
            tokio::time::sleep(SETTLE_RETRY_DELAY).await;
            // Reject, not nack: from RabbitMQ 4.3 on, a nack's return no longer counts in
            // `x-delivery-count`, and the limit that ends this loop would never be reached.
            let rejected = self
                .delivery
                .acker
                .reject(BasicRejectOptions { requeue: true })
                .await;
            if rejected.is_ok() {
                self.acks.settled_otherwise(self.delivery);
            }
            return false;
        }
        true
    }

    async fn apply(&self, decision: &Decision) -> Result<(), Error> {
        match decision {
            Decision::ToSuspects(counters) => {
                self.forward(self.topology.suspect_queue(), self.sealed_copy(*counters))
                    .await
            }
            Decision::Answer { outcome, counters } => {
                // A wait for another holder is not a failure: it keeps its attempt number.
                let wait = outcome.retry_reason().is_some_and(RetryReason::is_wait);
                self.action(&outcome.action(), wait, *counters).await
            }
        }
    }

    /// Acks, or forwards a copy for a retry or a dead letter and then acks.
    async fn action(&self, action: &BrokerAction, wait: bool, counters: Counters) -> Result<(), Error> {
        let attempt = counters.attempt;
        match action {
            BrokerAction::Ack => {
                self.acks.ack(self.channel, self.delivery).await?;
                Ok(())
            }
            BrokerAction::Retry { delay } => {
                let next = Counters {
                    attempt: if wait { attempt } else { attempt.saturating_add(1) },
                    ..counters
                };
                let queue = self.topology.retry_queue_for(*delay, attempt);
                self.forward(queue, self.sealed_copy(next)).await
            }
            BrokerAction::DeadLetter(dead) => {
                // Unsealed and without the runner's counter: replayed from the dead-letter
                // queue, it starts afresh. The attempt it reached is `x-oncely-attempts`.
                let mut headers = copy_headers(self.delivery, self.topology.queue());
                // Without the broker's dead-lettering marks (from the retry queues' hops): a
                // letter that carries them was dead-lettered by the broker, not by oncely,
                // which is how `oncely dlq` tells a forged letter from oncely's own.
                let inner = headers.inner().clone();
                let broker_marks = inner.keys().filter(|name| is_broker_death(name.as_str()));
                let broker_marks: Vec<_> = broker_marks.cloned().collect();
                let mut inner = inner;
                for name in broker_marks {
                    inner.remove(&name);
                }
                headers = FieldTable::from(inner);
                let message_id = self.delivery.properties.message_id().as_ref();
                let context = dead_letter::Context {
                    route: self.route,
                    attempts: attempt,
                    source: self.topology.queue(),
                    message_id: message_id.map(|id| id.as_str()),
                };
                for (name, value) in dead.metadata(&context) {
                    headers.insert(name.into(), AMQPValue::LongString(value.into()));
                }
                self.forward(self.topology.dead_letter_queue(), headers).await
            }
        }
    }

    /// The headers of a copy that comes back to the runner, with `counters` sealed.
    fn sealed_copy(&self, counters: Counters) -> FieldTable {
        let mut headers = copy_headers(self.delivery, self.topology.queue());
        counters.write_sealed(&mut headers, self.topology.queue(), &self.delivery.data);
        headers
    }

    /// Publishes a copy of the delivery to `queue` with `headers`, waits for the broker's
    /// confirm — patiently: a confirm that is late is waited for, not answered with a second
    /// copy — then acks the original.
    async fn forward(&self, queue: &str, headers: FieldTable) -> Result<(), Error> {
        let properties = self
            .delivery
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(2);
        let patience = self.confirm_timeout + SETTLE_BACKOFF.iter().sum::<Duration>();
        let confirm = publish(self.channel, "", queue, &self.delivery.data, properties).await?;
        let mut confirm = std::pin::pin!(confirm);
        let deadline = std::time::Instant::now() + patience;
        let confirmation = loop {
            let slice = self
                .confirm_timeout
                .min(deadline.saturating_duration_since(std::time::Instant::now()));
            match tokio::time::timeout(slice, &mut confirm).await {
                Ok(confirmation) => break confirmation,
                Err(_) if std::time::Instant::now() < deadline => {
                    tracing::warn!(queue, "the broker is slow to confirm a copy; waiting for it");
                }
                Err(_) => return Err(Error::ConfirmTimeout(patience)),
            }
        };
        confirmed(confirmation, "", queue)?;
        self.acks.ack(self.channel, self.delivery).await?;
        Ok(())
    }
}

/// The delivery's headers for a copy: its own, less the broker's count, the runner's
/// counters (set again by the caller) and any dead-letter metadata (a producer's: oncely's
/// own is written on the dead-letter copy by the caller), with the original exchange and
/// routing key — kept from an earlier copy of the runner's own (sealed for work queue
/// `queue`), else the delivery's: a producer's values of those are not trusted either.
fn copy_headers(delivery: &AmqpDelivery, queue: &str) -> FieldTable {
    let mut headers = delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default()
        .inner()
        .clone();
    // The broker's count belongs to the delivery, not the copy (a new message to the broker);
    // the runner's counters are the caller's to set, sealed or not.
    let ours = Counters::sealed(delivery, queue).is_some();
    for name in [
        DELIVERY_COUNT_HEADER,
        RETURNS_HEADER,
        SEAL_HEADER,
        crate::ATTEMPT_HEADER,
    ]
    .into_iter()
    .chain(oncely::dead_letter::SCHEMA)
    {
        headers.remove(name);
    }
    let mut headers = FieldTable::from(headers);
    if !ours || !headers.contains_key(ORIGINAL_EXCHANGE_HEADER) {
        headers.insert(
            ORIGINAL_EXCHANGE_HEADER.into(),
            AMQPValue::LongString(delivery.exchange.as_str().into()),
        );
        headers.insert(
            ORIGINAL_ROUTING_KEY_HEADER.into(),
            AMQPValue::LongString(delivery.routing_key.as_str().into()),
        );
    }
    headers
}

/// True for a header RabbitMQ writes when it dead-letters a message itself (`x-death`,
/// `x-first-death-*`, `x-last-death-*`).
pub fn is_broker_death(name: &str) -> bool {
    name == "x-death" || name.starts_with("x-first-death-") || name.starts_with("x-last-death-")
}

/// Publishes as mandatory and waits for the broker's confirm (the channel must be in
/// confirm mode). A message no queue takes is returned by the broker and reported as
/// [`Error::Unroutable`] — without `mandatory` the broker would confirm and drop it.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: lapin::BasicProperties,
    confirm_timeout: Duration,
) -> Result<(), Error> {
    let confirm = publish(channel, exchange, routing_key, body, properties).await?;
    match tokio::time::timeout(confirm_timeout, confirm).await {
        Err(_) => Err(Error::ConfirmTimeout(confirm_timeout)),
        Ok(confirmation) => confirmed(confirmation, exchange, routing_key),
    }
}

/// Publishes as mandatory; the returned confirm is the broker's answer.
async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: lapin::BasicProperties,
) -> Result<lapin::PublisherConfirm, Error> {
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    Ok(channel
        .basic_publish(exchange.into(), routing_key.into(), mandatory, body, properties)
        .await?)
}

/// What a publisher confirm says: stored, refused, or returned unroutable.
fn confirmed(
    confirmation: lapin::Result<Confirmation>,
    exchange: &str,
    routing_key: &str,
) -> Result<(), Error> {
    match confirmation? {
        Confirmation::Nack(_) => Err(Error::Nacked),
        Confirmation::Ack(Some(_)) => Err(Error::Unroutable {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        }),
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
    }
}
