//! oncely-http against a real server on loopback, a real HTTP client, Redis and PostgreSQL:
//! what a client gets for every kind of request, and what was written.

use std::time::Duration;

use futures_lite::future::try_zip;
use integration_tests::http::{Answer, MAX_BODY, SLOW_RUN, Shop, TENANT, TestServer, client, send};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::redis_url;

const ORDER: &str = r#"{"sku":"tea","quantity":2}"#;
/// Another payload than [`ORDER`].
const OTHER_ORDER: &str = r#"{"sku":"tea","quantity":3}"#;

/// A shop served with its record on its own pool and its flag on the shared Redis.
async fn shop_server() -> (Shop, TestServer) {
    let shop = Shop::new(16).await;
    let server = TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await;
    (shop, server)
}

/// `POST path` as `tenant` with `key` (when given) and `body`.
fn post(
    server: &TestServer,
    path: &str,
    tenant: &str,
    key: Option<&str>,
    body: &'static str,
) -> reqwest::RequestBuilder {
    let request = client()
        .post(server.url(path))
        .header(TENANT, tenant)
        .header("content-type", "application/json")
        .body(body);
    match key {
        Some(key) => request.header("idempotency-key", key),
        None => request,
    }
}

/// The answers to 64 concurrent copies of one order under `key`.
async fn sixty_four_copies(server: &TestServer, key: &str) -> Vec<Answer> {
    let copies: Vec<_> = (0..64)
        .map(|_| tokio::spawn(send(post(server, "/orders", "acme", Some(key), ORDER))))
        .collect();
    let mut answers = Vec::new();
    for copy in copies {
        answers.push(copy.await.expect("the request task"));
    }
    answers
}

fn problem_type(answer: &Answer) -> String {
    assert_eq!(
        answer.headers["content-type"], "application/problem+json",
        "not a problem: {answer:?}"
    );
    let kind = answer.json("type");
    let kind = kind.as_str().unwrap_or_default();
    kind.rsplit_once("#variant.")
        .map(|(_, name)| name.to_owned())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_key_runs_once_and_its_response_is_answered_again() {
    let (shop, server) = shop_server().await;
    let first = send(post(&server, "/orders", "acme", Some(r#""order-1""#), ORDER)).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.is_replay());
    assert_eq!(first.headers["x-request-only"], "first");

    let again = send(post(&server, "/orders", "acme", Some(r#""order-1""#), ORDER)).await;
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
    let bare = send(post(&server, "/orders", "acme", Some("order-1"), ORDER)).await;
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
    let missing = send(post(&server, "/orders", "acme", None, ORDER)).await;
    assert_eq!(
        (missing.status, problem_type(&missing).as_str()),
        (400, "KeyMissing")
    );

    let malformed = [r#""unclosed"#, "a b", r#""a", "b""#, r#""""#];
    for key in malformed {
        let answer = send(post(&server, "/orders", "acme", Some(key), ORDER)).await;
        assert_eq!(
            (answer.status, problem_type(&answer).as_str()),
            (400, "KeyMalformed"),
            "{key}"
        );
    }
    let long = format!("\"{}\"", "k".repeat(256));
    let answer = send(post(&server, "/orders", "acme", None, ORDER).header("idempotency-key", long)).await;
    assert_eq!(answer.status, 400, "a key of 256 bytes");
    let twice = post(&server, "/orders", "acme", Some("k-1"), ORDER).header("idempotency-key", "k-2");
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
    let too_large = send(post(&server, "/orders", "acme", Some("k-4"), huge)).await;
    assert_eq!(
        (too_large.status, problem_type(&too_large).as_str()),
        (413, "BodyTooLarge")
    );
    assert_eq!(shop.effects().await, 0, "a refused request wrote something");
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_refused_with_422() {
    let (shop, server) = shop_server().await;
    let first = send(post(&server, "/orders", "acme", Some("k"), ORDER)).await;
    assert_eq!(first.status, 201);
    let other_body = send(post(&server, "/orders", "acme", Some("k"), OTHER_ORDER)).await;
    assert_eq!(
        (other_body.status, problem_type(&other_body).as_str()),
        (422, "KeyReused")
    );
    let other_path = send(post(&server, "/refunds", "acme", Some("k"), ORDER)).await;
    assert_eq!(
        (other_path.status, problem_type(&other_path).as_str()),
        (422, "KeyReused")
    );
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn sixty_four_concurrent_copies_apply_once() {
    let (shop, server) = shop_server().await;
    let answers = sixty_four_copies(&server, "k-64").await;
    let ran: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.is_replay())
        .collect();
    assert_eq!(ran.len(), 1, "{answers:?}");
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, ran[0].body, "a replay answered another response"),
            409 => {
                assert_eq!(problem_type(answer), "KeyInFlight");
                assert!(answer.headers.get("retry-after").is_some());
            }
            other => panic!("copy answered {other}: {answer:?}"),
        }
    }
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn tenants_never_see_each_others_responses() {
    let (shop, server) = shop_server().await;
    let acme = send(post(&server, "/orders", "acme", Some("same-key"), ORDER)).await;
    let globex = send(post(&server, "/orders", "globex", Some("same-key"), ORDER)).await;
    assert_eq!((acme.status, globex.status), (201, 201));
    assert!(!globex.is_replay(), "globex got acme's response");
    assert_ne!(acme.body, globex.body);
    // A tenant whose name holds the scope separator does not collide either.
    let tricky = send(post(&server, "/orders", "acme:same-key", Some("x"), ORDER)).await;
    assert!(!tricky.is_replay());
    assert_eq!(shop.effects().await, 3);
}

#[tokio::test]
async fn a_restarted_server_answers_from_the_database() {
    let shop = Shop::new(8).await;
    let server = TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await;
    let first = send(post(&server, "/orders", "acme", Some("k"), ORDER)).await;
    drop(server);
    // A fresh Redis as well: the flag remembers nothing, the record decides.
    let redis = ScratchRedis::start();
    let restarted = TestServer::start(shop.app(shop.pool.clone(), &redis.url()).await).await;
    let again = send(post(&restarted, "/orders", "acme", Some("k"), ORDER)).await;
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
async fn a_handler_that_panics_times_out_or_answers_5xx_commits_nothing() {
    let (shop, server) = shop_server().await;
    let faults = shop.faults.clone();
    faults.panics.store(1, std::sync::atomic::Ordering::SeqCst);
    let panicked = send(post(&server, "/orders", "acme", Some("p"), ORDER)).await;
    assert_eq!(
        (panicked.status, problem_type(&panicked).as_str()),
        (500, "HandlerFailed")
    );
    assert_eq!(shop.effects().await, 0, "the panicking run's write was committed");
    let retried = send(post(&server, "/orders", "acme", Some("p"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");

    // Its statement still runs when the timeout cuts it off: cancelled, not waited for (the
    // statement sleeps 6 s; the answer must come before the client gives up at 5 s).
    faults.stalls.store(1, std::sync::atomic::Ordering::SeqCst);
    let stalled = post(&server, "/orders", "acme", Some("t"), ORDER).timeout(Duration::from_secs(5));
    let stalled = send(stalled).await;
    assert_eq!(
        (stalled.status, problem_type(&stalled).as_str()),
        (500, "HandlerFailed")
    );
    let retried = send(post(&server, "/orders", "acme", Some("t"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");

    faults.unavailable.store(1, std::sync::atomic::Ordering::SeqCst);
    let unavailable = send(post(&server, "/orders", "acme", Some("u"), ORDER)).await;
    assert_eq!(unavailable.status, 503);
    assert_eq!(
        unavailable.body, "the warehouse is down",
        "the handler's own 5xx is passed on"
    );
    let retried = send(post(&server, "/orders", "acme", Some("u"), ORDER)).await;
    assert_eq!(
        (retried.status, retried.is_replay()),
        (201, false),
        "a 5xx answer was stored"
    );

    faults.throttled.store(1, std::sync::atomic::Ordering::SeqCst);
    let throttled = send(post(&server, "/orders", "acme", Some("r"), ORDER)).await;
    assert_eq!(throttled.status, 429);
    let retried = send(post(&server, "/orders", "acme", Some("r"), ORDER)).await;
    assert_eq!(
        (retried.status, retried.is_replay()),
        (201, false),
        "a 429 was stored"
    );
    assert_eq!(
        shop.effects().await,
        4,
        "one effect per key, none from the failed runs"
    );
}

#[tokio::test]
async fn a_database_that_is_down_answers_503_and_runs_nothing() {
    let shop = Shop::new(4).await;
    // A pool on a port where nothing listens: every checkout fails.
    let dead = integration_tests::postgres::pool_on("postgres://postgres@127.0.0.1:1/test", 2);
    let server = TestServer::start(shop.app(dead, &redis_url()).await).await;
    let answer = send(post(&server, "/orders", "acme", Some("k"), ORDER)).await;
    assert_eq!(
        (answer.status, problem_type(&answer).as_str()),
        (503, "StoreUnavailable")
    );
    assert!(answer.headers.get("retry-after").is_some());
    assert_eq!(shop.effects().await, 0);
    // The flag was released with the failure: once the database is back, the key runs.
    let healthy = TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await;
    let answer = send(post(&healthy, "/orders", "acme", Some("k"), ORDER)).await;
    assert_eq!((answer.status, answer.is_replay()), (201, false), "{answer:?}");
}

/// `POST /forms/orders` as `tenant`, with the form field `_token`.
fn submit(server: &TestServer, tenant: &str, token: &str) -> reqwest::RequestBuilder {
    client()
        .post(server.url("/forms/orders"))
        .header(TENANT, tenant)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("sku=tea&quantity=2&_token={token}"))
}

async fn fetch_token(server: &TestServer, tenant: &str) -> String {
    let issued = send(client().post(server.url("/tokens")).header(TENANT, tenant)).await;
    assert_eq!(issued.status, 201, "{issued:?}");
    assert_eq!(issued.headers["cache-control"], "no-store");
    issued.json("token").as_str().expect("a token").to_owned()
}

#[tokio::test]
async fn a_one_time_token_lets_one_submit_through() {
    let (shop, server) = shop_server().await;
    let token = fetch_token(&server, "acme").await;
    assert_ne!(token, fetch_token(&server, "acme").await);

    let (first, second) = try_zip(
        async { Ok::<_, ()>(send(submit(&server, "acme", &token)).await) },
        async { Ok(send(submit(&server, "acme", &token)).await) },
    )
    .await
    .expect("both answered");
    let mut answers = [first, second];
    answers.sort_by_key(|answer| (answer.status, answer.is_replay()));
    assert_eq!(answers[0].status, 201, "{answers:?}");
    assert!(
        answers[1].status == 409 || answers[1].is_replay(),
        "a concurrent second submit: {answers:?}"
    );
    let later = send(submit(&server, "acme", &token)).await;
    assert!(later.is_replay(), "{later:?}");
    assert_eq!(shop.effects().await, 1);

    let unknown = send(submit(&server, "acme", "no-such-token")).await;
    assert_eq!(
        (unknown.status, problem_type(&unknown).as_str()),
        (400, "TokenUnknown")
    );
    let foreign_token = fetch_token(&server, "globex").await;
    let foreign = send(submit(&server, "acme", &foreign_token)).await;
    assert_eq!(
        (foreign.status, problem_type(&foreign).as_str()),
        (400, "TokenUnknown")
    );
    let missing = client()
        .post(server.url("/forms/orders"))
        .header(TENANT, "acme")
        .header("content-type", "application/x-www-form-urlencoded")
        .body("sku=tea");
    let missing = send(missing).await;
    assert_eq!(
        (missing.status, problem_type(&missing).as_str()),
        (400, "TokenMissing")
    );

    let expiring = fetch_token(&server, "acme").await;
    shop.schema
        .execute(&format!(
            "UPDATE form_tokens SET expires_at = now() - interval '1 second' WHERE token = '{expiring}'"
        ))
        .await;
    let expired = send(submit(&server, "acme", &expiring)).await;
    assert_eq!(
        (expired.status, problem_type(&expired).as_str()),
        (410, "TokenExpired")
    );
    // A token that ran before it expired still answers its result.
    shop.schema
        .execute(&format!(
            "UPDATE form_tokens SET expires_at = now() - interval '1 second' WHERE token = '{token}'"
        ))
        .await;
    assert!(send(submit(&server, "acme", &token)).await.is_replay());
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn the_query_is_part_of_the_request_and_safe_methods_need_no_key() {
    let (shop, server) = shop_server().await;
    let dry_run = send(post(&server, "/orders?dry_run=true", "acme", Some("q"), ORDER)).await;
    assert_eq!(dry_run.status, 201);
    let real = send(post(&server, "/orders", "acme", Some("q"), ORDER)).await;
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
    let impatient = post(&server, "/orders", "acme", Some("h"), ORDER).timeout(SLOW_RUN / 4);
    assert!(impatient.send().await.is_err(), "the client was meant to give up");
    tokio::time::sleep(SLOW_RUN * 2).await;
    let retried = send(post(&server, "/orders", "acme", Some("h"), ORDER)).await;
    assert!(
        retried.is_replay(),
        "the run was cut off or left its key blocked: {retried:?}"
    );
    assert_eq!(shop.effects().await, 1);
}

#[tokio::test]
async fn an_expired_response_is_gone_until_purged_then_the_key_is_new() {
    let (shop, server) = shop_server().await;
    let first = send(post(&server, "/orders", "acme", Some("e"), ORDER)).await;
    assert_eq!(first.status, 201);
    shop.schema
        .execute("UPDATE consumption_record_responses SET expires_at = now() - interval '1 second'")
        .await;
    let gone = send(post(&server, "/orders", "acme", Some("e"), ORDER)).await;
    assert_eq!((gone.status, problem_type(&gone).as_str()), (410, "ResponseGone"));
    assert_eq!(shop.responses().purge_expired(100).await.expect("purge"), 1);
    assert_eq!(shop.responses().purge_expired(100).await.expect("purge"), 0);
    // The flag still remembers the key for its retry window; a fresh one (as after it
    // expired) leaves the record to decide, which no longer knows the key.
    let fresh = integration_tests::redis_server::ScratchRedis::start();
    let later = TestServer::start(shop.app(shop.pool.clone(), &fresh.url()).await).await;
    let again = send(post(&later, "/orders", "acme", Some("e"), ORDER)).await;
    assert_eq!((again.status, again.is_replay()), (201, false), "{again:?}");
    assert_eq!(shop.effects().await, 2);
}

/// The order endpoint with the record and the stored responses on MariaDB: the effect row,
/// the response and the record in one XA transaction; the flag on Redis; a panic on the
/// first run when `panics` says so. Answers the server and its database.
async fn mariadb_shop(panics: u32) -> (integration_tests::mysql::StockDatabase, TestServer) {
    use axum::extract::Extension;
    use oncely::mysql::sqlx;
    use oncely::record::{MysqlTransaction, MysqlTransactionalLayer};
    use oncely_http::{ClientScope, IdempotencyLayer, MysqlResponses};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    let database = integration_tests::mysql::StockDatabase::new().await;
    sqlx::raw_sql(
        "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, body TEXT NOT NULL) ENGINE = InnoDB",
    )
    .execute(&database.pool)
    .await
    .expect("the effects table");
    let pool = database.pool(70).await;
    let records = integration_tests::mysql::StockDatabase::records();
    let responses = MysqlResponses::new(pool.clone(), &records).expect("a table name");
    responses.migrate().await.expect("migrate the responses");
    let flag = oncely::flag::FlagLayer::new(
        oncely::flag::RedisFlagStore::new(integration_tests::redis_connection(&redis_url()).await)
            .with_prefix(oncely::testing::unique("oncely-http-mariadb")),
        Duration::from_secs(3600),
    );
    let tiers = tower::ServiceBuilder::new()
        .layer(flag)
        .layer(MysqlTransactionalLayer::new(pool, records));
    let layer = IdempotencyLayer::new(tiers, responses, ClientScope::header(TENANT));
    let panics = Arc::new(AtomicU32::new(panics));
    let handler = move |Extension(tx): Extension<MysqlTransaction>, body: String| {
        let panics = panics.clone();
        async move {
            sqlx::query("INSERT INTO effects (body) VALUES (?)")
                .bind(&body)
                .execute(&tx)
                .await
                .expect("the effect");
            drop(tx);
            if panics
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
                .is_ok()
            {
                panic!("the handler's injected panic");
            }
            (
                axum::http::StatusCode::CREATED,
                oncely::Token::random().to_string(),
            )
        }
    };
    let app = axum::Router::new()
        .route("/orders", axum::routing::post(handler))
        .layer(layer);
    (database, TestServer::start(app).await)
}

async fn mariadb_effects(database: &integration_tests::mysql::StockDatabase) -> i64 {
    oncely::mysql::sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&database.pool)
        .await
        .expect("count the effects")
}

#[tokio::test]
async fn on_mariadb_a_key_runs_once_among_64_copies_and_is_answered_again() {
    let (database, server) = mariadb_shop(0).await;
    let answers = sixty_four_copies(&server, "k").await;
    let ran: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.is_replay())
        .collect();
    assert_eq!(ran.len(), 1, "{answers:?}");
    assert!(
        answers.iter().all(|a| a.status == 409 || a.body == ran[0].body),
        "{answers:?}"
    );
    let again = send(post(&server, "/orders", "acme", Some("k"), ORDER)).await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, ran[0].body);
    let other = send(post(&server, "/orders", "acme", Some("k"), OTHER_ORDER)).await;
    assert_eq!(other.status, 422);
    assert_eq!(mariadb_effects(&database).await, 1);
}

#[tokio::test]
async fn on_mariadb_a_handler_that_panics_commits_nothing_and_the_retry_runs() {
    let (database, server) = mariadb_shop(1).await;
    let panicked = send(post(&server, "/orders", "acme", Some("p"), ORDER)).await;
    assert_eq!(
        (panicked.status, problem_type(&panicked).as_str()),
        (500, "HandlerFailed")
    );
    assert_eq!(
        mariadb_effects(&database).await,
        0,
        "the panicking run's write was committed"
    );
    let retried = send(post(&server, "/orders", "acme", Some("p"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(mariadb_effects(&database).await, 1);
}

#[tokio::test]
async fn with_the_batched_record_copies_apply_once_and_a_failure_spares_its_batch() {
    let shop = Shop::new(16).await;
    let server = TestServer::start(shop.record_only_app(true)).await;
    let answers = sixty_four_copies(&server, "k").await;
    // No flag in front: the copies meet in the record, in one batch or after it.
    assert!(answers.iter().all(|answer| answer.status == 201), "{answers:?}");
    assert_eq!(answers.iter().filter(|answer| !answer.is_replay()).count(), 1);
    assert_eq!(shop.effects().await, 1);

    // The 20th run panics and the first answers 503, among 64 requests at once: the others
    // are processed once, whatever batch they shared with a failed one (a batch that rolls
    // back runs its other requests again, each on its own; the crate's unit test
    // `a_request_runs_again_after_its_batch_rolled_back` shows such a second run).
    shop.faults
        .panic_at_run
        .store(20, std::sync::atomic::Ordering::SeqCst);
    shop.faults
        .unavailable
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let keys: Vec<String> = (0..64).map(|i| format!("b-{i}")).collect();
    let requests = keys.iter().map(|key| {
        let request = post(&server, "/orders", "acme", None, ORDER).header("idempotency-key", key.as_str());
        tokio::spawn(send(request))
    });
    let mut failed = Vec::new();
    for (key, request) in keys.iter().zip(requests) {
        let answer = request.await.expect("the request task");
        match answer.status {
            201 => assert!(!answer.is_replay(), "{key}: {answer:?}"),
            500 | 503 => failed.push(key.clone()),
            _ => panic!("{key}: {answer:?}"),
        }
    }
    assert_eq!(failed.len(), 2, "one panic and one 503");
    assert_eq!(
        shop.effects().await,
        1 + 62,
        "the failed requests' writes were committed"
    );
    for key in failed {
        let retried =
            send(post(&server, "/orders", "acme", None, ORDER).header("idempotency-key", key)).await;
        assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    }
    assert_eq!(shop.effects().await, 1 + 64);
}

#[tokio::test]
async fn a_handler_that_swallows_a_failed_statement_commits_nothing() {
    let (shop, server) = shop_server().await;
    // The failed statement aborted the transaction: the 201 the handler answers cannot be
    // the key's result, since its effect and its record cannot commit.
    shop.faults
        .swallowed
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let swallowed = send(post(&server, "/orders", "acme", Some("s"), ORDER)).await;
    assert_eq!(
        (swallowed.status, problem_type(&swallowed).as_str()),
        (500, "HandlerFailed")
    );
    assert_eq!(shop.effects().await, 0);
    let retried = send(post(&server, "/orders", "acme", Some("s"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(shop.effects().await, 1);
}
