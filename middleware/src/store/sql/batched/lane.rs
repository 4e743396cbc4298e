//! The lanes of the batched mode: each runs one transaction at a time and fills it with the
//! deliveries that wait while it is open.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::TransactionalRecord;
use super::traffic::{Traffic, answer_from_commit};
use crate::envelope::{BusinessKey, Envelope};
use crate::fingerprint::Fingerprint;
use crate::outcome::{Outcome, RetryReason};
use crate::record::Begin;
use crate::store::sql::{ClaimRequest, claim_request};
use crate::tier::{Tier, store_unavailable};

/// How big and how long a batch may grow, and how many run at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub(super) max_batch: usize,
    pub(super) max_linger: Duration,
    pub(super) lanes: usize,
}

/// One delivery waiting to join a batch, with what its batch's [`Writer`] needs of it
/// besides its envelope (`W`: its handler's run, for per-delivery handlers).
pub(super) struct Joiner<W> {
    pub(super) request: ClaimRequest,
    pub(super) envelope: Envelope,
    pub(super) work: W,
    pub(super) reply: oneshot::Sender<Word>,
}

/// What a lane tells a delivery.
pub(super) enum Word {
    /// Its handler ran in the batch and answered this: the batch committed, or the failure
    /// is its own and nothing of the batch was committed.
    Ran(Outcome),
    /// Its answer without its handler running: a duplicate, a conflict, a failed store.
    Answer(Outcome),
    /// Join another batch: its batch was rolled back for another delivery's failure, which
    /// is out of the way now, and nothing suggests this one would fail.
    Again,
    /// Run again alone, in a transaction of its own: its handler may be what failed its
    /// batch, or the batch failed in a way that tells nobody's fault apart (a claim lost to
    /// another transaction, a commit that failed or went unanswered).
    Alone,
}

/// How often a delivery joins another batch after its batch was rolled back for another's
/// failure, before it runs alone. A batch failed by a handler sends that delivery alone or
/// answers its failure, so rejoining costs its neighbours a handler run in a batch rather
/// than a transaction each. The bound is for a handler that fails others and not itself
/// (on PostgreSQL one that swallows a failed statement: the next handler fails), and keeps
/// a delivery's runs few within a timeout in front.
pub(super) const MAX_REJOINS: usize = 2;

/// How a delivery's part in a batch ended, as far as the batch can tell.
pub(super) enum Part {
    /// Its handler answered this: a success, or a failure that is its own (no handler ran
    /// before it in the transaction).
    Answered(Outcome),
    /// Its handler did not run: the batch failed before its turn.
    NotRun,
    /// Its handler failed where the failure may be another's doing (after another handler,
    /// or a set handler failing as a whole): it runs alone, where only its own doing counts.
    Suspect,
    /// Its delivery was given up before its handler ran (its future was dropped, an HTTP
    /// client hung up while it waited, a token expired): its claim is withdrawn in the
    /// batch's transaction, and the rest of the batch commits without it. With the answer
    /// its run gave (`NotRun`), told once the batch ended, if anyone still waits.
    Gone(Option<Outcome>),
}

/// How one claimed delivery's handler ended in a batch.
pub(super) struct Ended {
    pub(super) request: ClaimRequest,
    /// Where its last word goes.
    pub(super) reply: oneshot::Sender<Word>,
    pub(super) part: Part,
}

impl Ended {
    pub(super) fn of<W>(joiner: Joiner<W>, part: Part) -> Self {
        Ended {
            request: joiner.request,
            reply: joiner.reply,
            part,
        }
    }

    /// Whether this delivery's part of the batch can commit.
    fn succeeded(&self) -> bool {
        matches!(&self.part, Part::Answered(outcome) if outcome.is_settled())
    }

    /// Whether this delivery went away before its handler ran.
    fn gone(&self) -> bool {
        matches!(self.part, Part::Gone(_))
    }
}

/// What a batch's handlers did.
pub(super) struct Written {
    pub(super) ended: Vec<Ended>,
    /// A handler may have left a statement running on the connection (its future was
    /// dropped or panicked mid-statement): the connection is closed rather than rolled back,
    /// which also cancels the statement.
    pub(super) tainted: bool,
}

/// How a batch's effects are written: the per-delivery handlers one after another, or a set
/// handler once for all — on the lane's task, through the transaction's handle `H`.
pub(super) trait Writer<H>: Send + Sync + 'static {
    /// What a delivery brings to its batch besides its envelope: its handler's run (nothing,
    /// for a set handler).
    type Work: Send + 'static;

    /// Runs the handlers of `group`, whose keys the batch's transaction has just claimed.
    /// `first`: no handler ran in the transaction before this group. A failure a handler
    /// answers is its own only then — after another handler, it may be that one's doing (on
    /// PostgreSQL a swallowed failed statement aborts the transaction, and the next one
    /// fails); such a delivery is a [`Part::Suspect`], and runs again alone. `group` is
    /// never empty.
    fn write(
        &self,
        transaction: &H,
        group: Vec<Joiner<Self::Work>>,
        first: bool,
    ) -> impl Future<Output = Written> + Send;
}

/// The lanes of one layer, shared by its services' clones. They start on the Tokio runtime
/// of the first delivery and stop once every clone is dropped and they are idle.
pub(super) struct Lanes<R: TransactionalRecord, W: Writer<R::Handle>> {
    record: R,
    writer: W,
    limits: Limits,
    queue: OnceLock<mpsc::Sender<Joiner<W::Work>>>,
}

/// Shows the record the batches are made of, as every tier shows its decision.
impl<R: TransactionalRecord, W: Writer<R::Handle>> std::fmt::Debug for Lanes<R, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("record", &self.record)
            .finish_non_exhaustive()
    }
}

impl<R: TransactionalRecord, W: Writer<R::Handle> + Clone> Lanes<R, W> {
    pub(super) fn new(record: R, writer: W, limits: Limits) -> Self {
        Lanes {
            record,
            writer,
            limits,
            queue: OnceLock::new(),
        }
    }

    /// The per-delivery transactional tier the batches are made of: how a delivery runs alone.
    pub(super) fn record(&self) -> &R {
        &self.record
    }

    /// How the batches write their effects.
    pub(super) fn writer(&self) -> &W {
        &self.writer
    }

    fn queue(&self) -> &mpsc::Sender<Joiner<W::Work>> {
        self.queue.get_or_init(|| {
            // Room for a batch per lane: beyond that, deliveries wait to join, which bounds
            // memory under overload.
            let (queue, receiver) = mpsc::channel(self.limits.max_batch * self.limits.lanes);
            let lane = Arc::new(Lane {
                record: self.record.clone(),
                writer: self.writer.clone(),
                limits: self.limits,
                receiver: Mutex::new(receiver),
                traffic: Traffic::default(),
            });
            for _ in 0..self.limits.lanes {
                tokio::spawn(lane.clone().run());
            }
            queue
        })
    }

    /// Puts `envelope`, with `work`, into the next batch; answers the lane's word for it.
    /// When its batch is rolled back for another delivery's failure, it joins another with
    /// the work `again` makes, up to [`MAX_REJOINS`] times; past that it answers the last
    /// [`Word::Again`], and the delivery runs alone.
    pub(super) async fn join<F>(
        &self,
        envelope: &Envelope,
        work: W::Work,
        mut again: impl FnMut() -> F,
    ) -> Word
    where
        F: Future<Output = Result<W::Work, Outcome>>,
    {
        let mut word = self.join_once(envelope, work).await;
        for _ in 0..MAX_REJOINS {
            let Word::Again = word else {
                return word;
            };
            word = match again().await {
                Ok(work) => self.join_once(envelope, work).await,
                Err(outcome) => Word::Answer(outcome),
            };
        }
        word
    }

    async fn join_once(&self, envelope: &Envelope, work: W::Work) -> Word {
        let (reply, word) = oneshot::channel();
        let joiner = Joiner {
            request: claim_request(envelope),
            envelope: envelope.clone(),
            work,
            reply,
        };
        let stopped = || {
            Word::Answer(Outcome::retry_later(
                RetryReason::StoreUnavailable(Tier::Record),
                "the batched record's lanes stopped (the runtime is shutting down)",
                None,
            ))
        };
        if self.queue().send(joiner).await.is_err() {
            return stopped();
        }
        word.await.unwrap_or_else(|_| stopped())
    }
}

/// What every lane of one layer shares.
struct Lane<R: TransactionalRecord, W: Writer<R::Handle>> {
    record: R,
    writer: W,
    limits: Limits,
    /// Idle lanes wait here for the first delivery of their next batch; a busy lane only
    /// takes what is already waiting.
    receiver: Mutex<mpsc::Receiver<Joiner<W::Work>>>,
    /// The keys the open batches hold, and how many are open.
    traffic: Traffic<W::Work>,
}

/// How a batch's transaction ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    Commit,
    Rollback,
    /// Closing the connection: the server rolls back and cancels what still runs.
    Close,
}

impl<R: TransactionalRecord, W: Writer<R::Handle>> Lane<R, W> {
    async fn run(self: Arc<Self>) {
        let mut later = Vec::new();
        loop {
            let intake = if later.is_empty() {
                let mut receiver = self.receiver.lock().await;
                let Some(first) = receiver.recv().await else {
                    return;
                };
                // Deliveries that arrive together (a broker's batch, sent in one go) may still
                // be on their way from another thread: one turn of the scheduler lets them
                // land in this batch. Not a timer: a lone delivery waits microseconds.
                tokio::task::yield_now().await;
                let mut intake = vec![first];
                take_waiting(&mut receiver, &mut intake, self.limits.max_batch);
                self.fill_while_others_commit(&mut receiver, &mut intake).await;
                intake
            } else {
                let mut intake = std::mem::take(&mut later);
                if let Ok(mut receiver) = self.receiver.try_lock() {
                    take_waiting(&mut receiver, &mut intake, self.limits.max_batch);
                }
                intake
            };
            // A bug of this lane's (or a set handler panicking before its first await) must
            // not stop it: the batch's deliveries are answered "lanes stopped" (a retry), its
            // connection is closed, and the lane goes on.
            if AssertUnwindSafe(self.batch(intake)).catch_unwind().await.is_err() {
                tracing::error!("a batched record lane panicked; its batch is retried");
            }
            // Copies released by this batch's end that no collecting lane took.
            later = self.traffic.take_released(self.limits.max_batch);
        }
    }

    /// Keeps taking deliveries into `intake` while another lane has a batch open, until one
    /// ends, the batch is full or [`Limits::max_linger`] has passed (a batch that never ends
    /// must not hold the others back); returns at once when no batch is open.
    ///
    /// Nagle's rule, for transactions: while the database is busy with a commit, another
    /// transaction started for the one delivery that just arrived would pay a `BEGIN`, a
    /// claim and a commit for it alone (fed by a broker, batches held 4 or 5 deliveries).
    /// Waiting for a commit to end costs nothing when the server is the bottleneck, and makes
    /// the next batch hold what arrived meanwhile. A lone delivery, with no batch open,
    /// starts at once.
    async fn fill_while_others_commit(
        &self,
        receiver: &mut mpsc::Receiver<Joiner<W::Work>>,
        intake: &mut Vec<Joiner<W::Work>>,
    ) {
        let deadline = tokio::time::Instant::now() + self.limits.max_linger;
        let ends = self.traffic.ends();
        while intake.len() < self.limits.max_batch {
            let ended = self.traffic.batch_ended();
            tokio::pin!(ended);
            // Registered before the counts are read: an end in between still wakes this lane.
            ended.as_mut().enable();
            if self.traffic.open_batches() == 0 || self.traffic.ends() != ends {
                return;
            }
            tokio::select! {
                biased;
                () = &mut ended => {
                    // The copies that batch released join this one.
                    let room = self.limits.max_batch.saturating_sub(intake.len());
                    intake.extend(self.traffic.take_released(room));
                    return;
                }
                joiner = receiver.recv() => match joiner {
                    Some(joiner) => {
                        intake.push(joiner);
                        take_waiting(receiver, intake, self.limits.max_batch);
                    }
                    None => return,
                },
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Runs one transaction: claims `intake`, runs the handlers, takes in the deliveries that
    /// arrived meanwhile while the batch is within its limits, then commits — or rolls back
    /// and sends the deliveries whose handlers did not fail to another batch, and the
    /// suspects to run alone. Releases the copies of its keys that arrived while it was open
    /// (see [`Traffic`]) once it has ended: a statement cannot claim a key twice, and a copy
    /// must see what the first copy's commit left.
    async fn batch(&self, intake: Vec<Joiner<W::Work>>) {
        let opened = Instant::now();
        let mut holding = self.traffic.open_batch();
        let fresh = holding.take(intake);
        if fresh.is_empty() {
            // Only copies, or deliveries already gone: no transaction to open for them.
            return holding.release(Some);
        }
        let requests: Vec<ClaimRequest> = fresh.iter().map(|joiner| joiner.request.clone()).collect();
        let (mut transaction, answers) = match self.record.open(&requests).await {
            Ok(opened) => opened,
            // Another lane's joiners locked keys in another order, and the server broke the
            // deadlock by failing this claim (or, on MySQL, it waited past the lock wait
            // timeout): nothing is wrong with the store or the deliveries, which run alone
            // rather than meet the same keys in another batch.
            Err(error) if R::lost_to_another_transaction(&error) => {
                tracing::debug!(%error, "a batch lost its claim to another transaction; its deliveries run alone");
                for joiner in fresh {
                    let _ = joiner.reply.send(Word::Alone);
                }
                return holding.release(Some);
            }
            Err(error) => {
                answer_all(fresh, &store_unavailable(Tier::Record, &error));
                return holding.release(Some);
            }
        };
        let mut group = self.admit(fresh, answers);
        let mut ended = Vec::new();
        let mut ending;
        loop {
            ending = self.write_group(&transaction, group, &mut ended).await;
            if ending != Ending::Commit || opened.elapsed() >= self.limits.max_linger {
                break;
            }
            let mut intake = Vec::new();
            if let Ok(mut receiver) = self.receiver.try_lock() {
                take_waiting(
                    &mut receiver,
                    &mut intake,
                    self.limits.max_batch.saturating_sub(holding.len()),
                );
            }
            let fresh = holding.take(intake);
            if fresh.is_empty() {
                break;
            }
            let requests: Vec<ClaimRequest> = fresh.iter().map(|joiner| joiner.request.clone()).collect();
            match self.record.claim_more(&mut transaction, &requests).await {
                Ok(answers) => {
                    group = self.admit(fresh, answers);
                }
                Err(error) => {
                    // The transaction is aborted (a deadlock with another lane, a lost
                    // connection, a failed statement a handler swallowed): whose doing it
                    // was is unknown, and everyone runs alone, which also tells a store
                    // that is down.
                    match R::lost_to_another_transaction(&error) {
                        true => {
                            tracing::debug!(%error, "a batch lost its joiners' claims to another transaction; everyone runs alone")
                        }
                        false => {
                            tracing::debug!(%error, "a batch could not claim its joiners; everyone runs alone")
                        }
                    }
                    for joiner in fresh {
                        let _ = joiner.reply.send(Word::Alone);
                    }
                    ended.iter_mut().for_each(|ended| ended.part = Part::Suspect);
                    ending = Ending::Rollback;
                    break;
                }
            }
        }
        let done = self.settle(transaction, ended, ending).await;
        let delay = self.record.in_flight_delay();
        holding.release(|copy| answer_from_commit(copy, &done, delay));
    }

    /// Runs the handlers of `group` in `transaction`, adding how each ended to `ended`;
    /// answers how the batch must end so far.
    async fn write_group(
        &self,
        transaction: &R::Open,
        group: Vec<Joiner<W::Work>>,
        ended: &mut Vec<Ended>,
    ) -> Ending {
        // Deliveries gone ran no handler: they do not make a later one's failure suspect.
        let first = ended.iter().all(Ended::gone);
        let before = ended.len();
        // A group the claims left empty (copies, keys done elsewhere) has nothing to write:
        // a set handler is never called with an empty batch.
        if group.is_empty() {
            return Ending::Commit;
        }
        let handle = R::handle(transaction);
        let written = self.writer.write(&handle, group, first).await;
        drop(handle);
        let failed = written
            .ended
            .iter()
            .any(|ended| !ended.succeeded() && !ended.gone());
        ended.extend(written.ended);
        if written.tainted {
            return Ending::Close;
        }
        // Deliveries gone before their turn: their keys were claimed with the others', and
        // must not commit as done without their handlers. Withdrawn in the transaction, the
        // rest commits; should that fail, everyone runs again alone.
        let gone: Vec<ClaimRequest> = ended[before..]
            .iter()
            .filter(|ended| ended.gone())
            .map(|ended| ended.request.clone())
            .collect();
        if !failed
            && !gone.is_empty()
            && let Err(error) = self.record.withdraw(transaction, &gone).await
        {
            // On MySQL the withdrawal's deletes take gap locks, which another lane's claims can
            // deadlock with: the server's verdict, told apart from a failed store.
            match R::lost_to_another_transaction(&error) {
                true => {
                    tracing::debug!(%error, "a batch lost its withdrawal of deliveries gone to another transaction; its deliveries run alone")
                }
                false => {
                    tracing::debug!(%error, "a batch could not withdraw the claims of deliveries gone; its deliveries run alone")
                }
            }
            ended
                .iter_mut()
                .filter(|ended| !ended.gone())
                .for_each(|ended| ended.part = Part::Suspect);
            return Ending::Rollback;
        }
        // A statement failed that no handler answered for (MySQL carries on past one): the
        // batch cannot commit — now, rather than after more handlers and joiners. The one
        // handler of the transaction answers for it. Otherwise one of this group's handlers
        // that answered success swallowed it (the earlier groups' were checked): they run
        // alone, where the one that did fails on its own.
        let doomed = R::doomed(transaction);
        if let Some(failure) = &doomed {
            let group = &mut ended[before..];
            let alone = first && group.iter().filter(|ended| !ended.gone()).count() == 1;
            for ended in group.iter_mut().filter(|ended| ended.succeeded()) {
                ended.part = match alone {
                    true => Part::Answered(Outcome::retry_later(
                        RetryReason::HandlerFailed,
                        format!("a statement of the handler failed, although it answered success: {failure}"),
                        None,
                    )),
                    false => Part::Suspect,
                };
            }
        }
        match failed || doomed.is_some() {
            true => Ending::Rollback,
            false => Ending::Commit,
        }
    }

    /// Answers the deliveries the claim did not give the key to (duplicates, conflicts,
    /// fenced, in flight elsewhere) at once: what decided it was committed by others. Returns
    /// the claimed ones.
    fn admit(&self, fresh: Vec<Joiner<W::Work>>, answers: Vec<Begin>) -> Vec<Joiner<W::Work>> {
        let mut claimed = Vec::with_capacity(fresh.len());
        for (joiner, begin) in fresh.into_iter().zip(answers) {
            let request = &joiner.request;
            match begin.into_attempt(&request.key, request.fingerprint, self.record.in_flight_delay()) {
                Ok(_) => claimed.push(joiner),
                Err(stop) => {
                    let _ = joiner.reply.send(Word::Answer(stop));
                }
            }
        }
        claimed
    }

    /// Ends the transaction and tells every delivery of the batch its last word. Answers the
    /// keys it committed, with the fingerprints they were claimed with.
    async fn settle(
        &self,
        transaction: R::Open,
        ended: Vec<Ended>,
        ending: Ending,
    ) -> HashMap<BusinessKey, Fingerprint> {
        // Deliveries gone are told their own answer, if anyone still waits for it, whatever
        // the batch did: nothing of theirs was in it.
        let (gone, mut ended): (Vec<Ended>, Vec<Ended>) = ended.into_iter().partition(Ended::gone);
        for gone in gone {
            if let Part::Gone(Some(outcome)) = gone.part {
                let _ = gone.reply.send(Word::Ran(outcome));
            }
        }
        let committed = match ending {
            Ending::Commit if ended.is_empty() => {
                self.record.roll_back(transaction).await;
                true
            }
            Ending::Commit => match self.record.commit(transaction).await {
                Ok(()) => true,
                // A batch of one failed to commit for its only delivery's sake (or nobody
                // knows whether it committed): it answers as it would alone.
                Err(failed) if ended.len() == 1 => {
                    ended[0].part = Part::Answered(failed);
                    false
                }
                // Why is unknown (a lost connection, a handler's own `COMMIT` failing the
                // tier's), and so is whether it committed: each runs alone, where a
                // committed one finds its key done.
                Err(failed) => {
                    tracing::warn!(deliveries = ended.len(), %failed, "a batch did not commit; its deliveries run again alone");
                    for ended in &mut ended {
                        ended.part = Part::Suspect;
                    }
                    false
                }
            },
            Ending::Rollback => {
                self.record.roll_back(transaction).await;
                false
            }
            Ending::Close => {
                self.record.close(transaction).await;
                false
            }
        };
        let counted = match (ending, committed) {
            // No `COMMIT` ran: every claim found its answer, or every delivery went away.
            (Ending::Commit, true) if ended.is_empty() => "empty",
            (_, true) => "committed",
            (_, false) => "rolled_back",
        };
        crate::telemetry::count_batch(ended.len(), counted);
        let mut failures = Vec::new();
        let mut done = HashMap::new();
        for ended in ended {
            match ended.part {
                Part::Answered(outcome) if committed => {
                    done.insert(ended.request.key, ended.request.fingerprint);
                    let _ = ended.reply.send(Word::Ran(outcome));
                }
                Part::Answered(outcome) if !outcome.is_settled() => {
                    failures.push((ended.request, ended.reply, outcome))
                }
                Part::Answered(_) | Part::NotRun => {
                    let _ = ended.reply.send(Word::Again);
                }
                Part::Suspect => {
                    let _ = ended.reply.send(Word::Alone);
                }
                Part::Gone(_) => {}
            }
        }
        for (request, reply, outcome) in failures {
            self.record.note_failure(&request, &outcome.to_string()).await;
            let _ = reply.send(Word::Ran(outcome));
        }
        done
    }
}

/// Moves up to `room` waiting deliveries into `intake`, without waiting for more.
fn take_waiting<W>(receiver: &mut mpsc::Receiver<Joiner<W>>, intake: &mut Vec<Joiner<W>>, room: usize) {
    while intake.len() < room {
        match receiver.try_recv() {
            Ok(joiner) => intake.push(joiner),
            Err(_) => break,
        }
    }
}

fn answer_all<W>(joiners: Vec<Joiner<W>>, outcome: &Outcome) {
    for joiner in joiners {
        let _ = joiner.reply.send(Word::Answer(outcome.clone()));
    }
}
