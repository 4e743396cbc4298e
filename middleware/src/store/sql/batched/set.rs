//! The batched mode with a set-based handler: one call writes the effects of every claimed
//! delivery of the batch.

use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::FutureExt;
use tower_service::Service;

use super::TransactionalRecord;
use super::lane::{Ended, Joiner, Lanes, Limits, Part, Word, Writer, Written};
use crate::envelope::Envelope;
use crate::handler::{Argument, HandlerError, InTransaction};
use crate::outcome::Outcome;
use crate::route::panicked;
use crate::telemetry::Probe;
use crate::tier::{BoxFuture, Tier, decide};

/// A handler that writes the effects of many deliveries at once — one multi-row `INSERT`,
/// one `UPDATE … FROM (VALUES …)` — in the batched record's transaction `T`
/// (`PgTransaction`,
/// `MysqlTransaction`). Any
/// `async fn(PgTransaction, Vec<Envelope>) -> Result<BatchAnswer, HandlerError>` is one for
/// PostgreSQL; the same with `MysqlTransaction` for MySQL.
///
/// It receives the envelopes whose keys the batch claimed (never none, never two of one key,
/// never a duplicate of a settled key) and answers per envelope ([`BatchAnswer`]). When it
/// [fails an envelope](BatchAnswer::fail), the batch is rolled back: that envelope answers
/// its failure (or, when an earlier call ran in the same transaction, runs again alone: the
/// failure may be that call's doing), and the others join another batch, where the handler
/// is called again with them. When it answers an error for the whole batch, or panics,
/// which envelope is at fault is unknown: every envelope of the call runs again alone —
/// the handler is called once per envelope, with a batch of one, each in a transaction of
/// its own. So it must write nothing outside the transaction. An error of one envelope (a
/// body that does not parse, say) may simply be returned with `?`: the envelopes that are
/// fine are written on their second run, the bad one fails alone; [`BatchAnswer::fail`]
/// costs them less (another call in a batch rather than a transaction each).
pub trait BatchHandler<T>: Send + Sync + 'static {
    /// Writes the effects of `batch` in `transaction`, and answers per envelope.
    fn handle(
        &self,
        transaction: T,
        batch: Vec<Envelope>,
    ) -> impl Future<Output = Result<BatchAnswer, HandlerError>> + Send;
}

impl<F, Fut, T> BatchHandler<T> for F
where
    F: Fn(T, Vec<Envelope>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<BatchAnswer, HandlerError>> + Send,
{
    fn handle(
        &self,
        transaction: T,
        batch: Vec<Envelope>,
    ) -> impl Future<Output = Result<BatchAnswer, HandlerError>> + Send {
        self(transaction, batch)
    }
}

/// A [`BatchHandler`]'s answer, per envelope of the batch it was given: processed, unless
/// [failed](BatchAnswer::fail).
#[derive(Debug, Default)]
pub struct BatchAnswer {
    failures: Vec<(usize, HandlerError)>,
}

impl BatchAnswer {
    /// Every envelope processed.
    pub fn processed() -> Self {
        BatchAnswer::default()
    }

    /// The envelope at `index` (in the batch as given) failed with `error`: it answers the
    /// error's outcome (retry, or dead letter when permanent). The batch is then rolled back
    /// and the other envelopes join another batch, so what the handler wrote for the failed
    /// envelope is never committed. An index beyond the batch fails the whole batch.
    pub fn fail(&mut self, index: usize, error: impl Into<HandlerError>) -> &mut Self {
        self.failures.push((index, error.into()));
        self
    }

    /// The outcome of each of `count` envelopes; `None` when the answer names an envelope
    /// the batch does not have.
    fn into_outcomes(self, count: usize) -> Option<Vec<Outcome>> {
        let mut outcomes = vec![Outcome::Processed; count];
        for (index, error) in self.failures {
            *outcomes.get_mut(index)? = error.into_outcome();
        }
        Some(outcomes)
    }
}

/// The answer when a handler failed an envelope it was not given: which one it meant is
/// unknown, so the whole batch failed.
fn not_in_the_batch() -> Outcome {
    HandlerError::transient("the batch handler failed an envelope it was not given").into_outcome()
}

/// Calls the set handler once for the group.
pub(super) struct SetWriter<H>(Arc<H>);

impl<H> Clone for SetWriter<H> {
    fn clone(&self) -> Self {
        SetWriter(self.0.clone())
    }
}

impl<T: Clone + Send + Sync + 'static, H: BatchHandler<T>> Writer<T> for SetWriter<H> {
    type Work = ();

    async fn write(&self, transaction: &T, group: Vec<Joiner<()>>, first: bool) -> Written {
        // Deliveries gone since they were claimed are taken out of the batch (their claims
        // withdrawn): the handler is called with the others only.
        let (gone, group): (Vec<_>, Vec<_>) = group.into_iter().partition(|joiner| joiner.reply.is_closed());
        let mut written = self.write_present(transaction, group, first).await;
        written
            .ended
            .extend(gone.into_iter().map(|joiner| Ended::of(joiner, Part::Gone(None))));
        written
    }
}

impl<H> SetWriter<H> {
    /// Calls the set handler on `group`, which may be empty: then nothing runs.
    async fn write_present<T: Clone + Send + Sync + 'static>(
        &self,
        transaction: &T,
        group: Vec<Joiner<()>>,
        first: bool,
    ) -> Written
    where
        H: BatchHandler<T>,
    {
        if group.is_empty() {
            return Written {
                ended: Vec::new(),
                tainted: false,
            };
        }
        let envelopes = group.iter().map(|joiner| joiner.envelope.clone()).collect();
        // Inside the async block, a panic before the handler's first await is caught too.
        let call = async { self.0.handle(transaction.clone(), envelopes).await };
        let answer = AssertUnwindSafe(call).catch_unwind().await;
        let (whole_batch_failed, tainted) = match answer {
            Ok(Ok(answer)) => match answer.into_outcomes(group.len()) {
                Some(outcomes) => {
                    // After an earlier call, a failure may be that call's doing.
                    let part = |outcome: Outcome| match first || outcome.is_settled() {
                        true => Part::Answered(outcome),
                        false => Part::Suspect,
                    };
                    let ended = group.into_iter().zip(outcomes);
                    return Written {
                        ended: ended
                            .map(|(joiner, outcome)| Ended::of(joiner, part(outcome)))
                            .collect(),
                        tainted: false,
                    };
                }
                None => (not_in_the_batch(), false),
            },
            Ok(Err(error)) => (error.into_outcome(), false),
            // Its statements may still be running: the connection is closed.
            Err(panic) => (panicked(panic.as_ref()), true),
        };
        // Which envelope failed is unknown, unless there is only one (and no call before):
        // each runs alone, where only its own failure counts.
        let alone = group.len() == 1 && first;
        Written {
            ended: group
                .into_iter()
                .map(|joiner| match alone {
                    true => Ended::of(joiner, Part::Answered(whole_batch_failed.clone())),
                    false => Ended::of(joiner, Part::Suspect),
                })
                .collect(),
            tainted,
        }
    }
}

/// The batched transactional record `R` with a set handler; built by
/// [`BatchedLayer::batch_handler`](super::BatchedLayer::batch_handler). Each call is one
/// delivery, which joins a batch and answers its own outcome.
pub struct BatchHandlerService<H: BatchHandler<R::Handle>, R: TransactionalRecord> {
    lanes: Arc<Lanes<R, SetWriter<H>>>,
}

impl<H: BatchHandler<R::Handle>, R: TransactionalRecord> BatchHandlerService<H, R> {
    pub(super) fn new(handler: H, record: R, limits: Limits) -> Self {
        let writer = SetWriter(Arc::new(handler));
        BatchHandlerService {
            lanes: Arc::new(Lanes::new(record, writer, limits)),
        }
    }
}

impl<H: BatchHandler<R::Handle>, R: TransactionalRecord> Clone for BatchHandlerService<H, R> {
    fn clone(&self) -> Self {
        BatchHandlerService {
            lanes: self.lanes.clone(),
        }
    }
}

impl<H: BatchHandler<R::Handle>, R: TransactionalRecord> std::fmt::Debug for BatchHandlerService<H, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchHandlerService")
            .field("record", self.lanes.record())
            .finish_non_exhaustive()
    }
}

impl<H: BatchHandler<R::Handle>, R: TransactionalRecord> Service<Envelope> for BatchHandlerService<H, R> {
    type Response = Outcome;
    type Error = Infallible;
    type Future = BoxFuture<Result<Outcome, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let lanes = self.lanes.clone();
        Box::pin(async move {
            let probe = Probe::enter(&envelope, Tier::Record);
            let outcome = match lanes.join(&envelope, (), || async { Ok(()) }).await {
                Word::Ran(outcome) => {
                    probe.passed();
                    outcome
                }
                Word::Answer(outcome) => outcome,
                Word::Again | Word::Alone => {
                    let one_by_one = OneByOne::<H, R::Handle>(lanes.writer().0.clone(), PhantomData);
                    decide(lanes.record(), one_by_one, envelope, &probe).await
                }
            };
            probe.answered(&outcome);
            Ok(outcome)
        })
    }
}

/// The set handler as a per-delivery handler, for a delivery that runs alone: a batch of one,
/// in the transaction `T` the per-delivery tier hands it.
struct OneByOne<H, T>(Arc<H>, PhantomData<fn(T)>);

impl<T: Argument<InTransaction> + 'static, H: BatchHandler<T>> Service<Envelope> for OneByOne<H, T> {
    type Response = Outcome;
    type Error = Infallible;
    type Future = BoxFuture<Result<Outcome, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, envelope: Envelope) -> Self::Future {
        let handler = self.0.clone();
        Box::pin(async move {
            let transaction = match T::take(&envelope) {
                Ok(transaction) => transaction,
                Err(outcome) => return Ok(outcome),
            };
            let outcome = match handler.handle(transaction, vec![envelope]).await {
                Ok(answer) => answer
                    .into_outcomes(1)
                    .and_then(|mut outcomes| outcomes.pop())
                    .unwrap_or_else(not_in_the_batch),
                Err(error) => error.into_outcome(),
            };
            Ok(outcome)
        })
    }
}
