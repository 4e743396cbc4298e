//! How a measurement fills its queue and drains it: a raw lapin consumer (acking only, or
//! writing each message's row at least once), or oncely's runner over a stack.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use integration_tests::amqp::{connect, ready_messages};
use lapin::Channel;
use lapin::options::BasicAckOptions;
use lapin::protocol::basic::AMQPProperties;
use oncely::{BoxError, Envelope, KeyExtractor, Outcome, Route};
use oncely_amqp::{Runner, Topology};
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;

use crate::baseline::Writer;
use crate::workload::Message;

/// Fills a fresh queue of `topology` with `messages` (unconfirmed publishes, then a wait
/// until the broker counts them all), each with its message id.
pub(super) async fn fill(channel: &Channel, topology: &Topology, messages: &[Message]) {
    topology.declare(channel).await.expect("declare");
    publish(channel, topology.queue(), messages).await;
    wait_until_ready(channel, topology.queue(), messages.len()).await;
}

/// Publishes `messages` to `queue`, unconfirmed: filling is not measured, and
/// [`wait_until_ready`] counts what the broker stored.
pub(crate) async fn publish(channel: &Channel, queue: &str, messages: &[Message]) {
    for message in messages {
        let properties = AMQPProperties::default().with_message_id(message.message_id.as_str().into());
        let body = message.body();
        let publish = channel.basic_publish(
            "".into(),
            queue.into(),
            Default::default(),
            body.as_bytes(),
            properties,
        );
        drop(publish.await.expect("publish"));
    }
}

/// Waits until `queue` holds at least `count` ready messages.
pub(crate) async fn wait_until_ready(channel: &Channel, queue: &str, count: usize) {
    while (ready_messages(channel, queue).await as usize) < count {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Consumes `messages` from a full `queue` with a plain lapin loop at `prefetch`, each
/// delivery on a task of its own that runs `writer` on it (nothing, or its row in a
/// transaction of its own) and acks it after: an at-least-once consumer as users write one.
/// Its rate, from the first delivery to the last ack.
pub(super) async fn raw_consumer(
    channel: &Channel,
    queue: &str,
    prefetch: u16,
    messages: usize,
    writer: &Writer,
) -> f64 {
    channel
        .basic_qos(prefetch, Default::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(queue.into(), "raw".into(), Default::default(), Default::default())
        .await
        .expect("consume");
    let acked = Arc::new(AtomicU64::new(0));
    let mut started = None;
    for _ in 0..messages {
        let delivery = consumer.next().await.expect("a delivery").expect("a delivery");
        // From the first delivery, as the runner's clock (see `runner_consumer`).
        started.get_or_insert_with(Instant::now);
        let (acked, writer) = (acked.clone(), writer.clone());
        tokio::spawn(async move {
            writer.write(&delivery.data).await;
            delivery.acker.ack(BasicAckOptions::default()).await.expect("ack");
            acked.fetch_add(1, Ordering::Relaxed);
        });
    }
    while (acked.load(Ordering::Relaxed) as usize) < messages {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let rate = messages as f64 / started.expect("a delivery").elapsed().as_secs_f64();
    let _ = channel.basic_cancel("raw".into(), Default::default()).await;
    rate
}

/// Consumes `messages` from a full queue through a runner of a route of `stack` at
/// `prefetch` and as many in flight, counting every delivery the stack answered (handled,
/// duplicate or not).
///
/// The clock starts when the first delivery reaches the stack, as the raw consumer's starts
/// at its first delivery: a rate is what a consumer sustains, and connecting, declaring the
/// topology and `basic.consume` (about 20 ms for the runner, against 2 ms for the raw loop
/// on a channel already open) happen once in a process's life, not per message. It stops
/// once the runner has shut down, every delivery settled, as the raw consumer's stops at its
/// last ack.
pub(super) async fn runner_consumer<S>(
    channel: &Channel,
    topology: &Topology,
    prefetch: u16,
    messages: usize,
    stack: S,
) -> f64
where
    S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    let first_delivery = Arc::new(OnceLock::new());
    let answered = Arc::new(AtomicU64::new(0));
    let counted = {
        let (first_delivery, answered) = (first_delivery.clone(), answered.clone());
        ServiceBuilder::new()
            .map_request(move |envelope: Envelope| {
                first_delivery.get_or_init(Instant::now);
                envelope
            })
            .map_result(move |result| {
                answered.fetch_add(1, Ordering::Relaxed);
                result
            })
            .service(stack)
    };
    let shutdown = CancellationToken::new();
    let route = Route::new("bench", KeyExtractor::json_pointer("/orderId"), counted);
    let runner = Runner::new(route, topology.clone())
        .with_prefetch(prefetch)
        .with_concurrency(usize::from(prefetch));
    // As the README runs it: on a connection and channel of its own, which lets it batch
    // its acks.
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { runner.run_with_reconnect(connect, &shutdown).await })
    };
    while (answered.load(Ordering::Relaxed) as usize) < messages
        || ready_messages(channel, topology.queue()).await > 0
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    shutdown.cancel();
    running.await.expect("the runner task").expect("the runner");
    let started = first_delivery.get().expect("a delivery reached the stack");
    messages as f64 / started.elapsed().as_secs_f64()
}
