//! The batched mode with per-delivery handlers: each delivery's handler runs in turn on the
//! lane's task, inside the batch's transaction.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::task::Poll;

use futures_util::FutureExt;
use tower_service::Service;
use tracing::Instrument;

use super::TransactionalRecord;
use super::lane::{Ended, Joiner, Lanes, Part, Word, Writer, Written};
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::outcome::{Outcome, RetryReason};
use crate::route::panicked;
use crate::telemetry::Probe;
use crate::tier::{BoxFuture, Tier, TierRun, TierService, behind, decide};

/// One delivery's handler, ready to run in the batch's transaction, given its handle `H`.
pub(super) type HandlerRun<H> = Box<dyn FnOnce(H) -> BoxFuture<Outcome> + Send>;

/// Runs the group's handlers one after another, on the lane's own task (no hand-over
/// between tasks per delivery), and stops at the first that fails: the batch is rolled back
/// then, and the rest never ran. One at a time, each handler sees its predecessors' writes,
/// as it would after their commits: read-modify-write handlers stay correct. A delivery
/// whose future goes away (a timeout in front, a shutdown) while its handler runs cuts the
/// handler off there, as on its own task.
#[derive(Clone, Copy, Debug)]
pub(super) struct Turns;

impl<H: Clone + Send + Sync + 'static> Writer<H> for Turns {
    type Work = HandlerRun<H>;

    async fn write(&self, transaction: &H, group: Vec<Joiner<HandlerRun<H>>>, first: bool) -> Written {
        let mut written = Written {
            ended: Vec::with_capacity(group.len()),
            tainted: false,
        };
        let mut failed = false;
        let mut first = first;
        for joiner in group {
            let Joiner {
                request,
                work,
                mut reply,
                ..
            } = joiner;
            if failed {
                written.ended.push(Ended {
                    request,
                    reply,
                    part: Part::NotRun,
                });
                continue;
            }
            // Gone before its turn: its key is claimed but its handler never ran. It is
            // taken out of the batch (its claim withdrawn); the others go on.
            if reply.is_closed() {
                written.ended.push(Ended {
                    request,
                    reply,
                    part: Part::Gone(None),
                });
                continue;
            }
            let mut run = std::pin::pin!(AssertUnwindSafe(work(transaction.clone())).catch_unwind());
            // A delivery given up before its handler started (its sender went away just now,
            // an expired token) answers `NotRun` on the run's first poll, having run nothing,
            // and is taken out of the batch like one gone before its turn — told its answer
            // once the batch ended, if anyone still waits for it. Only then: a run that
            // awaited anything may have written, and its `NotRun` is a failure like any other.
            let at_once = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
            if let Poll::Ready(Ok(Outcome::RetryLater(retry))) = &at_once
                && retry.reason == RetryReason::NotRun
            {
                let Poll::Ready(Ok(not_run)) = at_once else {
                    unreachable!("matched above")
                };
                written.ended.push(Ended {
                    request,
                    reply,
                    part: Part::Gone(Some(not_run)),
                });
                continue;
            }
            // A panic or a cut-off handler may leave a statement running: the connection is
            // closed, not rolled back.
            let outcome = match at_once {
                Poll::Ready(ran) => {
                    written.tainted |= ran.is_err();
                    Some(ran.unwrap_or_else(|panic| panicked(panic.as_ref())))
                }
                Poll::Pending => tokio::select! {
                    ran = run => {
                        written.tainted |= ran.is_err();
                        Some(ran.unwrap_or_else(|panic| panicked(panic.as_ref())))
                    }
                    () = reply.closed() => {
                        written.tainted = true;
                        None
                    }
                },
            };
            failed = !outcome.as_ref().is_some_and(Outcome::is_settled);
            // After another handler, a failure may be that one's doing (a failed statement
            // it swallowed aborts the transaction on PostgreSQL); a cut-off delivery is gone.
            let part = match outcome {
                Some(outcome) if first || !failed => Part::Answered(outcome),
                _ => Part::Suspect,
            };
            first = false;
            written.ended.push(Ended { request, reply, part });
        }
        written
    }
}

/// The batched transactional record `R` with the per-delivery handlers behind it (`S`);
/// built by [`BatchedLayer`](super::BatchedLayer), which says how it batches. A
/// [`TierService`] like every tier's: each delivery runs as its part in a batch.
pub type BatchedService<S, R> = TierService<S, BatchLanes<R>>;

/// The lanes of one [`BatchedService`], shared by its clones: what its [`TierService`] runs
/// for each delivery. Built only by [`BatchedLayer`](super::BatchedLayer).
pub struct BatchLanes<R: TransactionalRecord>(Lanes<R, Turns>);

impl<R: TransactionalRecord> BatchLanes<R> {
    pub(super) fn new(lanes: Lanes<R, Turns>) -> Self {
        BatchLanes(lanes)
    }
}

impl<R: TransactionalRecord> std::fmt::Debug for BatchLanes<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<R: TransactionalRecord> TierRun for BatchLanes<R> {
    const TIER: Tier = Tier::Record;

    async fn run<S>(&self, inner: S, envelope: Envelope, probe: &Probe) -> Outcome
    where
        S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        take_part(&self.0, inner, envelope, probe).await
    }
}

/// One delivery's part in a batch: join with its handler's run, answer the batch's verdict
/// — or join another batch, or run again alone, if the batch was rolled back for another's
/// failure.
async fn take_part<S, R>(lanes: &Lanes<R, Turns>, inner: S, envelope: Envelope, probe: &Probe) -> Outcome
where
    R: TransactionalRecord,
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    // The handler runs on the lane's task: it takes the delivery's span along, so that its
    // logs still name the route and the key.
    let span = tracing::Span::current();
    // The readied service goes with the batch: a later run takes a clone, readied anew.
    let fallback = inner.clone();
    let again = {
        let (template, envelope, span) = (inner.clone(), envelope.clone(), span.clone());
        move || {
            let (service, envelope, span) = (template.clone(), envelope.clone(), span.clone());
            async move {
                ready(service)
                    .await
                    .map(|service| handler_run(service, envelope, span))
            }
        }
    };
    let first = handler_run(inner, envelope.clone(), span);
    match lanes.join(&envelope, first, again).await {
        Word::Ran(outcome) => {
            probe.passed();
            outcome
        }
        Word::Answer(outcome) => outcome,
        Word::Again | Word::Alone => match ready(fallback).await {
            Ok(service) => decide(lanes.record(), service, envelope, probe).await,
            Err(outcome) => outcome,
        },
    }
}

/// The run of `service` on `envelope` in a batch's transaction, in the delivery's `span`.
fn handler_run<S, H>(service: S, mut envelope: Envelope, span: tracing::Span) -> HandlerRun<H>
where
    S: Service<Envelope, Response = Outcome> + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    H: Clone + Send + Sync + 'static,
{
    Box::new(move |transaction| {
        Box::pin(
            async move {
                envelope.extensions_mut().insert(transaction);
                behind(service, envelope).await
            }
            .instrument(span),
        )
    })
}

/// `service` once it is ready for a call.
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
