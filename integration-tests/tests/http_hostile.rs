//! oncely-http against hostile clients and careless configurations, on a real server,
//! Redis and PostgreSQL: no key held open for ever, no effect run twice, no secret kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use integration_tests::http::{Shop, TENANT, TestServer, client, send};
use integration_tests::redis_url;

const ORDER: &str = r#"{"sku":"tea","quantity":2}"#;

/// `POST /orders` as tenant `acme` with `key`.
fn order(server: &TestServer, key: &str) -> reqwest::RequestBuilder {
    client()
        .post(server.url("/orders"))
        .header(TENANT, "acme")
        .header("idempotency-key", key)
        .body(ORDER)
}

/// A handler whose response body never ends is cut off by the layer's timeout like one whose
/// call never returns: its transaction is rolled back (no session is left idle in it), the
/// copies sent meanwhile never empty the pool, and the client's retry runs the handler.
#[tokio::test]
async fn a_body_that_never_ends_is_cut_off_by_the_timeout() {
    let shop = Shop::new(16).await;
    let app = shop
        .app_with_timeout(shop.pool.clone(), &redis_url(), Duration::from_secs(1))
        .await;
    let server = Arc::new(TestServer::start(app).await);
    shop.faults.endless_bodies.store(1, Ordering::SeqCst);
    let started = Instant::now();
    let first = tokio::spawn(send(order(&server, "endless").timeout(Duration::from_secs(10))));

    // The fewest connections the pool could still hand out, sampled while the copies run.
    let fewest = Arc::new(AtomicUsize::new(usize::MAX));
    let sampler = {
        let (pool, fewest) = (shop.pool.clone(), fewest.clone());
        tokio::spawn(async move {
            loop {
                let status = pool.status();
                let free = status.max_size - status.size + status.available;
                fewest.fetch_min(free, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let copies: Vec<_> = (0..50)
        .map(|_| tokio::spawn(send(order(&server, "endless"))))
        .collect();
    for copy in copies {
        let copy = copy.await.expect("a copy's task");
        assert_ne!(
            copy.status, 201,
            "a copy ran while the first was in flight: {copy:?}"
        );
    }
    tokio::time::sleep(Duration::from_secs(2).saturating_sub(started.elapsed())).await;
    assert_eq!(
        shop.end_idle_transactions().await,
        0,
        "a transaction is left open 2 s after a handler cut off at 1 s"
    );
    sampler.abort();
    assert!(fewest.load(Ordering::SeqCst) > 0, "the pool ran empty");

    let first = first.await.expect("the first request's task");
    assert_eq!(first.status, 500, "{first:?}");
    assert_eq!(shop.effects().await, 0, "the cut-off run's effect was committed");
    let retried = send(order(&server, "endless")).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(shop.effects().await, 1);
}

/// Stored responses behind tiers that lend no transaction to write them in (the flag in
/// front of the three-step record) could never be kept: every request is refused before its
/// handler runs, so no retry runs it again and again.
#[tokio::test]
async fn a_stack_without_the_transactional_record_runs_no_handler() {
    use oncely::flag::{FlagLayer, RedisFlagStore};
    use oncely::record::{PgRecordStore, RecordLayer};
    use oncely_http::{ClientScope, IdempotencyLayer};

    let shop = Shop::new(4).await;
    let redis = integration_tests::redis_connection(&redis_url()).await;
    let flag = FlagLayer::new(
        RedisFlagStore::new(redis).with_prefix(shop.prefix.clone()),
        Duration::from_secs(3600),
    );
    let three_step = RecordLayer::new(PgRecordStore::new(shop.pool.clone(), shop.schema.records()));
    let tiers = tower::ServiceBuilder::new().layer(flag).layer(three_step);
    let layer = IdempotencyLayer::new(tiers, shop.responses(), ClientScope::header(TENANT));
    let runs = three_refused(layer, |_| "misconfigured".to_owned()).await;
    assert_eq!(
        runs, 0,
        "the handler ran behind a stack that cannot keep its response"
    );
}

/// Stored responses whose table was never migrated are a misconfiguration, said once at
/// error level, and no handler runs while it lasts.
#[tokio::test]
async fn a_responses_table_never_migrated_is_said_once_and_runs_nothing() {
    use oncely::record::PgTransactionalLayer;
    use oncely_http::{ClientScope, IdempotencyLayer, PgResponses};

    let logs = integration_tests::logs::CapturedLogs::start();
    let shop = Shop::new(4).await;
    let unmigrated = oncely::postgres::Table::new(shop.schema.name(), "orders_record").expect("a name");
    oncely::postgres::migrate(&shop.pool, &unmigrated)
        .await
        .expect("the record table");
    let record = PgTransactionalLayer::new(shop.pool.clone(), unmigrated.clone());
    let responses = PgResponses::new(shop.pool.clone(), &unmigrated).expect("a name");
    let layer = IdempotencyLayer::new(record, responses, ClientScope::header(TENANT));
    let runs = three_refused(layer, |attempt| format!("unmigrated-{attempt}")).await;
    assert_eq!(runs, 0);
    let said = logs.lines("ERROR", "orders_record_responses");
    assert_eq!(said.len(), 1, "{}", logs.text());
    assert!(said[0].contains("PgResponses::migrate()"), "{said:?}");
}

/// `layer` around a handler that only counts its runs and answers 201, served; asserts
/// that three requests (keys from `key`) are each refused as misconfigured, and answers the
/// handler's runs.
async fn three_refused<L>(layer: L, key: impl Fn(u32) -> String) -> usize
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service: tower::Service<axum::extract::Request, Error = std::convert::Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Response: axum::response::IntoResponse + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Future: Send + 'static,
{
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = move || async move {
        counted.fetch_add(1, Ordering::SeqCst);
        (axum::http::StatusCode::CREATED, "created")
    };
    let app = axum::Router::new()
        .route("/orders", axum::routing::post(handler))
        .layer(layer);
    let server = TestServer::start(app).await;
    for attempt in 1..=3 {
        let answer = send(order(&server, &key(attempt))).await;
        assert_eq!(answer.status, 500, "attempt {attempt}: {answer:?}");
        assert!(
            answer.body.contains("Misconfigured"),
            "attempt {attempt}: {answer:?}"
        );
    }
    runs.load(Ordering::SeqCst)
}
