//! Listener wrappers: a route's stack behind RocketMQ's listener traits.

use std::future::Future;
use std::time::Duration;

use futures_util::future::join_all;
use oncely::{BoxError, BrokerAction, DeadLetter, Envelope, Outcome, RetryReason, Route, dead_letter};
use rocketmq_client_rust::{
    ClientResult, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, ConsumeOrderlyContext,
    ConsumeOrderlyStatus, MessageListenerConcurrently, MessageListenerOrderly,
};
use rocketmq_model::common::message::message_ext::MessageExt;
use tokio::runtime::{Handle, RuntimeFlavor};
use tower_service::Service;

use crate::convert::to_delivery;
use crate::dead_letter::DeadLetterTopic;
use crate::drain::Progress;

/// A [`MessageListenerConcurrently`] that runs each message through a route's stack.
///
/// | outcome | status returned |
/// |---|---|
/// | processed, duplicate, stale | `ConsumeSuccess` |
/// | retry later | `ReconsumeLater`: the broker's retry topic brings the message back with reconsume times + 1 (after 10 s, 30 s, 1 min, … by its delay levels), and after the consumer's maxReconsumeTimes moves it to its own `%DLQ%<group>` |
/// | dead letter | the copy goes to the [`DeadLetterTopic`] with the dead-letter metadata of [`oncely::dead_letter`] (source: the topic); once the broker stored it, `ConsumeSuccess`; if that send fails, `ReconsumeLater` |
///
/// A batch (`consume_message_batch_max_size` > 1) is settled as one, as RocketMQ's status
/// is per batch: every message of it is run, all at once — behind a
/// oncely's `BatchedLayer` (PostgreSQL or MySQL) they join one transaction when a lane is
/// free, so the batch commits once — and if any needs a retry, the whole batch comes
/// back; the ones already done then answer `Duplicate`. A dead letter written for such a
/// batch may be written again when the batch returns.
///
/// RocketMQ counts reconsume times only for messages sent back for a retry: a consumer that
/// dies while holding a message (OOM, abort, SIGKILL) gets it again with the same count, so
/// a message that crashes its process would loop forever. Give the route a
/// [delivery limit](Route::with_delivery_limit) on a shared counter (Redis) to dead-letter
/// it after a bounded number of crashes.
///
/// Set the route's [`max attempts`](Route::with_max_attempts) at or below the consumer's
/// maxReconsumeTimes + 1 (16 + 1 by default) so that a message failing for good reaches the
/// dead-letter topic with `attempts_exhausted` rather than the broker's `%DLQ%` without a
/// reason. Waiting for another consumer of the same key never exhausts the route's attempts,
/// but each such retry counts toward the broker's maxReconsumeTimes.
///
/// RocketMQ's client calls listeners synchronously, usually on its own blocking threads,
/// but on an async worker for a message sent to the consumer directly (the broker's
/// consume-message-directly request). The stack runs on the Tokio runtime given here — the
/// one your Redis and PostgreSQL connections live on — with [`Handle::block_on`], from
/// inside [`block_in_place`](tokio::task::block_in_place) when the call comes on a
/// multi-threaded runtime's worker, or from a helper thread on any other runtime's, so it
/// works on either kind of thread.
///
/// Its [`progress`](ConcurrentListener::progress) gives the run's report and drain mode.
pub struct ConcurrentListener<S> {
    settler: Settler<S>,
}

/// A [`MessageListenerOrderly`] that runs each message through a route's stack, in queue
/// order.
///
/// Outcomes map as for [`ConcurrentListener`], except that a retry returns
/// `SuspendCurrentQueueAMoment`: the client holds the queue and redelivers the same message
/// (reconsume times + 1) before any later one, after the delay a tier suggests or the
/// consumer's `suspend_current_queue_time_millis`. Messages of a batch run in order and stop
/// at the first one that needs a retry, so none overtakes it.
///
/// Put a state-machine guard in the stack for events that must apply in order; stale ones
/// (an older state arriving after a newer one) are acknowledged, not applied.
pub struct OrderlyListener<S> {
    settler: Settler<S>,
}

impl<S> ConcurrentListener<S> {
    /// A listener running `route` on `runtime`, dead-lettering to `dead_letters`.
    pub fn new(route: Route<S>, runtime: Handle, dead_letters: DeadLetterTopic) -> Self {
        ConcurrentListener {
            settler: Settler {
                route,
                runtime,
                dead_letters,
                progress: Progress::default(),
            },
        }
    }

    /// What this listener has done since it was made, and drain mode
    /// ([`Progress::wait_until_drained`]); keep it before registering the listener.
    pub fn progress(&self) -> Progress {
        self.settler.progress.clone()
    }
}

impl<S> OrderlyListener<S> {
    /// A listener running `route` on `runtime`, dead-lettering to `dead_letters`.
    pub fn new(route: Route<S>, runtime: Handle, dead_letters: DeadLetterTopic) -> Self {
        OrderlyListener {
            settler: Settler {
                route,
                runtime,
                dead_letters,
                progress: Progress::default(),
            },
        }
    }

    /// What this listener has done since it was made, and drain mode
    /// ([`Progress::wait_until_drained`]); keep it before registering the listener.
    pub fn progress(&self) -> Progress {
        self.settler.progress.clone()
    }
}

impl<S> MessageListenerConcurrently for ConcurrentListener<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    fn consume_message(
        &self,
        messages: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let settler = &self.settler;
        let _in_flight = settler.arrived(messages);
        let retry = block_on(&settler.runtime, async {
            // All at once: behind a batched record they share its transactions.
            let retries = join_all(messages.iter().map(|message| settler.settle_in_place(message))).await;
            retries.contains(&true)
        });
        Ok(if retry {
            // RocketMQ's status is per batch: every message of it comes back.
            settler.progress.sent_back(messages);
            ConsumeConcurrentlyStatus::ReconsumeLater
        } else {
            ConsumeConcurrentlyStatus::ConsumeSuccess
        })
    }
}

impl<S> MessageListenerOrderly for OrderlyListener<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    fn consume_message(
        &self,
        messages: &[&MessageExt],
        context: &mut ConsumeOrderlyContext,
    ) -> ClientResult<ConsumeOrderlyStatus> {
        let settler = &self.settler;
        let _in_flight = settler.arrived(messages);
        let retry = block_on(&settler.runtime, async {
            for message in messages {
                let (settled, outcome) = settler.settle(message).await;
                settler.count(&settled, &outcome);
                if let Settled::Retry { delay } | Settled::Wait { delay } = settled {
                    return Some(delay);
                }
            }
            None
        });
        Ok(match retry {
            None => ConsumeOrderlyStatus::Success,
            Some(delay) => {
                // The client holds the queue and delivers the whole batch again (the messages
                // before this one then answer duplicate).
                settler.progress.sent_back(messages);
                if let Some(delay) = delay {
                    let millis = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
                    context.set_suspend_current_queue_time_millis(millis);
                }
                ConsumeOrderlyStatus::SuspendCurrentQueueAMoment
            }
        })
    }
}

/// Runs `future` to its end on `runtime` from a synchronous listener call, whatever thread
/// the client calls from. `Handle::block_on` panics on a thread that already runs async
/// code ("Cannot start a runtime from within a runtime").
fn block_on<F>(runtime: &Handle, future: F) -> F::Output
where
    F: Future + Send,
    F::Output: Send,
{
    match Handle::try_current().map(|current| current.runtime_flavor()) {
        // A thread outside any runtime.
        Err(_) => runtime.block_on(future),
        // A worker of a multi-threaded runtime gives its place to others while it blocks; on
        // the runtime's blocking threads (where the client's listener lane runs),
        // `block_in_place` just runs the closure.
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(|| runtime.block_on(future)),
        // A single-threaded runtime's only worker cannot give its place to blocking code.
        Ok(_) => std::thread::scope(|scope| {
            scope
                .spawn(|| runtime.block_on(future))
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        }),
    }
}

/// How long the concurrent listener waits in place for a key another delivery holds (e.g. a
/// dead consumer's lease) before it sends the message back to the broker's retry schedule
/// (10 s, 30 s, 1 min, … and one more reconsume time each).
const WAIT_IN_PLACE: Duration = Duration::from_secs(5);

/// What became of one message.
enum Settled {
    /// Another delivery holds the key: try again after `delay`.
    Wait { delay: Option<Duration> },
    /// Acknowledge it: done, a duplicate, stale, or dead-lettered and stored.
    Done,
    /// Bring it back, after `delay` when a tier suggested one.
    Retry { delay: Option<Duration> },
}

/// The conversion and outcome mapping both listeners share.
struct Settler<S> {
    route: Route<S>,
    runtime: Handle,
    dead_letters: DeadLetterTopic,
    progress: Progress,
}

impl<S> Settler<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
{
    /// Notes a batch's messages as arrived; they are in flight until the guards drop.
    fn arrived(&self, messages: &[&MessageExt]) -> Vec<oncely::report::InFlight> {
        messages
            .iter()
            .map(|message| self.progress.arrived(message))
            .collect()
    }

    /// Counts one message's final settlement in the run's report.
    fn count(&self, settled: &Settled, outcome: &Outcome) {
        let tally = self.progress.tally();
        match (settled, outcome) {
            // The dead letter could not be stored: the message comes back unsettled.
            (Settled::Retry { .. }, Outcome::DeadLetter(_)) => tally.unsettled(),
            _ => tally.settled(outcome),
        }
    }

    /// Settles `message` as [`settle`](Settler::settle) does, but while another delivery of
    /// its key is in flight, waits in place (up to [`WAIT_IN_PLACE`]) rather than sending the
    /// message back; counts the settlement and says whether the message needs a retry.
    async fn settle_in_place(&self, message: &MessageExt) -> bool {
        let started = std::time::Instant::now();
        loop {
            let (settled, outcome) = self.settle(message).await;
            if let Settled::Wait { delay } = settled
                && started.elapsed() < WAIT_IN_PLACE
            {
                tokio::time::sleep(delay.unwrap_or(Duration::from_millis(100))).await;
                continue;
            }
            self.count(&settled, &outcome);
            return match settled {
                Settled::Done => false,
                Settled::Wait { .. } | Settled::Retry { .. } => true,
            };
        }
    }

    /// Runs one message through the route and settles it; returns the settlement and the
    /// stack's outcome.
    async fn settle(&self, message: &MessageExt) -> (Settled, Outcome) {
        let delivery = to_delivery(message);
        let topic = delivery.source().name.clone();
        let attempt = delivery.attempt();
        let message_id = delivery.message_id().map(str::to_owned);
        // The route's own span already logs the outcome.
        let outcome = self.route.handle(delivery).await;
        let wait = outcome.retry_reason().is_some_and(RetryReason::is_wait);
        let settled = match outcome.action() {
            BrokerAction::Ack => Settled::Done,
            BrokerAction::Retry { delay } if wait => Settled::Wait { delay },
            BrokerAction::Retry { delay } => Settled::Retry { delay },
            BrokerAction::DeadLetter(dead) => {
                let context = dead_letter::Context {
                    route: self.route.name(),
                    attempts: attempt,
                    source: &topic,
                    message_id: message_id.as_deref(),
                };
                self.dead_letter(message, &dead, &context).await
            }
        };
        (settled, outcome)
    }

    /// Writes the dead letter and settles the message: acknowledged once the broker stored
    /// the copy, retried if it did not, so a dead letter is never lost.
    async fn dead_letter(
        &self,
        message: &MessageExt,
        dead: &DeadLetter,
        context: &dead_letter::Context<'_>,
    ) -> Settled {
        let (route, topic) = (context.route, context.source);
        match self.dead_letters.publish(message, dead, context).await {
            Ok(()) => {
                let dead_letter_topic = self.dead_letters.topic();
                tracing::warn!(route, topic, dead_letter_topic, reason = %dead, "dead-lettered");
                Settled::Done
            }
            Err(error) => {
                tracing::error!(route, topic, %error, "dead letter not stored; the message will be retried");
                Settled::Retry { delay: None }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use oncely::{HandlerError, KeyExtractor, handler_fn};
    use rocketmq_client_rust::DefaultMQProducer;
    use rocketmq_model::common::message::message_queue::MessageQueue;
    use rocketmq_model::common::message::message_single::Message;

    use super::*;
    use crate::runtime::OwnedClientRuntime;

    fn message() -> MessageExt {
        let mut ext = MessageExt::default();
        ext.set_message_inner(
            Message::builder()
                .topic("orders")
                .keys(vec!["order_1".into()])
                .body_slice(b"{}")
                .build_unchecked(),
        );
        ext
    }

    /// Calls the orderly listener the way the client's consume-message-directly path does:
    /// on an async worker of a multi-threaded runtime, and on a plain thread.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_orderly_listener_runs_on_an_async_worker_and_on_a_plain_thread() {
        let client = OwnedClientRuntime::new("listener-test").unwrap();
        let producer = DefaultMQProducer::builder(client.client_runtime()).build();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let handler = handler_fn(move |_envelope| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), HandlerError>(()) }
        });
        let route = Route::new("orders", KeyExtractor::broker_key(), handler);
        let listener = Arc::new(OrderlyListener::new(
            route,
            Handle::current(),
            DeadLetterTopic::new(producer, "orders_dead_letters"),
        ));
        let consume = |listener: &OrderlyListener<_>| {
            let message = message();
            let mut context = ConsumeOrderlyContext::new(MessageQueue::default());
            listener.consume_message(&[&message], &mut context).unwrap()
        };

        let on_worker = tokio::spawn({
            let listener = listener.clone();
            async move { consume(&listener) }
        });
        assert!(matches!(on_worker.await.unwrap(), ConsumeOrderlyStatus::Success));
        let on_thread = std::thread::spawn({
            let listener = listener.clone();
            move || consume(&listener)
        });
        assert!(matches!(on_thread.join().unwrap(), ConsumeOrderlyStatus::Success));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        drop(listener);
        client.shutdown().await;
    }
}
