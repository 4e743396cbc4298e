//! Batched acknowledgements: one `basic.ack` with `multiple` for a run of settled
//! deliveries, instead of one frame each.
//!
//! Why: each ack costs the consumer a trip through lapin's I/O thread and back, and costs
//! RabbitMQ a frame to read and a settlement to apply; the deliveries a batched record
//! commits together settle within microseconds of each other. Measured on the 2-core
//! machine (issue 25), batching raised the runner's rate by about half with no tiers and by
//! 12–25 % with the record, and cut RabbitMQ's CPU per message by a quarter to a half.
//!
//! Safety, in order of what could go wrong:
//! - A `multiple` ack settles *every* unacked delivery of the channel up to its tag, so the
//!   book only batches on a channel the runner opened itself (no other consumer, tags from
//!   1), and only over a run of *consecutive* tags all registered and all settled: it never
//!   passes a delivery still running, one rejected back to the queue but not yet rejected,
//!   or a tag it never saw (still in lapin's buffer).
//! - Acks go out in the order the book decides them (one sender at a time), and a
//!   `multiple` ack names the highest tag of its run still unacked: RabbitMQ closes the
//!   channel on an ack of a tag it no longer holds.
//! - A delivery settled behind one still running waits about [`HOLD`] for the run to reach
//!   it, then is acked alone: one slow delivery never holds the others' acks (and so the
//!   prefetch window) for longer than that. Its task ends only once its ack is written, as
//!   before.
//! - The book changes before any `.await`, so a settlement cut off at shutdown leaves it
//!   true.
//! - The book stops batching for the rest of the channel (every ack alone, as before) when
//!   a tag comes again or below its floor (lapin's recovery numbers from 1), a `multiple`
//!   ack fails, or it grows past four times the prefetch behind a delivery that never
//!   settles.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use lapin::Channel;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::BasicAckOptions;
use lapin::types::DeliveryTag;
use tokio::sync::watch;

/// How long a delivery settled behind one still running waits for a `multiple` ack to cover
/// it before it is acked alone: long enough for the rest of its batch to settle, short
/// enough that a slow delivery does not hold the prefetch window.
pub(crate) const HOLD: Duration = Duration::from_millis(5);

/// Where a registered delivery stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Taken from the channel, not settled yet: no `multiple` ack may pass it.
    Open,
    /// The stack answered and the delivery is to be acked.
    ToAck,
    /// Settled with the broker already, or as good as: acked alone (its frame queued), or
    /// rejected (its frame written, or the channel void): a `multiple` ack may pass.
    Settled,
}

/// The book of one channel's deliveries, in tag order.
#[derive(Debug)]
struct Book {
    entries: BTreeMap<DeliveryTag, Entry>,
    /// Every tag at or below it is settled, or has its ack queued in lapin.
    floor: DeliveryTag,
    /// The highest tag a `multiple` ack was queued for.
    queued: DeliveryTag,
    /// Batching stopped: the channel started again, a `multiple` ack failed, or the book
    /// grew past its bound behind a delivery that does not settle. Every ack is then sent
    /// alone.
    stopped: bool,
    /// The most entries the book holds before it stops batching.
    bound: usize,
}

/// The acks of one channel: batched on a channel the runner owns, one by one otherwise.
#[derive(Debug)]
pub(crate) struct Acks {
    book: Option<Batching>,
}

#[derive(Debug)]
struct Batching {
    book: Mutex<Book>,
    /// Held while a frame is decided and queued: acks leave in the book's order (rejects
    /// go beside them, safely: their entry stays open until their frame is written).
    sending: tokio::sync::Mutex<()>,
    /// The highest tag a `multiple` ack settled, once lapin wrote it: deliveries waiting
    /// to be covered watch it.
    acked: watch::Sender<DeliveryTag>,
}

impl Acks {
    /// Acks for a channel the runner opened itself (`owned`) and consumes with `prefetch`,
    /// batched; one by one for a channel someone else may also consume on.
    pub(crate) fn new(owned: bool, prefetch: u16) -> Self {
        let book = owned.then(|| Batching {
            book: Mutex::new(Book {
                entries: BTreeMap::new(),
                floor: 0,
                queued: 0,
                stopped: false,
                // Unsettled deliveries are at most the prefetch (and the suspect being got);
                // settled ones pile up only behind one that never settles.
                bound: 4 * usize::from(prefetch.max(1)),
            }),
            sending: tokio::sync::Mutex::new(()),
            acked: watch::Sender::new(0),
        });
        Acks { book }
    }

    /// Registers a delivery just taken from the channel (consumed or got): until it is
    /// settled no `multiple` ack passes it.
    pub(crate) fn taken(&self, delivery: &AmqpDelivery) {
        let Some(batching) = &self.book else { return };
        let mut book = batching.lock();
        let tag = delivery.delivery_tag;
        if tag <= book.floor || book.entries.contains_key(&tag) || book.entries.len() >= book.bound {
            // Numbered again from 1 (a recovered channel, whose old deliveries are void),
            // or a delivery below holds the book back for good.
            book.stop();
        }
        if !book.stopped {
            book.entries.insert(tag, Entry::Open);
        }
    }

    /// Notes that `delivery` was settled without an ack (rejected back to its queue, the
    /// frame written): a `multiple` ack may now pass it.
    pub(crate) fn settled_otherwise(&self, delivery: &AmqpDelivery) {
        if let Some(batching) = &self.book {
            batching.mark(delivery.delivery_tag, Entry::Settled);
        }
    }

    /// Acks `delivery`: with the run of settled deliveries it completes, or, when one below
    /// it still runs, alone after about [`HOLD`] (plus the wait for the frames queued
    /// before it). Returns once its ack is written.
    pub(crate) async fn ack(&self, channel: &Channel, delivery: &AmqpDelivery) -> Result<(), lapin::Error> {
        let tag = delivery.delivery_tag;
        let Some(batching) = &self.book else {
            return ack_alone(delivery).await;
        };
        if !batching.mark(tag, Entry::ToAck) {
            return ack_alone(delivery).await;
        }
        let mut acked = batching.acked.subscribe();
        if let Err(error) = batching.send_run(channel, delivery).await {
            // Another delivery's run may have covered this one before this call sent the
            // next run, which failed.
            return match *acked.borrow() >= tag {
                true => Ok(()),
                false => Err(error),
            };
        }
        if tokio::time::timeout(HOLD, acked.wait_for(|acked| *acked >= tag))
            .await
            .is_ok_and(|covered| covered.is_ok())
        {
            return Ok(());
        }
        batching.ack_alone_unless_covered(delivery).await
    }
}

impl Book {
    /// Stops batching for the rest of the channel; every ack is sent alone from now on.
    fn stop(&mut self) {
        self.stopped = true;
        self.entries.clear();
    }
}

impl Batching {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        // A panic under this lock leaves the book as consistent as before it: entries
        // change one at a time.
        self.book.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets `tag`'s entry; false when the book does not hold it (never registered, or
    /// batching stopped).
    fn mark(&self, tag: DeliveryTag, entry: Entry) -> bool {
        let mut book = self.lock();
        match book.entries.get_mut(&tag) {
            Some(current) => {
                *current = entry;
                true
            }
            None => false,
        }
    }

    /// Sends one `multiple` ack for the run of settled deliveries right above the floor, if
    /// it holds one to ack, and raises the floor.
    ///
    /// The book changes before the first `.await`, and lapin queues the frame at the
    /// ack's first poll: a caller cut off here (a shutdown's grace) leaves the book true.
    async fn send_run(&self, channel: &Channel, delivery: &AmqpDelivery) -> Result<(), lapin::Error> {
        let _sending = self.sending.lock().await;
        // The ack names the run's highest delivery *to ack*: RabbitMQ refuses a tag it no
        // longer holds unacked (one acked alone or rejected), and closes the channel.
        let to_ack = {
            let mut book = self.lock();
            if book.stopped {
                return Ok(());
            }
            let mut to_ack = None;
            let mut floor = book.floor;
            while let Some(entry) = book.entries.first_entry() {
                if *entry.key() != floor + 1 || *entry.get() == Entry::Open {
                    break;
                }
                let (tag, entry) = entry.remove_entry();
                if entry == Entry::ToAck {
                    to_ack = Some(tag);
                }
                floor = tag;
            }
            book.floor = floor;
            let Some(to_ack) = to_ack else { return Ok(()) };
            // Lapin voids every acker of a channel that ended (or recovered under new
            // tags), so this delivery's acker stands for the whole run: a void channel
            // takes no `multiple` ack, which would settle the new life's deliveries.
            if delivery.acker.poisoned() {
                book.stop();
                return Ok(());
            }
            book.queued = to_ack;
            to_ack
        };
        let sent = channel
            .basic_ack(to_ack, BasicAckOptions { multiple: true })
            .await;
        match sent {
            Ok(()) => {
                self.acked.send_replace(to_ack);
                Ok(())
            }
            Err(error) => {
                self.lock().stop();
                Err(error)
            }
        }
    }

    /// Acks `delivery` alone unless a `multiple` ack covered it meanwhile.
    async fn ack_alone_unless_covered(&self, delivery: &AmqpDelivery) -> Result<(), lapin::Error> {
        let _sending = self.sending.lock().await;
        let tag = delivery.delivery_tag;
        let still_to_ack = {
            let mut book = self.lock();
            match book.entries.get_mut(&tag) {
                // Marked before the frame is queued, so that a caller cut off after it
                // queued leaves no `ToAck` for a later run to name.
                Some(entry) if *entry == Entry::ToAck => {
                    *entry = Entry::Settled;
                    true
                }
                Some(_) => false,
                // Gone: covered by a run, or the book stopped (then acked alone unless a
                // run's ack was queued for it).
                None => book.stopped && book.queued < tag,
            }
        };
        match still_to_ack {
            true => ack_alone(delivery).await,
            false => Ok(()),
        }
    }
}

/// The plain ack of one delivery, through its own acker (which lapin voids when the channel
/// ends).
async fn ack_alone(delivery: &AmqpDelivery) -> Result<(), lapin::Error> {
    delivery.acker.ack(BasicAckOptions::default()).await?;
    Ok(())
}
