//! A listener's run report, and drain mode: knowing when a consumer group has consumed
//! everything, its retries included.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use oncely::report::{InFlight, RunReport, Tally};
use rocketmq_client_rust::{DefaultMQAdminExt, MQAdminReadExt};
use rocketmq_model::common::message::message_ext::MessageExt;

use crate::convert::unique_id;
use crate::error::Error;
use crate::runtime::OwnedClientRuntime;

/// What a listener ([`ConcurrentListener`](crate::ConcurrentListener),
/// [`OrderlyListener`](crate::OrderlyListener)) has done since it was made, shared with the
/// listener (cheap to clone): the counts of a [`RunReport`], the messages in flight, and the
/// messages it sent back for a retry that have not come back yet.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    tally: Tally,
    /// How many copies of each `UNIQ_KEY` were sent back (`ReconsumeLater`, a suspended
    /// orderly queue) and not seen again: the broker holds them in its schedule topic, where
    /// no offset shows them as pending for the group. Counted, not a set: two stored copies
    /// of one message (a producer's send retry) share the key.
    awaiting_retry: Arc<Mutex<HashMap<String, usize>>>,
}

impl Progress {
    /// The report so far.
    pub fn report(&self) -> RunReport {
        self.tally.report()
    }

    /// How many messages this listener sent back for a retry that have not come back yet.
    pub fn awaiting_retry(&self) -> usize {
        self.awaiting().values().sum()
    }

    /// Waits until the group is drained, then returns the report (marked `drained`):
    /// nothing in flight in this listener, nothing arrived for `idle`, none of the messages
    /// it sent back still awaited, and `lag` finds no message of the topic or the group's
    /// retry topic unconsumed, at two checks in a row.
    ///
    /// The consumer commits its offsets to the broker every 5 s (the client's persist
    /// interval): the lag lags by as much, so a drain ends 5–10 s after the last message at
    /// the earliest. Until the broker lists the group's queues of the topic (a new group
    /// before its first commit) the lag is unknown, and the group is not drained.
    ///
    /// Limits. Drain mode is for one consumer process per group: a retry comes back through
    /// the group's retry topic to whichever process holds its queue, so another process
    /// would wait for its sent-back messages forever. A message the broker moves to its own
    /// `%DLQ%` group after maxReconsumeTimes never comes back, and the drain then never
    /// ends: keep the route's maximum attempts at or below maxReconsumeTimes + 1, as the
    /// listeners' docs say. Messages the client sends back by itself without calling the
    /// listener (its listener lane full; see [`OwnedClientRuntime`]) and messages without a
    /// `UNIQ_KEY` (not sent by a RocketMQ producer) are not tracked while they wait in the
    /// broker's schedule.
    ///
    /// While the lag stays unknown — a topic mistyped or never sent to, a group that has
    /// not committed yet — it says so at warn every [`UNKNOWN_LAG_WARN_EVERY`], naming the
    /// topic and group it waits for.
    pub async fn wait_until_drained(&self, idle: Duration, lag: &GroupLag) -> RunReport {
        let warned = Mutex::new(None);
        let drained = || async {
            let pending = lag.pending().await;
            lag.warn_while_unknown(&pending, &mut lock(&warned));
            self.awaiting().is_empty() && matches!(pending, Ok(Some(0)))
        };
        self.tally.wait_until_drained(idle, drained).await;
        self.report()
    }

    pub(crate) fn tally(&self) -> &Tally {
        &self.tally
    }

    /// A message arrived: in flight until the guard drops, and no longer awaited.
    pub(crate) fn arrived(&self, message: &MessageExt) -> InFlight {
        if let Some(id) = unique_id(message) {
            let mut awaiting = self.awaiting();
            if let Some(copies) = awaiting.get_mut(id) {
                *copies -= 1;
                if *copies == 0 {
                    awaiting.remove(id);
                }
            }
        }
        self.tally.arrived()
    }

    /// Messages the listener sends back for a retry: awaited until they arrive again.
    pub(crate) fn sent_back(&self, messages: &[&MessageExt]) {
        let mut awaiting = self.awaiting();
        for id in messages.iter().filter_map(|message| unique_id(message)) {
            *awaiting.entry(id.to_owned()).or_default() += 1;
        }
    }

    fn awaiting(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        lock(&self.awaiting_retry)
    }
}

/// Nothing panics while holding these locks; a poisoned value is still the right value.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How often a drain whose group lag is unknown says so.
pub const UNKNOWN_LAG_WARN_EVERY: Duration = Duration::from_secs(30);

/// How many messages a consumer group has not consumed yet, of its topic and of its retry
/// topic (`%RETRY%<group>`), from the broker's consume stats (an admin client on the
/// listener's client runtime).
pub struct GroupLag {
    admin: DefaultMQAdminExt,
    group: String,
    topics: [String; 2],
}

impl GroupLag {
    /// Starts an admin client for `group` consuming `topic`, through the name server at
    /// `name_server`.
    pub async fn start(
        runtime: &OwnedClientRuntime,
        name_server: &str,
        group: &str,
        topic: &str,
    ) -> Result<GroupLag, Error> {
        // One admin group per client instance: a fresh name lets several run side by side.
        let admin_group = format!("oncely_lag_{}", oncely::Token::random());
        let mut admin = DefaultMQAdminExt::with_admin_ext_group(runtime.client_runtime(), admin_group);
        admin.set_namesrv_addr(name_server);
        admin.start().await?;
        Ok(GroupLag {
            admin,
            group: group.to_owned(),
            topics: [topic.to_owned(), format!("%RETRY%{group}")],
        })
    }

    /// Messages the broker holds for the group beyond its committed offsets, in the topic
    /// and its retry topic (a queue the group never committed an offset on counts whole);
    /// `None` while the broker lists no queue of the topic for the group (a new group before
    /// its first commit, or a topic not created yet): unknown, not zero.
    pub async fn pending(&self) -> Result<Option<u64>, Error> {
        let [topic, retry_topic] = &self.topics;
        let Some(in_topic) = self.pending_in(topic).await? else {
            return Ok(None);
        };
        // The retry topic exists only once the group sent a message back: none, none pending.
        let in_retries = match self.pending_in(retry_topic).await {
            Ok(pending) => pending.unwrap_or(0),
            Err(error) => {
                tracing::debug!(%error, retry_topic, "no consume stats for the retry topic");
                0
            }
        };
        Ok(Some(in_topic + in_retries))
    }

    /// Warns every [`UNKNOWN_LAG_WARN_EVERY`] while `pending` stays unknown or failed;
    /// `warned` is when it last warned (or the lag became unknown), cleared once it is known.
    fn warn_while_unknown(&self, pending: &Result<Option<u64>, Error>, warned: &mut Option<Instant>) {
        if let Ok(Some(_)) = pending {
            *warned = None;
            return;
        }
        let last = *warned.get_or_insert_with(Instant::now);
        if last.elapsed() < UNKNOWN_LAG_WARN_EVERY {
            return;
        }
        *warned = Some(Instant::now());
        let [topic, _] = &self.topics;
        let why = match pending {
            Err(error) => error.to_string(),
            Ok(_) => "the broker lists no queue of the topic for the group".to_owned(),
        };
        tracing::warn!(
            topic,
            group = %self.group,
            why,
            "drain: the group's lag is unknown, still waiting; is the topic's name right, has anything been \
             sent to it, and has the group consumed and committed once?"
        );
    }

    /// [`pending`](GroupLag::pending) for one topic.
    async fn pending_in(&self, topic: &str) -> Result<Option<u64>, Error> {
        let stats = MQAdminReadExt::examine_consume_stats(
            &self.admin,
            self.group.as_str().into(),
            Some(topic.into()),
            None,
            None,
            Some(3_000),
        )
        .await?;
        let queues: Vec<u64> = (stats.get_offset_table().iter())
            .filter(|(queue, _)| queue.topic_str() == topic)
            .map(|(_, offsets)| {
                let consumed = offsets.get_consumer_offset().max(0);
                u64::try_from(offsets.get_broker_offset() - consumed).unwrap_or(0)
            })
            .collect();
        Ok((!queues.is_empty()).then(|| queues.iter().sum()))
    }

    /// Stops the admin client.
    pub async fn shutdown(mut self) {
        self.admin.shutdown().await;
    }
}
