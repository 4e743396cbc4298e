//! oncely-http against a real server on loopback, a real HTTP client, Redis and PostgreSQL:
//! what a client gets for every kind of request, and what was written.

use std::time::Duration;

use integration_tests::http::{
    MAX_BODY, ORDER, OTHER_ORDER, SLOW_RUN, Shop, TENANT, TestServer, client, post_as, problem_type, send,
    sixty_four_copies,
};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::redis_url;

/// A shop served with its record on its own pool and its flag on the shared Redis.
async fn shop_server() -> (Shop, TestServer) {
    let shop = Shop::new(16).await;
    let server = TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await;
    (shop, server)
}

#[tokio::test]
async fn a_key_runs_once_and_its_response_is_answered_again() {
    let (shop, server) = shop_server().await;
    let first = send(post_as(&server, "/orders", "acme", Some(r#""order-1""#), ORDER)).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.is_replay());
    assert_eq!(first.headers["x-request-only"], "first");

    let again = send(post_as(&server, "/orders", "acme", Some(r#""order-1""#), ORDER)).await;
    assert_eq!(again.status, 201);
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, first.body, "the replay is the first response");
    assert_eq!(again.headers["location"], first.headers["location"]);
    assert_eq!(again.headers["content-type"], "application/json");
    assert!(
        again.headers.get("x-request-only").is_none(),
        "a header the route does not store"
    );
    // The same key sent bare (as Stripe's clients do) is the same key.
    let bare = send(post_as(&server, "/orders", "acme", Some("order-1"), ORDER)).await;
    assert!(bare.is_replay());
    assert_eq!(shop.effects().await, 1);
    let stored = "SELECT count(*) FROM consumption_record_responses";
    assert_eq!(shop.schema.count(stored).await, 1);
    let success = "SELECT count(*) FROM consumption_record WHERE status = 'SUCCESS'";
    assert_eq!(shop.schema.count(success).await, 1);
}

#[tokio::test]
async fn bad_requests_get_their_problem_and_run_nothing() {
    let (shop, server) = shop_server().await;
    let missing = send(post_as(&server, "/orders", "acme", None, ORDER)).await;
    assert_eq!(
        (missing.status, problem_type(&missing).as_str()),
        (400, "KeyMissing")
    );

    let malformed = [r#""unclosed"#, "a b", r#""a", "b""#, r#""""#];
    for key in malformed {
        let answer = send(post_as(&server, "/orders", "acme", Some(key), ORDER)).await;
        assert_eq!(
            (answer.status, problem_type(&answer).as_str()),
            (400, "KeyMalformed"),
            "{key}"
        );
    }
    let long = format!("\"{}\"", "k".repeat(256));
    let answer = send(post_as(&server, "/orders", "acme", None, ORDER).header("idempotency-key", long)).await;
    assert_eq!(answer.status, 400, "a key of 256 bytes");
    let twice = post_as(&server, "/orders", "acme", Some("k-1"), ORDER).header("idempotency-key", "k-2");
    let twice = send(twice).await;
    assert_eq!(
        (twice.status, problem_type(&twice).as_str()),
        (400, "KeyMalformed")
    );

    let nobody = client()
        .post(server.url("/orders"))
        .header("idempotency-key", "k-3")
        .body(ORDER);
    let nobody = send(nobody).await;
    assert_eq!(
        (nobody.status, problem_type(&nobody).as_str()),
        (401, "ClientUnidentified")
    );

    let huge: &'static str = "x".repeat(MAX_BODY + 1).leak();
    let too_large = send(post_as(&server, "/orders", "acme", Some("k-4"), huge)).await;
    assert_eq!(
        (too_large.status, problem_type(&too_large).as_str()),
        (413, "BodyTooLarge")
    );
    assert_eq!(shop.effects().await, 0, "a refused request wrote something");
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_refused_with_422() {
    let (shop, server) = shop_server().await;
    let first = send(post_as(&server, "/orders", "acme", Some("k"), ORDER)).await;
    assert_eq!(first.status, 201);
    let other_body = send(post_as(&server, "/orders", "acme", Some("k"), OTHER_ORDER)).await;
    assert_eq!(
        (other_body.status, problem_type(&other_body).as_str()),
        (422, "KeyReused")
    );
    let other_path = send(post_as(&server, "/refunds", "acme", Some("k"), ORDER)).await;
    assert_eq!(
        (other_path.status, problem_type(&other_path).as_str()),
        (422, "KeyReused")
    );
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn tenants_never_see_each_others_responses() {
    let (shop, server) = shop_server().await;
    let acme = send(post_as(&server, "/orders", "acme", Some("same-key"), ORDER)).await;
    let globex = send(post_as(&server, "/orders", "globex", Some("same-key"), ORDER)).await;
    assert_eq!((acme.status, globex.status), (201, 201));
    assert!(!globex.is_replay(), "globex got acme's response");
    assert_ne!(acme.body, globex.body);
    // A tenant whose name holds the scope separator does not collide either.
    let tricky = send(post_as(&server, "/orders", "acme:same-key", Some("x"), ORDER)).await;
    assert!(!tricky.is_replay());
    assert_eq!(shop.effects().await, 3);
}

#[tokio::test]
async fn a_restarted_server_answers_from_the_database() {
    let shop = Shop::new(8).await;
    let server = TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await;
    let first = send(post_as(&server, "/orders", "acme", Some("k"), ORDER)).await;
    drop(server);
    // A fresh Redis as well: the flag remembers nothing, the record decides.
    let redis = ScratchRedis::start();
    let restarted = TestServer::start(shop.app(shop.pool.clone(), &redis.url()).await).await;
    let again = send(post_as(&restarted, "/orders", "acme", Some("k"), ORDER)).await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn with_redis_down_the_record_still_decides() {
    let shop = Shop::new(70).await;
    let mut redis = ScratchRedis::start();
    let server = TestServer::start(shop.app(shop.pool.clone(), &redis.url()).await).await;
    redis.kill();
    let answers = sixty_four_copies(&server, "k").await;
    // The flag fails open; the record's row serialises the copies: the rest wait for the
    // first's commit and get its response.
    assert!(answers.iter().all(|answer| answer.status == 201), "{answers:?}");
    assert_eq!(answers.iter().filter(|answer| !answer.is_replay()).count(), 1);
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn a_handler_that_times_out_or_answers_5xx_commits_nothing() {
    let (shop, server) = shop_server().await;
    let faults = shop.faults.clone();
    // A panic: the stores' shared cases (`http_stores.rs`).

    // Its statement still runs when the timeout cuts it off: cancelled, not waited for (the
    // statement sleeps 6 s; the answer must come before the client gives up at 5 s).
    faults.stalls.store(1, std::sync::atomic::Ordering::SeqCst);
    let stalled = post_as(&server, "/orders", "acme", Some("t"), ORDER).timeout(Duration::from_secs(5));
    let stalled = send(stalled).await;
    assert_eq!(
        (stalled.status, problem_type(&stalled).as_str()),
        (500, "HandlerFailed")
    );
    let retried = send(post_as(&server, "/orders", "acme", Some("t"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");

    faults.unavailable.store(1, std::sync::atomic::Ordering::SeqCst);
    let unavailable = send(post_as(&server, "/orders", "acme", Some("u"), ORDER)).await;
    assert_eq!(unavailable.status, 503);
    assert_eq!(
        unavailable.body, "the warehouse is down",
        "the handler's own 5xx is passed on"
    );
    let retried = send(post_as(&server, "/orders", "acme", Some("u"), ORDER)).await;
    assert_eq!(
        (retried.status, retried.is_replay()),
        (201, false),
        "a 5xx answer was stored"
    );

    faults.throttled.store(1, std::sync::atomic::Ordering::SeqCst);
    let throttled = send(post_as(&server, "/orders", "acme", Some("r"), ORDER)).await;
    assert_eq!(throttled.status, 429);
    let retried = send(post_as(&server, "/orders", "acme", Some("r"), ORDER)).await;
    assert_eq!(
        (retried.status, retried.is_replay()),
        (201, false),
        "a 429 was stored"
    );
    assert_eq!(
        shop.effects().await,
        3,
        "one effect per key, none from the failed runs"
    );
}

#[tokio::test]
async fn a_database_that_is_down_answers_503_and_runs_nothing() {
    let shop = Shop::new(4).await;
    // A pool on a port where nothing listens: every checkout fails.
    let dead = integration_tests::postgres::pool_on("postgres://postgres@127.0.0.1:1/test", 2);
    let server = TestServer::start(shop.app(dead, &redis_url()).await).await;
    let answer = send(post_as(&server, "/orders", "acme", Some("k"), ORDER)).await;
    assert_eq!(
        (answer.status, problem_type(&answer).as_str()),
        (503, "StoreUnavailable")
    );
    assert!(answer.headers.get("retry-after").is_some());
    assert_eq!(shop.effects().await, 0);
    // The flag was released with the failure: once the database is back, the key runs.
    let healthy = TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await;
    let answer = send(post_as(&healthy, "/orders", "acme", Some("k"), ORDER)).await;
    assert_eq!((answer.status, answer.is_replay()), (201, false), "{answer:?}");
}

/// `POST /forms/orders` as `tenant`, with the form field `_token`.
#[tokio::test]
async fn the_query_is_part_of_the_request_and_safe_methods_need_no_key() {
    let (shop, server) = shop_server().await;
    let dry_run = send(post_as(&server, "/orders?dry_run=true", "acme", Some("q"), ORDER)).await;
    assert_eq!(dry_run.status, 201);
    let real = send(post_as(&server, "/orders", "acme", Some("q"), ORDER)).await;
    assert_eq!((real.status, problem_type(&real).as_str()), (422, "KeyReused"));
    // The route has no GET: axum's own 405, not the layer's 400 for a missing key.
    let get = send(client().get(server.url("/orders")).header(TENANT, "acme")).await;
    assert_eq!(get.status, 405, "{get:?}");
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_does_not_cut_the_run_off() {
    let (shop, server) = shop_server().await;
    shop.faults.slow.store(1, std::sync::atomic::Ordering::SeqCst);
    let impatient = post_as(&server, "/orders", "acme", Some("h"), ORDER).timeout(SLOW_RUN / 4);
    assert!(impatient.send().await.is_err(), "the client was meant to give up");
    tokio::time::sleep(SLOW_RUN * 2).await;
    let retried = send(post_as(&server, "/orders", "acme", Some("h"), ORDER)).await;
    assert!(
        retried.is_replay(),
        "the run was cut off or left its key blocked: {retried:?}"
    );
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn an_expired_response_is_gone_until_purged_then_the_key_is_new() {
    let (shop, server) = shop_server().await;
    let first = send(post_as(&server, "/orders", "acme", Some("e"), ORDER)).await;
    assert_eq!(first.status, 201);
    shop.schema
        .execute("UPDATE consumption_record_responses SET expires_at = now() - interval '1 second'")
        .await;
    let gone = send(post_as(&server, "/orders", "acme", Some("e"), ORDER)).await;
    assert_eq!((gone.status, problem_type(&gone).as_str()), (410, "ResponseGone"));
    assert_eq!(shop.responses().purge_expired(100).await.expect("purge"), 1);
    assert_eq!(shop.responses().purge_expired(100).await.expect("purge"), 0);
    // The flag still remembers the key for its retry window; a fresh one (as after it
    // expired) leaves the record to decide, which no longer knows the key.
    let fresh = integration_tests::redis_server::ScratchRedis::start();
    let later = TestServer::start(shop.app(shop.pool.clone(), &fresh.url()).await).await;
    let again = send(post_as(&later, "/orders", "acme", Some("e"), ORDER)).await;
    assert_eq!((again.status, again.is_replay()), (201, false), "{again:?}");
    assert_eq!(shop.effects().await, 2);
}
