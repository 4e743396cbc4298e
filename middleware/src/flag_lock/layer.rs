use std::sync::Arc;

use tower_layer::Layer;
use tower_service::Service;

use super::decision::Joint;
use crate::envelope::Envelope;
use crate::error::BoxError;
use crate::flag::{FlagLayer, RedisFlagStore};
use crate::lock::{LockLayer, RedisLockStore};
use crate::outcome::Outcome;
use crate::store::redis::RedisConnection;
use crate::store::redis::flag_lock::{JointSettings, RedisFlagLock};
use crate::telemetry::Probe;
use crate::tier::{Tier, TierRun, TierService, decide};

/// Adds the [flag](crate::flag) and the [lock](crate::lock) in front of a service as one
/// tier on one Redis, two round trips per delivery instead of four (see the
/// [module docs](crate::flag_lock)): the same as
/// `ServiceBuilder::new().layer(flag).layer(lock)`, faster.
///
/// ```no_run
/// # async fn f(redis: redis::aio::ConnectionManager) {
/// use std::time::Duration;
/// use oncely::KeyExtractor;
/// use oncely::flag::{FlagLayer, RedisFlagStore};
/// use oncely::flag_lock::FlagLockLayer;
/// use oncely::lock::{LockLayer, RedisLockStore};
///
/// let flag = FlagLayer::new(RedisFlagStore::new(redis.clone()), Duration::from_secs(600))
///     .with_record_behind();
/// let lock = LockLayer::new(RedisLockStore::new(redis), KeyExtractor::json_pointer("/sku"));
/// let flag_then_lock = FlagLockLayer::new(flag, lock);
/// # }
/// ```
pub struct FlagLockLayer<C> {
    joint: Arc<Joint<C>>,
}

impl<C: RedisConnection> FlagLockLayer<C> {
    /// The flag tier `flag` with the lock tier `lock` behind it, run together. Both stores
    /// must be on one Redis (or one Redis Cluster): the joint scripts run on the flag
    /// store's connection.
    pub fn new(flag: FlagLayer<RedisFlagStore<C>>, lock: LockLayer<RedisLockStore<C>>) -> Self {
        let settings = JointSettings {
            flag_lease: flag.lease,
            lock_lease: lock.lease,
            retention: flag.retention,
        };
        let store = RedisFlagLock::new(flag.store.clone(), lock.store.clone(), settings);
        FlagLockLayer {
            joint: Arc::new(Joint {
                flag,
                lock: Arc::new(lock),
                store,
            }),
        }
    }

    /// Runs the Redis steps of concurrent deliveries together, group-commit style: each
    /// delivery's claim and acquire joins the next script call, which leaves as soon as
    /// fewer than `max_calls` calls of that script are on the wire, with every delivery
    /// waiting at that moment (up to `max_deliveries`); so does the release and settle. A
    /// lone delivery adds no delay; many in flight share one call, which costs Redis and the
    /// consumer less than one call each. Redis runs a call's deliveries one after the other,
    /// so two copies of one key in a call decide as they would one after the other, and one
    /// delivery's error (a key of the wrong type) answers that delivery only.
    ///
    /// Fewer calls on the wire make fuller calls: with `max_calls` 1, every delivery that
    /// arrives while a call is out waits for it and joins the next, so Redis runs one Lua
    /// call for all of them. Measured on the 2-core development machine (issue 25), the
    /// RabbitMQ runner at 256 in flight with this tier and the batched record with a batch
    /// handler behind it, two runs each: `with_coalescing(64, 1)` ran 6,571 and 6,556
    /// messages a second at 261 µs of machine CPU a message (Redis 39–41), against 5,766
    /// and 4,920 at 298–320 µs (Redis 44–48) with `(64, 4)` and 6,062 and 5,394 at
    /// 295–317 µs (Redis 50–55) uncoalesced. With a few deliveries in flight, a delivery may
    /// wait a round trip for the call ahead of it. A settle waiting for its call counts
    /// against the lock's lease (the watchdog has stopped by then): it waits for the call on
    /// the wire and the calls queued ahead of it (about one per `max_deliveries` deliveries
    /// waiting), each a round trip plus Redis running its deliveries — milliseconds, which a
    /// lease of seconds leaves ample room for. A call that finds a slot free runs in the
    /// task of the delivery that sent it: a handler that blocks its thread holds that call,
    /// and with one slot every delivery's next step waits behind it.
    ///
    /// On Redis Cluster the tier runs the two layers one after the other (see the
    /// [module docs](crate::flag_lock)), which this does not coalesce. It needs one Redis or
    /// a Redis Cluster behind the connection: a proxy that shards keys without refusing a
    /// script over many (twemproxy, a sharding connection of your own) would run a call's
    /// deliveries on the shard of its first key, where a copy sent alone would not see
    /// them. Starts two tasks on the current Tokio runtime, which end when the last clone
    /// of the layer is dropped.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn with_coalescing(self, max_deliveries: usize, max_calls: usize) -> Self {
        let Joint { flag, lock, store } = Arc::unwrap_or_clone(self.joint);
        FlagLockLayer {
            joint: Arc::new(Joint {
                flag,
                lock,
                store: store.coalesced(max_deliveries, max_calls),
            }),
        }
    }
}

impl<C> Clone for FlagLockLayer<C> {
    fn clone(&self) -> Self {
        FlagLockLayer {
            joint: self.joint.clone(),
        }
    }
}

impl<C> std::fmt::Debug for FlagLockLayer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlagLockLayer")
            .field("flag", &self.joint.flag)
            .field("lock", &self.joint.lock)
            .finish()
    }
}

impl<S, C> Layer<S> for FlagLockLayer<C> {
    type Service = TierService<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        TierService::new(inner, self.clone())
    }
}

impl<C: RedisConnection> TierRun for FlagLockLayer<C> {
    const TIER: Tier = Tier::FlagLock;

    async fn run<S>(&self, inner: S, envelope: Envelope, probe: &Probe) -> Outcome
    where
        S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        // Redis down: the joint script meets the same error, under the joint policy.
        if let Ok(false) = self.joint.store.fuses().await {
            let locked = TierService::shared(inner, self.joint.lock.clone());
            return decide(&self.joint.flag, locked, envelope, probe).await;
        }
        decide(&*self.joint, inner, envelope, probe).await
    }
}
