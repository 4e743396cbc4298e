//! The batched mode with per-delivery handlers: each delivery's handler runs on its own task,
//! in turn, inside the batch's transaction.

use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::oneshot;
use tower_service::Service;

use super::lane::{Ended, Joiner, Lanes, Word, Writer, Written};
use crate::backend::postgres::Checkout;
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::outcome::{Outcome, RetryReason};
use crate::record::postgres::PgTransaction;
use crate::telemetry::Probe;
use crate::tier::{BoxFuture, Tier, behind, decide};

/// What a delivery is handed when its handler may run in the batch's transaction.
pub(super) struct Turn {
    transaction: PgTransaction,
    /// Where the handler's outcome goes; dropped unsent when the delivery's future is.
    done: oneshot::Sender<Outcome>,
    /// The lane's last word, once the batch ended.
    then: oneshot::Receiver<Word<Turn>>,
}

/// Runs the group's handlers one after another, each in its delivery's own task, and stops
/// at the first that fails: the batch is rolled back then, and the rest never ran. One at
/// a time, each handler sees its predecessors' writes, as it would after their commits:
/// read-modify-write handlers stay correct.
#[derive(Clone, Copy, Debug)]
pub(super) struct Turns;

impl Writer for Turns {
    type Turn = Turn;

    async fn write(
        &self,
        transaction: &Arc<Checkout>,
        group: Vec<Joiner<Turn>>,
        first: bool,
    ) -> Written<Turn> {
        let mut written = Written {
            ended: Vec::with_capacity(group.len()),
            tainted: false,
        };
        let mut failed = false;
        let mut first = first;
        for joiner in group {
            if failed {
                written.ended.push(Ended::of(joiner, None));
                continue;
            }
            let (done, handled) = oneshot::channel();
            let (last_word, then) = oneshot::channel();
            let turn = Turn {
                transaction: PgTransaction(transaction.clone()),
                done,
                then,
            };
            let Joiner { request, reply, .. } = joiner;
            if let Err(Word::Turn(turn)) = reply.send(Word::Turn(turn)) {
                // Gone before its turn (a timeout in front, a shutdown): its key is claimed but
                // its handler never ran, so the batch must not commit. Nobody waits for its
                // last word.
                drop(turn);
                let (nobody, _) = oneshot::channel();
                written.ended.push(Ended {
                    request,
                    reply: nobody,
                    outcome: None,
                });
                failed = true;
                continue;
            }
            // Dropped or panicked mid-handler (`Err`): a statement of its may still be running,
            // and nobody waits for its answer.
            let mut outcome = handled.await.ok();
            written.tainted |= outcome.is_none();
            failed = !outcome.as_ref().is_some_and(Outcome::is_settled);
            if failed && !first {
                outcome = None;
            }
            first = false;
            written.ended.push(Ended {
                request,
                reply: last_word,
                outcome,
            });
        }
        written
    }
}

/// The batched transactional record with the per-delivery handlers behind it (`S`); built by
/// [`PgBatchedLayer`](super::PgBatchedLayer). See the [module docs](super).
pub struct PgBatchedService<S> {
    inner: S,
    lanes: Arc<Lanes<Turns>>,
}

impl<S> PgBatchedService<S> {
    pub(super) fn new(inner: S, lanes: Lanes<Turns>) -> Self {
        PgBatchedService {
            inner,
            lanes: Arc::new(lanes),
        }
    }
}

impl<S: Clone> Clone for PgBatchedService<S> {
    fn clone(&self) -> Self {
        PgBatchedService {
            inner: self.inner.clone(),
            lanes: self.lanes.clone(),
        }
    }
}

impl<S> std::fmt::Debug for PgBatchedService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgBatchedService")
            .field("record", self.lanes.record())
            .finish_non_exhaustive()
    }
}

impl<S> Service<Envelope> for PgBatchedService<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        // The readied service goes with the call, as in every tier.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let lanes = self.lanes.clone();
        Box::pin(async move {
            let probe = Probe::enter(&envelope, Tier::Record);
            let outcome = take_part(&lanes, inner, envelope, &probe).await;
            probe.answered(&outcome);
            Ok(outcome)
        })
    }
}

/// One delivery's part in a batch: join, run its handler when its turn comes, answer the
/// batch's verdict — or run again alone if the batch was rolled back for another's failure.
async fn take_part<S>(lanes: &Lanes<Turns>, inner: S, envelope: Envelope, probe: &Probe) -> Outcome
where
    S: Service<Envelope, Response = Outcome> + Clone,
    S::Error: Into<BoxError>,
{
    let template = inner.clone();
    let mut readied = Some(inner);
    let mut word = lanes.join(&envelope).await;
    loop {
        match word {
            Word::Answer(outcome) => return outcome,
            Word::Alone => {
                let service = match readied.take() {
                    Some(service) => Ok(service),
                    None => ready(template.clone()).await,
                };
                return match service {
                    Ok(service) => decide(lanes.record(), service, envelope, probe).await,
                    Err(outcome) => outcome,
                };
            }
            Word::Turn(turn) => {
                probe.passed();
                let service = match readied.take() {
                    Some(service) => Ok(service),
                    None => ready(template.clone()).await,
                };
                let outcome = match service {
                    Ok(service) => {
                        let mut in_turn = envelope.clone();
                        in_turn.extensions_mut().insert(turn.transaction);
                        behind(service, in_turn).await
                    }
                    Err(outcome) => outcome,
                };
                let _ = turn.done.send(outcome);
                word = turn.then.await.unwrap_or_else(|_| {
                    Word::Answer(Outcome::retry_later(
                        RetryReason::StoreUnavailable(Tier::Record),
                        "the batch's lane stopped before its commit was known",
                        None,
                    ))
                });
            }
        }
    }
}

/// `service` once it is ready: a clone for a second handler run (alone, after its batch was
/// rolled back) was not readied with the call.
async fn ready<S>(mut service: S) -> Result<S, Outcome>
where
    S: Service<Envelope>,
    S::Error: Into<BoxError>,
{
    match std::future::poll_fn(|cx| service.poll_ready(cx)).await {
        Ok(()) => Ok(service),
        Err(error) => Err(Outcome::retry_later(
            RetryReason::HandlerFailed,
            error.into().to_string(),
            None,
        )),
    }
}
