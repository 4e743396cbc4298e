//! Consumes a queue through a route and settles every delivery with the broker.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::Confirmation;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};
use oncely::report::{RunReport, Tally};
use oncely::{
    BoxError, BrokerAction, DeadLetter, DeadLetterReason, Envelope, Outcome, RetryReason, Route, dead_letter,
};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use crate::convert::{ATTEMPT_HEADER, integer_of, to_delivery};
use crate::error::Error;
use crate::topology::Topology;

/// Header on every copy (retry, suspect, dead letter), beside the dead-letter schema of
/// [`oncely::dead_letter`]: the exchange the message was first published to. AMQP only.
pub const ORIGINAL_EXCHANGE_HEADER: &str = "x-oncely-original-exchange";
/// Header on every copy (retry, suspect, dead letter), beside the dead-letter schema of
/// [`oncely::dead_letter`]: the routing key the message was first published with. AMQP only.
pub const ORIGINAL_ROUTING_KEY_HEADER: &str = "x-oncely-original-routing-key";

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

/// The header quorum queues put on a message they deliver again: how many times it came
/// back unsettled to this queue.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Header on the runner's copies (retry, suspect, dead letter): how many times the message
/// came back unsettled before, in any of the topology's queues. The broker's own count
/// starts again with every copy; this one carries it across retry hops, so a message that
/// crashes its consumer only after waiting (for a flag or lock its crash left behind)
/// still reaches the limit.
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
/// letter, only after the broker confirmed the copy. A copy the broker did not confirm (a
/// memory alarm) is published again in place for about 15 s, without running the stack
/// again; if it still fails, or no queue takes it, the delivery goes back to its queue after
/// [`SETTLE_RETRY_DELAY`], which counts as an unsettled delivery (below). So a message is
/// never lost between the two, and a broker that refuses copies gets no hot loop.
///
/// **Crashes and panics.** A panic in the stack is an outcome like any other failure
/// ([`Route::handle`]). A consumer process that dies (OOM, abort, SIGKILL, a fault in a C
/// library) leaves its deliveries unacked, and the broker delivers them again with
/// `x-delivery-count`. Such a delivery — and every later copy of it, which carries the count
/// in [`RETURNS_HEADER`] — is not run among the others: it is moved to the topology's
/// suspect queue, which the runner consumes one message at a time (prefetch 1), and a
/// suspect runs alone in the process (it waits for the deliveries in flight and holds back
/// new ones). So a crash while a suspect runs is counted against that message, not against
/// the ones that happened to be in flight beside it; a message that is merely caught in
/// another's crash comes back once and then runs alone. A message that came back unsettled
/// [`max_deliveries`](Runner::with_max_deliveries) times — crashes, lost channels, or copies
/// the broker kept refusing — is dead-lettered with [`DeadLetterReason::DeliveryLimit`]
/// without running again.
///
/// **Reports and drain mode.** Every run returns a [`RunReport`]: processed, duplicates per
/// tier, retries and dead letters per reason, wall time. With
/// [`with_drain`](Runner::with_drain) the run also ends by itself once it is drained: see
/// there for what that means.
pub struct Runner<S> {
    route: Route<S>,
    topology: Topology,
    prefetch: u16,
    concurrency: usize,
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
    /// A runner of `route` over `topology`'s work queue. Defaults: prefetch 64, 64 deliveries
    /// handled at once, [`DEFAULT_MAX_DELIVERIES`], 30 s for in-flight deliveries at
    /// shutdown, 10 s per publisher confirm.
    pub fn new(route: Route<S>, topology: Topology) -> Self {
        Runner {
            route,
            topology,
            prefetch: 64,
            concurrency: 64,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            max_connect_failures: DEFAULT_MAX_CONNECT_FAILURES,
            shutdown_grace: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(10),
            drain_after: None,
        }
    }

    /// How many unacked deliveries the broker sends ahead (`basic.qos`).
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many deliveries are handled at once. They are also what a batched record
    /// (oncely's `PgBatchedLayer`) batches: the deliveries in flight together share its
    /// transactions, so keep the prefetch and this at or above its maximum batch. Each is
    /// acked only once its stack answered, after its batch's commit.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// How many times a message may come back unsettled — its consumer died, lost its
    /// channel, or could not publish its retry copy — before it is dead-lettered with
    /// [`DeadLetterReason::DeliveryLimit`] (default [`DEFAULT_MAX_DELIVERIES`]; values below
    /// 1 are read as 1). A message that kills its process therefore runs at most this many
    /// times. Independent of the route's attempts, which count failures the stack answered.
    pub fn with_max_deliveries(mut self, max_deliveries: u32) -> Self {
        self.max_deliveries = max_deliveries.max(1);
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
    /// broker redelivers them).
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
        self.run_tallied(channel, shutdown, &tally).await?;
        Ok(tally.report())
    }

    async fn run_tallied(
        &self,
        channel: &Channel,
        shutdown: &CancellationToken,
        tally: &Tally,
    ) -> Result<(), Error> {
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let consumer = consume(channel, self.topology.queue()).await?;
        self.consume_tallied(channel, consumer, shutdown, tally).await
    }

    /// Like [`run`](Runner::run), on a consumer you started yourself on `channel` (with your
    /// own `basic.qos`, consumer tag and arguments). It must consume the topology's work queue
    /// without `no_ack`; the runner settles every delivery. The runner adds its own consumer
    /// of the suspect queue on `channel`, with prefetch 1.
    pub async fn run_consumer(
        &self,
        channel: &Channel,
        consumer: Consumer,
        shutdown: &CancellationToken,
    ) -> Result<RunReport, Error> {
        let tally = Tally::new();
        self.consume_tallied(channel, consumer, shutdown, &tally).await?;
        Ok(tally.report())
    }

    async fn consume_tallied(
        &self,
        channel: &Channel,
        consumer: Consumer,
        shutdown: &CancellationToken,
        tally: &Tally,
    ) -> Result<(), Error> {
        // Retry and dead-letter copies are published on this channel and must be confirmed
        // before the original is acked.
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        // Prefetch applies per consumer to the consumers started after it.
        channel.basic_qos(1, BasicQosOptions::default()).await?;
        let suspects = consume(channel, self.topology.suspect_queue()).await?;
        // When one lane ends (shutdown, a failed channel), the other stops too.
        let stop = shutdown.child_token();
        // One pool of permits for both lanes: a suspect takes them all, so it runs alone and
        // a crash while it runs is its own.
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let lanes = Lanes {
            channel,
            permits: &permits,
            stop: &stop,
            tally,
        };
        let (work, suspect, ()) = tokio::join!(
            self.consume_lane(&lanes, consumer, Lane::Work),
            self.consume_lane(&lanes, suspects, Lane::Suspect),
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

    /// Settles the deliveries of one lane until `stop` is cancelled or the consumer ends,
    /// then drains what is in flight within the shutdown grace.
    async fn consume_lane(&self, lanes: &Lanes<'_>, mut consumer: Consumer, lane: Lane) -> Result<(), Error> {
        let Lanes {
            channel,
            permits,
            stop,
            tally,
        } = *lanes;
        let _stop_the_other_lane = stop.clone().drop_guard();
        let tag = consumer.tag();
        let permits_per_delivery = match lane {
            Lane::Work => 1,
            Lane::Suspect => u32::try_from(self.concurrency).unwrap_or(u32::MAX),
        };
        let mut in_flight = JoinSet::new();
        let ended = loop {
            let next = tokio::select! {
                () = stop.cancelled() => break Ok(()),
                next = consumer.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    let in_flight_here = tally.arrived();
                    let permit = permits
                        .clone()
                        .acquire_many_owned(permits_per_delivery)
                        .await
                        .expect("the semaphore is never closed");
                    let settle = self.settle_one(channel.clone(), delivery, lane, tally.clone());
                    in_flight.spawn(async move {
                        settle.await;
                        drop((permit, in_flight_here));
                    });
                    while in_flight.try_join_next().is_some() {}
                }
                Some(Err(error)) => break Err(Error::from(error)),
                None => break Ok(()),
            }
        };
        let _ = channel
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
            .await;
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
        ended
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
        let ran = self.run_tallied(&channel, shutdown, tally).await;
        let _ = connection.close(200, "oncely runner stopped".into()).await;
        ran
    }

    /// Handles one delivery and settles it; never fails: a failed settlement is a `nack`
    /// back to the queue after [`SETTLE_RETRY_DELAY`], or, with the channel gone, a
    /// redelivery by the broker.
    fn settle_one(
        &self,
        channel: Channel,
        delivery: AmqpDelivery,
        lane: Lane,
        tally: Tally,
    ) -> impl Future<Output = ()> + Send + 'static {
        let route = self.route.clone();
        let topology = self.topology.clone();
        let max_deliveries = self.max_deliveries;
        let confirm_timeout = self.confirm_timeout;
        async move {
            let settle = Settle {
                channel: &channel,
                delivery: &delivery,
                topology: &topology,
                route: route.name(),
                confirm_timeout,
            };
            let returns = returns(&delivery);
            let decision = match lane {
                Lane::Work if returns > 0 => Decision::ToSuspects,
                Lane::Suspect if returns >= max_deliveries => Decision::Answer {
                    outcome: Outcome::DeadLetter(DeadLetter {
                        reason: DeadLetterReason::DeliveryLimit,
                        detail: format!(
                            "came back {returns} times without being settled: its consumer died or lost \
                             its channel, or the broker refused its retry copy, each time"
                        ),
                    }),
                    attempt: delivery_attempt(&delivery),
                },
                Lane::Work | Lane::Suspect => {
                    let converted = to_delivery(&delivery, topology.queue());
                    let attempt = converted.attempt();
                    let outcome = route.handle(converted).await;
                    Decision::Answer { outcome, attempt }
                }
            };
            if !settle.apply_until_settled(&decision).await {
                tally.unsettled();
                return;
            }
            match decision {
                Decision::ToSuspects => tally.retried("returned_unsettled"),
                Decision::Answer { outcome, .. } => tally.settled(&outcome),
            }
        }
    }
}

/// What the lanes of one run share.
#[derive(Clone, Copy)]
struct Lanes<'a> {
    channel: &'a Channel,
    /// One pool for both lanes: a suspect takes every permit, so it runs alone.
    permits: &'a Arc<Semaphore>,
    /// Ends both lanes: cancelled by the run's shutdown, by a lane that ended, or by drain.
    stop: &'a CancellationToken,
    tally: &'a Tally,
}

/// How a delivery is to be settled.
enum Decision {
    /// Moved to the suspect queue: it came back unsettled.
    ToSuspects,
    /// Settled by the action of the stack's outcome (or the delivery limit's), at `attempt`.
    Answer { outcome: Outcome, attempt: u32 },
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

/// True when settling again on the same channel may pass.
fn worth_settling_again(error: &Error) -> bool {
    match error {
        Error::Nacked | Error::ConfirmTimeout(_) => true,
        // The channel is gone (the broker redelivers), or the copy has no queue.
        Error::Amqp(_)
        | Error::Unroutable { .. }
        | Error::PublishGaveUp { .. }
        | Error::ConnectGaveUp { .. } => false,
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

/// How many times this message came back unsettled: in earlier queues (carried by the
/// runner's copies) and in this one (counted by the broker).
fn returns(delivery: &AmqpDelivery) -> u32 {
    let earlier = header_u32(delivery, RETURNS_HEADER).unwrap_or(0);
    earlier.saturating_add(header_u32(delivery, DELIVERY_COUNT_HEADER).unwrap_or(0))
}

/// The oncely attempt number a delivery carries, 1 when absent.
fn delivery_attempt(delivery: &AmqpDelivery) -> u32 {
    header_u32(delivery, ATTEMPT_HEADER).unwrap_or(1)
}

fn header_u32(delivery: &AmqpDelivery, name: &str) -> Option<u32> {
    let value = delivery.properties.headers().as_ref()?.inner().get(name)?;
    integer_of(value).map(|value| u32::try_from(value.max(0)).unwrap_or(u32::MAX))
}

/// One delivery's settlement with the broker.
struct Settle<'a> {
    channel: &'a Channel,
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
            let requeue = BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            };
            let _ = self.delivery.acker.nack(requeue).await;
            return false;
        }
        true
    }

    async fn apply(&self, decision: &Decision) -> Result<(), Error> {
        match decision {
            Decision::ToSuspects => self.to_suspects().await,
            Decision::Answer { outcome, attempt } => {
                // A wait for another holder is not a failure: it keeps its attempt number.
                let wait = outcome.retry_reason().is_some_and(RetryReason::is_wait);
                self.action(&outcome.action(), wait, *attempt).await
            }
        }
    }

    /// Acks, or forwards a copy for a retry or a dead letter and then acks.
    async fn action(&self, action: &BrokerAction, wait: bool, attempt: u32) -> Result<(), Error> {
        match action {
            BrokerAction::Ack => {
                self.delivery.acker.ack(BasicAckOptions::default()).await?;
                Ok(())
            }
            BrokerAction::Retry { delay } => {
                let next = if wait { attempt } else { attempt.saturating_add(1) };
                let queue = self.topology.retry_queue_for(*delay, attempt);
                self.forward(queue, copy_headers(self.delivery, next)).await
            }
            BrokerAction::DeadLetter(dead) => {
                let mut headers = copy_headers(self.delivery, attempt);
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

    /// Moves a delivery that came back unsettled to the suspect queue, keeping its attempt.
    async fn to_suspects(&self) -> Result<(), Error> {
        let headers = copy_headers(self.delivery, delivery_attempt(self.delivery));
        self.forward(self.topology.suspect_queue(), headers).await
    }

    /// Publishes a copy of the delivery to `queue` with `headers`, waits for the broker's
    /// confirm, then acks the original.
    async fn forward(&self, queue: &str, headers: FieldTable) -> Result<(), Error> {
        let properties = self
            .delivery
            .properties
            .clone()
            .with_headers(headers)
            .with_delivery_mode(2);
        publish_confirmed(
            self.channel,
            "",
            queue,
            &self.delivery.data,
            properties,
            self.confirm_timeout,
        )
        .await?;
        self.delivery.acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }
}

/// The delivery's headers for its copy: the attempt number and the original exchange and
/// routing key (kept from an earlier copy). A dead letter adds its metadata to them.
fn copy_headers(delivery: &AmqpDelivery, attempt: u32) -> FieldTable {
    let returns = returns(delivery);
    let mut headers = delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default()
        .inner()
        .clone();
    // The broker's count belongs to the delivery, not the copy (a new message to the broker):
    // it is carried over in the runner's own header.
    headers.remove(DELIVERY_COUNT_HEADER);
    let mut headers = FieldTable::from(headers);
    let mut set = |name: &str, value: AMQPValue| {
        headers.insert(name.into(), value);
    };
    set(ATTEMPT_HEADER, AMQPValue::LongLongInt(i64::from(attempt)));
    if returns > 0 {
        set(RETURNS_HEADER, AMQPValue::LongLongInt(i64::from(returns)));
    }
    if !headers.contains_key(ORIGINAL_EXCHANGE_HEADER) {
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
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await?;
    match tokio::time::timeout(confirm_timeout, confirm).await {
        Err(_) => Err(Error::ConfirmTimeout(confirm_timeout)),
        Ok(confirmation) => match confirmation? {
            Confirmation::Nack(_) => Err(Error::Nacked),
            Confirmation::Ack(Some(_)) => Err(Error::Unroutable {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        },
    }
}
