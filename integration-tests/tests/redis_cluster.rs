//! The Redis backends on a Redis Cluster connection: the same store suites, against a
//! three-node cluster the test starts itself. Keys of one entity share a hash tag, so the
//! lock's two-key script runs on one node; the joint flag and lock, whose keys do not
//! share one, runs the two one after the other.

use std::sync::atomic::Ordering;
use std::time::Duration;

use integration_tests::redis_server::ScratchRedisCluster;
use integration_tests::{counting_handler, unique};
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::{Delivery, KeyExtractor, Outcome, Route, Source, Tier};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tower::ServiceBuilder;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_backends_pass_their_suites_on_a_cluster_connection() {
    let cluster = ScratchRedisCluster::start();
    let connection = cluster_connection(&cluster).await;
    oncely::store_suite!(flag, run: RedisFlagStore::new(connection.clone()).with_prefix(unique("t")));
    oncely::store_suite!(lock, run: RedisLockStore::new(connection.clone()).with_prefix(unique("t")));
    the_joint_flag_and_lock_splits_on_a_cluster(connection).await;
}

/// Redis Cluster refuses a script over keys in two slots ("o-1" hashes to slot 8594, "sku-1"
/// to 4521): the joint tier finds out before its first delivery and runs the flag and the
/// lock one after the other, applying the order once.
async fn the_joint_flag_and_lock_splits_on_a_cluster(connection: ClusterConnection) {
    let prefix = unique("t");
    let (ran, handler) = counting_handler();
    let flag = FlagLayer::new(
        RedisFlagStore::new(connection.clone()).with_prefix(prefix.clone()),
        Duration::from_secs(600),
    );
    let lock = LockLayer::new(
        RedisLockStore::new(connection).with_prefix(prefix),
        KeyExtractor::json_pointer("/sku"),
    );
    let stack = ServiceBuilder::new()
        .layer(FlagLockLayer::new(flag, lock))
        .service(handler);
    let route = Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack);
    let order = || Delivery::new(Source::new("orders"), r#"{"orderId":"o-1","sku":"sku-1"}"#);

    assert_eq!(route.handle(order()).await, Outcome::Processed);
    assert_eq!(
        route.handle(order()).await,
        Outcome::Duplicate { tier: Tier::Flag }
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

async fn cluster_connection(cluster: &ScratchRedisCluster) -> ClusterConnection {
    let client = ClusterClient::new(cluster.urls()).expect("a cluster client");
    client.get_async_connection().await.expect("a cluster connection")
}
