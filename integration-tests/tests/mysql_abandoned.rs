//! MySQL and MariaDB: abandoned transactions are ended with a bounded number of
//! connections. A test binary of its own, so that the server's connection count is this
//! test's alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use integration_tests::http::{ORDER, TestServer, post_as, send};
use integration_tests::http_mariadb::MariaShop;
use oncely::mysql::sqlx;
use tokio::io::AsyncWriteExt;

/// The server's connections now.
async fn threads_connected(pool: &sqlx::MySqlPool) -> i64 {
    let (_, value): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Threads_connected'")
        .fetch_one(pool)
        .await
        .expect("Threads_connected");
    value.parse().expect("a number")
}

/// 500 copies of a key whose first request holds its row for a second, each client hanging
/// up after 100 ms while its copy waits on the row lock: every abandoned copy's session is
/// killed, from one connection, while its pool slot waits for that — the server never sees
/// more than the pools' connections and a few more, and the application's pool serves
/// another key meanwhile. The key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_copies_open_no_connections_beyond_the_pool() {
    const APP_POOL: i64 = 32;
    let shop = MariaShop::new(APP_POOL as u32).await;
    let server = Arc::new(TestServer::start(shop.record_only_app(false)).await);
    let baseline = threads_connected(&shop.database.pool).await;
    let most = Arc::new(AtomicI64::new(baseline));
    let sampler = {
        let (pool, most) = (shop.database.pool.clone(), most.clone());
        tokio::spawn(async move {
            loop {
                most.fetch_max(threads_connected(&pool).await, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    // The first request holds the key's row for 1.2 s, within the handler's timeout.
    shop.faults.pace_ms.store(1200, Ordering::SeqCst);
    let first = tokio::spawn(send(post_as(&server, "/orders", "acme", Some("held"), ORDER)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    shop.faults.pace_ms.store(0, Ordering::SeqCst);
    // Each copy on a connection of its own, closed 100 ms after its request was sent: the
    // copies waiting on the row lock by then are abandoned together.
    let address = server.url("").trim_start_matches("http://").to_owned();
    let request = format!(
        "POST /orders HTTP/1.1\r\nhost: {address}\r\nx-tenant: acme\r\nidempotency-key: held\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{ORDER}",
        ORDER.len()
    );
    let copies: Vec<_> = (0..500)
        .map(|_| {
            let (address, request) = (address.clone(), request.clone());
            tokio::spawn(async move {
                let mut stream = tokio::net::TcpStream::connect(&address)
                    .await
                    .expect("a connection");
                stream
                    .write_all(request.as_bytes())
                    .await
                    .expect("the request sent");
                tokio::time::sleep(Duration::from_millis(100)).await;
            })
        })
        .collect();
    for copy in copies {
        copy.await.expect("a copy's task");
    }
    let other = send(post_as(&server, "/orders", "acme", Some("other"), ORDER)).await;
    assert_eq!(other.status, 201, "the pool did not serve another key: {other:?}");
    let first = first.await.expect("the first request's task");
    assert_eq!(first.status, 201, "{first:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    sampler.abort();
    // The app's pool, the test's own (4, already in the baseline but for what it grows by),
    // and a few: the killer's connection, the sampler's.
    let bound = baseline + APP_POOL + 4 + 2;
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= bound,
        "{most} connections at most, over the bound {bound} (baseline {baseline})"
    );
    assert_eq!(shop.effects().await, 2, "each key once");
    let again = send(post_as(&server, "/orders", "acme", Some("held"), ORDER)).await;
    assert!(again.is_replay(), "{again:?}");
}
