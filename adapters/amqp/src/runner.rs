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
use oncely::{BoxError, BrokerAction, Envelope, Outcome, Route};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use crate::convert::{ATTEMPT_HEADER, to_delivery};
use crate::error::Error;
use crate::topology::Topology;

/// Dead-letter header: the reason, `code: detail`.
pub const REASON_HEADER: &str = "x-oncely-reason";
/// Dead-letter header: the attempt the message was dead-lettered at.
pub const ATTEMPTS_HEADER: &str = "x-oncely-attempts";
/// Dead-letter and retry header: the exchange the message was first published to.
pub const ORIGINAL_EXCHANGE_HEADER: &str = "x-oncely-original-exchange";
/// Dead-letter and retry header: the routing key the message was first published with.
pub const ORIGINAL_ROUTING_KEY_HEADER: &str = "x-oncely-original-routing-key";

/// Runs a route's stack over a RabbitMQ queue: the consumer loop you would write by hand,
/// with the acks decided by the stack's [`Outcome`]s.
///
/// | outcome | what the runner does |
/// |---|---|
/// | processed, duplicate, stale | `basic.ack` |
/// | retry later | publishes a copy to a retry queue of the [`Topology`] (attempt + 1), waits for the broker's confirm, then acks |
/// | dead letter | publishes a copy to the dead-letter queue with the reason headers, waits for the confirm, then acks |
///
/// A delivery is acked only after the stack answered for it and, for a retry or a dead
/// letter, only after the broker confirmed the copy; if that publish fails, the delivery is
/// `nack`ed back to its queue. So a message is never lost between the two. A consumer that
/// dies leaves its deliveries unacked, and the broker redelivers them: the stack answers
/// for what was already done.
pub struct Runner<S> {
    route: Route<S>,
    topology: Topology,
    prefetch: u16,
    concurrency: usize,
    shutdown_grace: Duration,
    confirm_timeout: Duration,
}

impl<S> Runner<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    /// A runner of `route` over `topology`'s work queue. Defaults: prefetch 64, 64 deliveries
    /// handled at once, 30 s for in-flight deliveries at shutdown, 10 s per publisher confirm.
    pub fn new(route: Route<S>, topology: Topology) -> Self {
        Runner {
            route,
            topology,
            prefetch: 64,
            concurrency: 64,
            shutdown_grace: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(10),
        }
    }

    /// How many unacked deliveries the broker sends ahead (`basic.qos`).
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many deliveries are handled at once.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// How long shutdown waits for in-flight deliveries before abandoning them unacked (the
    /// broker redelivers them).
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Consumes on `channel` until `shutdown` is cancelled or the channel fails.
    ///
    /// Shutdown is graceful: consuming stops, in-flight deliveries get the shutdown grace to
    /// finish and be settled, and the ones still running after it are abandoned unacked.
    /// Returns the channel's error if it failed.
    pub async fn run(&self, channel: &Channel, shutdown: &CancellationToken) -> Result<(), Error> {
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        let tag = format!("oncely-{}", oncely::Token::random());
        let consumer = channel
            .basic_consume(
                self.topology.queue().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        self.run_consumer(channel, consumer, shutdown).await
    }

    /// Like [`run`](Runner::run), on a consumer you started yourself on `channel` (with your
    /// own `basic.qos`, consumer tag and arguments). It must consume the topology's work queue
    /// without `no_ack`; the runner settles every delivery.
    pub async fn run_consumer(
        &self,
        channel: &Channel,
        mut consumer: Consumer,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        // Retry and dead-letter copies are published on this channel and must be confirmed
        // before the original is acked.
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        let tag = consumer.tag();
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let mut in_flight = JoinSet::new();
        let ended = loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => break Ok(()),
                next = consumer.next() => next,
            };
            match next {
                Some(Ok(delivery)) => {
                    let permit = permits
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the semaphore is never closed");
                    let settle = self.settle_one(channel.clone(), delivery);
                    in_flight.spawn(async move {
                        settle.await;
                        drop(permit);
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
            in_flight.shutdown().await;
        }
        ended
    }

    /// Runs on connections from `connect` until `shutdown` is cancelled: declares the
    /// topology, consumes, and when the connection or channel is lost, connects again with
    /// exponential backoff (100 ms doubling to 10 s). Deliveries left unacked by a lost
    /// channel come back from the broker, and the stack answers for what was already done.
    pub async fn run_with_reconnect<F, Fut>(&self, mut connect: F, shutdown: &CancellationToken)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Connection, lapin::Error>>,
    {
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let attempt = async {
                let connection = connect().await?;
                let channel = connection.create_channel().await?;
                self.topology.declare(&channel).await?;
                let ran = self.run(&channel, shutdown).await;
                let _ = connection.close(200, "oncely runner stopped".into()).await;
                ran
            };
            match attempt.await {
                Ok(()) if shutdown.is_cancelled() => return,
                Ok(()) => tracing::warn!("consumer ended by the broker; reconnecting"),
                Err(error) => tracing::warn!(%error, ?backoff, "AMQP connection lost; reconnecting"),
            }
            if shutdown
                .run_until_cancelled(tokio::time::sleep(backoff))
                .await
                .is_none()
            {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }

    /// Handles one delivery and settles it; never fails: a failed settlement is a `nack`
    /// back to the queue, or, with the channel gone, a redelivery by the broker.
    fn settle_one(
        &self,
        channel: Channel,
        delivery: AmqpDelivery,
    ) -> impl Future<Output = ()> + Send + 'static {
        let route = self.route.clone();
        let topology = self.topology.clone();
        let confirm_timeout = self.confirm_timeout;
        async move {
            let converted = to_delivery(&delivery, topology.queue());
            let attempt = converted.attempt();
            let outcome = route.handle(converted).await;
            let settled = match outcome.action() {
                BrokerAction::Ack => delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map(drop)
                    .map_err(Error::from),
                BrokerAction::Retry { delay } => {
                    let queue = topology.retry_queue_for(delay, attempt);
                    let headers = copy_headers(&delivery, attempt + 1, None);
                    forward(&channel, &delivery, &queue, headers, confirm_timeout).await
                }
                BrokerAction::DeadLetter => {
                    let Outcome::DeadLetter(dead) = &outcome else {
                        unreachable!("dead-letter action")
                    };
                    let headers = copy_headers(&delivery, attempt, Some(&dead.to_string()));
                    forward(
                        &channel,
                        &delivery,
                        &topology.dead_letter_queue(),
                        headers,
                        confirm_timeout,
                    )
                    .await
                }
            };
            if let Err(error) = settled {
                tracing::warn!(%error, ?outcome, "could not settle the delivery; returning it to the queue");
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                let _ = delivery.acker.nack(requeue).await;
            }
        }
    }
}

/// The delivery's headers for its copy: the attempt number, the original exchange and
/// routing key (kept from an earlier copy), and for a dead letter the reason.
fn copy_headers(delivery: &AmqpDelivery, attempt: u32, reason: Option<&str>) -> FieldTable {
    let mut headers = delivery.properties.headers().clone().unwrap_or_default();
    let mut set = |name: &str, value: AMQPValue| {
        headers.insert(name.into(), value);
    };
    set(ATTEMPT_HEADER, AMQPValue::LongLongInt(i64::from(attempt)));
    if let Some(reason) = reason {
        set(REASON_HEADER, AMQPValue::LongString(reason.into()));
        set(ATTEMPTS_HEADER, AMQPValue::LongLongInt(i64::from(attempt)));
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

/// Publishes a copy of `delivery` to `queue` with `headers`, waits for the broker's
/// confirm, then acks the original.
async fn forward(
    channel: &Channel,
    delivery: &AmqpDelivery,
    queue: &str,
    headers: FieldTable,
    confirm_timeout: Duration,
) -> Result<(), Error> {
    let properties = delivery
        .properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2);
    publish_confirmed(channel, "", queue, &delivery.data, properties, confirm_timeout).await?;
    delivery.acker.ack(BasicAckOptions::default()).await?;
    Ok(())
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
