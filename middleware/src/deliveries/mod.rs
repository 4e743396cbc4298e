//! Counting unsettled deliveries, for brokers that do not: finds a message that kills its
//! consumer process every time (OOM, abort, SIGKILL, a fault in a C library).
//!
//! A crash never reaches the stack, so no attempt counter sees it: the broker just delivers
//! the message again. RabbitMQ's quorum queues count such redeliveries themselves (the AMQP
//! adapter uses `x-delivery-count`). RocketMQ's client does not — as far as its code shows, a consumer that dies
//! before committing its offset gets the message again with the same reconsume times — so its
//! adapter, and any other, can ask the [`Route`](crate::Route) to count with
//! [`Route::with_delivery_limit`](crate::Route::with_delivery_limit):
//!
//! - before the stack runs, the key's *unsettled starts* are read: a key that started
//!   before and never settled is a **suspect**;
//! - a suspect runs alone in the process: it waits for the deliveries running on the route
//!   and holds back new ones, so a crash while it runs is counted against it and not
//!   against every delivery that happened to run beside it (one that is merely caught in
//!   another's crash is counted once, then runs alone and settles);
//! - a delivery running among others only *marks* its key (a count of 1 if it has none:
//!   copies of one key that run at once leave one mark); a suspect's start is counted; the
//!   stack runs, and whatever it answers, the count is cleared — an answered delivery was
//!   not a crash — except a wait (another delivery holds the key, such as the dead
//!   consumer's flag claim or lock, until its lease runs out): a wait ran nothing, so a
//!   suspect takes back only its own start and leaves the crashes counted, and a mark stays
//!   for whoever holds the key to clear;
//! - a key is dead-lettered ([`DeadLetterReason::DeliveryLimit`]) without running again
//!   once it crashed `max` times as a suspect, running alone: its mark and `max` counted
//!   starts. Its runs among others are not counted against it, since their crashes may be
//!   another message's — with a limit of 1, a message caught in another's crash would
//!   otherwise be dead-lettered for it. A message that kills its consumer every time
//!   therefore runs `max + 1` times (more only if copies of it run at once).
//!
//! "Alone" is per route: a suspect holds back the deliveries of its own route, not other
//! routes in the same process, so a crash a route beside it causes is counted against it.
//! Give a process that consumes with a delivery limit one route per process, or the same
//! limit to every route.
//!
//! Counting fails open: when the store cannot answer, the delivery runs uncounted, since the
//! guard only bounds a rare loop and must not stop every delivery while Redis is down.
//! Costs three store round trips per delivery (read, count, clear).

mod store;

use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "memory")]
pub use crate::store::memory::deliveries::MemoryDeliveryCounter;
#[cfg(feature = "redis")]
pub use crate::store::redis::deliveries::RedisDeliveryCounter;
pub use store::DeliveryCounter;
use tokio::sync::RwLock;

use crate::dead_letter::DeadLetterReason;
use crate::envelope::BusinessKey;
use crate::outcome::Outcome;

/// How long an unsettled count is kept: longer than any redelivery takes to come back.
pub(crate) const COUNT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The route's guard: its counter, its limit, and the lock that lets a suspect run alone
/// (deliveries share it; a suspect takes it exclusively).
#[derive(Clone)]
pub(crate) struct DeliveryLimit {
    counter: Arc<dyn DeliveryCounter>,
    max: u32,
    running: Arc<RwLock<()>>,
}

impl DeliveryLimit {
    pub(crate) fn new(counter: impl DeliveryCounter, max: u32) -> Self {
        DeliveryLimit {
            counter: Arc::new(counter),
            max: max.max(1),
            running: Arc::default(),
        }
    }

    /// Runs `handle` for `key` under the guard (see the module docs).
    pub(crate) async fn run(&self, key: &BusinessKey, handle: impl AsyncFnOnce() -> Outcome) -> Outcome {
        let unsettled = match self.counter.unsettled(key).await {
            Ok(unsettled) => unsettled,
            Err(error) => {
                tracing::warn!(%key, %error, "delivery counter failed; running uncounted");
                return handle().await;
            }
        };
        // A marked key (it started and never settled) is a suspect: it runs alone.
        let alone = unsettled > 0;
        // Held until the stack has answered.
        let (_shared, _alone) = match alone {
            false => (Some(self.running.read().await), None),
            true => (None, Some(self.running.write().await)),
        };
        // The count is the mark its runs among others left, plus its crashes alone: only
        // those are this key's own.
        let crashed_alone = unsettled.saturating_sub(1);
        if crashed_alone >= self.max {
            return Outcome::dead_letter(
                DeadLetterReason::DeliveryLimit,
                format!(
                    "crashed its consumer {crashed_alone} times running alone, after a crash among others"
                ),
            );
        }
        let counted = match alone {
            true => self.counter.start(key, COUNT_TTL).await,
            false => self.counter.mark(key, COUNT_TTL).await,
        };
        if let Err(error) = counted {
            tracing::warn!(%key, %error, "delivery counter failed; running uncounted");
        }
        let outcome = handle().await;
        // A wait (another delivery holds the key, e.g. the dead one's lease) ran nothing: a
        // suspect takes back only its own start and leaves the crashes counted; a mark stays
        // for the holder to clear (or, if the holder died, to make the next copy a suspect).
        let cleared = match outcome.retry_reason() {
            Some(reason) if reason.is_wait() && alone => self.counter.release(key).await,
            Some(reason) if reason.is_wait() => Ok(()),
            _ => self.counter.settle(key).await,
        };
        if let Err(error) = cleared {
            tracing::warn!(%key, %error, "delivery counter failed to clear; the count expires");
        }
        outcome
    }
}

impl std::fmt::Debug for DeliveryLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryLimit")
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}
