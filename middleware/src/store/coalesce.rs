//! Coalescing: the requests of concurrent deliveries to one store share round trips, as
//! the record's claims on the SQL stores and the joint flag and lock scripts on Redis do.
//! How requests gather into batches is written once here; each store says how it runs a
//! batch ([`Batch`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::error::StoreError;

/// A store's way to run many requests of one kind in few round trips.
pub(crate) trait Batch: Send + Sync + 'static {
    /// One delivery's request.
    type Request: Send + 'static;
    /// One delivery's answer.
    type Answer: Send + 'static;

    /// Runs `waiters`' requests and answers each waiter, as soon as its answer is known.
    /// Requests of one batch may concern the same key: each must see what the earlier ones
    /// left, as if it had come after them. A waiter left without an answer reads it as
    /// the task failing.
    fn run(&self, waiters: Vec<Waiter<Self::Request, Self::Answer>>) -> impl Future<Output = ()> + Send;
}

/// A request and where its answer goes.
pub(crate) type Waiter<Request, Answer> = (Request, oneshot::Sender<Result<Answer, StoreError>>);

/// Sends each of `answers` to its waiter, in order; a waiter that gave up (its future was
/// dropped) no longer needs it.
pub(crate) fn answer_each<Answer>(
    replies: impl IntoIterator<Item = oneshot::Sender<Result<Answer, StoreError>>>,
    answers: impl IntoIterator<Item = Result<Answer, StoreError>>,
) {
    for (reply, answer) in replies.into_iter().zip(answers) {
        let _ = reply.send(answer);
    }
}

/// The waiters still waiting: a request whose caller gave up (a timeout, a shutdown) is
/// not run, so a claim nobody will settle is never taken.
pub(crate) fn still_waiting<Request, Answer>(
    waiters: Vec<Waiter<Request, Answer>>,
) -> impl Iterator<Item = Waiter<Request, Answer>> {
    waiters.into_iter().filter(|(_, reply)| !reply.is_closed())
}

/// Runs one request as a batch of its own, in the caller's task.
type RunAlone<Request, Answer> =
    Arc<dyn Fn(Waiter<Request, Answer>) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The handle to a batching task; clones share it.
pub(crate) struct Coalescer<Request, Answer> {
    queue: mpsc::Sender<Waiter<Request, Answer>>,
    slots: Arc<Semaphore>,
    run_alone: RunAlone<Request, Answer>,
}

impl<Request, Answer> Clone for Coalescer<Request, Answer> {
    fn clone(&self) -> Self {
        Coalescer {
            queue: self.queue.clone(),
            slots: self.slots.clone(),
            run_alone: self.run_alone.clone(),
        }
    }
}

impl<Request, Answer> std::fmt::Debug for Coalescer<Request, Answer> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer").finish_non_exhaustive()
    }
}

impl<Request: Send + 'static, Answer: Send + 'static> Coalescer<Request, Answer> {
    /// Starts the batching task of `batch` on the current runtime: batches of up to
    /// `max_size` requests, `max_batches` on the wire at once. It ends with the last clone.
    pub(crate) fn spawn<B>(batch: B, max_size: usize, max_batches: usize) -> Self
    where
        B: Batch<Request = Request, Answer = Answer>,
    {
        let max_size = max_size.max(1);
        let batch = Arc::new(batch);
        let slots = Arc::new(Semaphore::new(max_batches.max(1)));
        // Room for a few batches: beyond that, callers wait for the collector, which bounds
        // memory under overload instead of queueing without limit.
        let (queue, receiver) = mpsc::channel(max_size * 4);
        tokio::spawn(collect(receiver, batch.clone(), slots.clone(), max_size));
        let run_alone: RunAlone<Request, Answer> = Arc::new(move |waiter| {
            let batch = batch.clone();
            Box::pin(async move { batch.run(vec![waiter]).await })
        });
        Coalescer {
            queue,
            slots,
            run_alone,
        }
    }

    /// Runs `request` in the next batch: at once and in this task when a slot is free
    /// (then the collector holds no batch waiting for one), else in the batch the collector
    /// sends next. A request can overtake one the collector has not received yet; requests
    /// in flight at the same moment have no order anyway.
    /// (Through the collector, the task hop cost a lone delivery through the joint flag and
    /// lock 17 % of its rate.)
    pub(crate) async fn ask(&self, request: Request) -> Result<Answer, StoreError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || StoreError::new("the coalescing task stopped or failed the batch");
        match self.slots.try_acquire() {
            Ok(slot) => {
                (self.run_alone)((request, reply)).await;
                drop(slot);
            }
            Err(_) => self.queue.send((request, reply)).await.map_err(|_| stopped())?,
        }
        answer.await.map_err(|_| stopped())?
    }
}

/// Gathers the requests that found every slot busy into batches, group-commit style: a
/// batch leaves as soon as one of the `slots` is free, with every request waiting at that
/// moment (up to `max_size`). An idle store therefore adds no delay to a lone request, and under load
/// requests pile up while the slots are busy and share the next round trip. (Closing
/// batches on a timer instead made a lone claim wait for the timer: 13 times slower at one
/// in flight.)
async fn collect<B: Batch>(
    mut receiver: mpsc::Receiver<Waiter<B::Request, B::Answer>>,
    batch: Arc<B>,
    slots: Arc<Semaphore>,
    max_size: usize,
) {
    while let Some(first) = receiver.recv().await {
        let mut waiters = vec![first];
        let slot = loop {
            tokio::select! {
                biased;
                slot = slots.clone().acquire_owned() => break slot,
                Some(waiter) = receiver.recv(), if waiters.len() < max_size => waiters.push(waiter),
            }
        };
        while waiters.len() < max_size {
            match receiver.try_recv() {
                Ok(waiter) => waiters.push(waiter),
                Err(_) => break,
            }
        }
        let batch = batch.clone();
        tokio::spawn(async move {
            batch.run(waiters).await;
            drop(slot);
        });
    }
}

/// `error` for one more waiter of a failed batch: the client's error cannot be cloned,
/// its text can.
pub(crate) fn copy_error(error: &StoreError) -> StoreError {
    match error {
        StoreError::Failed { source } => StoreError::new(source.to_string()),
        StoreError::Malformed { what } => StoreError::malformed(what.clone()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::sync::Notify;

    use super::*;

    /// Answers each request times ten, records the batch sizes, and holds its first batch
    /// until released; leaves one waiter unanswered in a batch holding 0.
    #[derive(Default)]
    struct Recorded {
        sizes: Mutex<Vec<usize>>,
        release_first: Notify,
    }

    impl Batch for Arc<Recorded> {
        type Request = u32;
        type Answer = u32;

        async fn run(&self, waiters: Vec<Waiter<u32, u32>>) {
            let first = {
                let mut sizes = self.sizes.lock().unwrap();
                sizes.push(waiters.len());
                sizes.len() == 1
            };
            if first {
                self.release_first.notified().await;
            }
            let (requests, mut replies): (Vec<u32>, Vec<_>) = waiters.into_iter().unzip();
            if requests.contains(&0) {
                replies.pop();
            }
            answer_each(replies, requests.into_iter().map(|request| Ok(request * 10)));
        }
    }

    #[tokio::test]
    async fn requests_waiting_while_the_slot_is_busy_share_the_next_batch_and_get_their_own_answers() {
        let recorded = Arc::new(Recorded::default());
        let coalescer = Coalescer::spawn(recorded.clone(), 64, 1);
        let first = tokio::spawn({
            let coalescer = coalescer.clone();
            async move { coalescer.ask(1).await }
        });
        while recorded.sizes.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let waiting: Vec<_> = (2..=10)
            .map(|request| {
                let coalescer = coalescer.clone();
                tokio::spawn(async move { coalescer.ask(request).await })
            })
            .collect();
        // Let every waiter reach the queue before the first batch frees the slot.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        recorded.release_first.notify_one();
        assert_eq!(
            first.await.unwrap().unwrap(),
            10,
            "a lone request leaves at once, alone"
        );
        for (request, answer) in (2..=10).zip(waiting) {
            assert_eq!(answer.await.unwrap().unwrap(), request * 10);
        }
        assert_eq!(*recorded.sizes.lock().unwrap(), [1, 9]);
    }

    #[tokio::test]
    async fn a_request_its_batch_did_not_answer_gets_an_error() {
        let recorded = Arc::new(Recorded::default());
        recorded.release_first.notify_one();
        let coalescer = Coalescer::spawn(recorded, 64, 1);
        let error = coalescer.ask(0).await.unwrap_err();
        assert!(error.to_string().contains("stopped"), "{error}");
    }
}
