//! The Redis backends on a Redis Cluster connection: the same store suites, against a
//! three-node cluster the test starts itself. Keys of one entity share a hash tag, so the
//! lock's two-key script runs on one node.

use integration_tests::redis_server::ScratchRedisCluster;
use integration_tests::unique;
use oncely::flag::RedisFlagStore;
use oncely::lock::RedisLockStore;
use redis::cluster::ClusterClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_backends_pass_their_suites_on_a_cluster_connection() {
    let cluster = ScratchRedisCluster::start();
    let client = ClusterClient::new(cluster.urls()).expect("a cluster client");
    let connection = client.get_async_connection().await.expect("a cluster connection");
    oncely::store_suite!(flag, run: RedisFlagStore::new(connection.clone()).with_prefix(unique("t")));
    oncely::store_suite!(lock, run: RedisLockStore::new(connection.clone()).with_prefix(unique("t")));
}
