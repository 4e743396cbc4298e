//! `oncely` on the tables of an HTTP route (oncely-http's), on PostgreSQL and MariaDB:
//! a purge never re-opens a key whose response can still be replayed, `inspect` finds a
//! client's key and shows its stored response, and no client's secret shows anywhere.

mod common;

use common::{args, assert_code, oncely, oncely_without, stdout};
use integration_tests::both_stores;
use integration_tests::http::{ORDER, OTHER_ORDER, TENANT, TestServer, client, post_as, send};
use integration_tests::http_stores::{AnyShop, HttpStore};
use integration_tests::logs::CapturedLogs;
use integration_tests::redis_url;

both_stores!(
    a_purge_keeps_a_key_whose_response_lives_and_removes_both_once_it_expired,
    no_client_secret_is_stored_shown_or_logged,
);

const DAY: i64 = 24 * 3600;

/// Moves the shop's record rows and stored responses `seconds` into the past.
async fn age(shop: &AnyShop, seconds: i64) {
    for (table, column) in [
        ("consumption_record", "updated_at"),
        ("consumption_record", "created_at"),
        ("consumption_record_responses", "expires_at"),
    ] {
        shop.execute(&shop.shift_sql(table, column, seconds, "1 = 1"))
            .await;
    }
}

/// A completed key's rows aged two days under a 72 h expiry, then `oncely purge
/// --older-than 1d`: the record row stays while the response lives (the key's copy is a
/// replay, not a second effect). Aged past the expiry, the two go together, and the key is
/// new again.
async fn a_purge_keeps_a_key_whose_response_lives_and_removes_both_once_it_expired(store: HttpStore) {
    let shop = AnyShop::new(store, 4).await;
    // The record alone: the point is the record's retention, not the flag's window.
    let server = TestServer::start(shop.record_only_app(false)).await;
    let first = send(post_as(&server, "/orders", "acme", Some("order-42"), ORDER)).await;
    assert_eq!(first.status, 201, "{first:?}");

    age(&shop, 2 * DAY).await;
    let purge = args(
        &shop.cli_args().iter().map(String::as_str).collect::<Vec<_>>(),
        &["purge", "--older-than", "1d", "--yes"],
    );
    let purged = oncely(&purge).await;
    assert_code(&purged, 0);
    let report = stdout(&purged);
    assert!(
        report.contains("purged 0 SUCCESS rows older than 1 day"),
        "{report}"
    );
    assert!(
        report.contains("kept 1 whose stored responses still live"),
        "{report}"
    );
    let again = send(post_as(&server, "/orders", "acme", Some("order-42"), ORDER)).await;
    assert!(
        again.is_replay(),
        "a purge re-opened a key whose response lives: {again:?}"
    );
    assert_eq!(again.body, first.body);
    assert_eq!(shop.effects().await, 1, "the key ran twice");

    // Past its expiry (72 h): the record row and the response go together.
    age(&shop, 2 * DAY).await;
    let purged = oncely(&purge).await;
    assert_code(&purged, 0);
    assert!(
        stdout(&purged).contains("purged 1 SUCCESS rows"),
        "{}",
        stdout(&purged)
    );
    assert_eq!(shop.count("SELECT count(*) FROM consumption_record").await, 0);
    assert_eq!(
        shop.count("SELECT count(*) FROM consumption_record_responses")
            .await,
        0
    );
    let new_again = send(post_as(&server, "/orders", "acme", Some("order-42"), ORDER)).await;
    assert_eq!(
        (new_again.status, new_again.is_replay()),
        (201, false),
        "{new_again:?}"
    );
}

/// The README's session with an API key as the client's identity: the key never reaches
/// a table, the command line's output or the logs; the command line finds the client's key
/// all the same, with its stored response.
async fn no_client_secret_is_stored_shown_or_logged(store: HttpStore) {
    const SECRET: &str = "sk_live_4eC39HqLyjWDarjtT1zdp7dc";
    let logs = CapturedLogs::start();
    let shop = AnyShop::new(store, 8).await;
    let server = TestServer::start(
        shop.app(&redis_url(), integration_tests::http::HANDLER_TIMEOUT)
            .await,
    )
    .await;
    let as_client = |client_key: &str, key: Option<&str>, body: &'static str| {
        let request = client()
            .post(server.url("/orders"))
            .header(TENANT, client_key)
            .body(body);
        match key {
            Some(key) => request.header("idempotency-key", key),
            None => request,
        }
    };
    let first = send(as_client(SECRET, Some(r#""order-42""#), ORDER)).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(
        send(as_client(SECRET, Some(r#""order-42""#), ORDER))
            .await
            .is_replay()
    );
    assert_eq!(
        send(as_client(SECRET, Some(r#""order-42""#), OTHER_ORDER))
            .await
            .status,
        422
    );
    assert_eq!(
        send(as_client("sk_live_bob", Some(r#""order-42""#), ORDER))
            .await
            .status,
        201
    );
    assert_eq!(send(as_client(SECRET, None, ORDER)).await.status, 400);

    let base = shop.cli_args();
    let base: Vec<&str> = base.iter().map(String::as_str).collect();
    // Without the client: not found, and the keys recorded for it under some client's scope.
    let unscoped = oncely_without(&args(&base, &["inspect", "order-42"]), &["REDIS_URL"]).await;
    assert_code(&unscoped, 3);
    assert!(stdout(&unscoped).contains("--client"), "{}", stdout(&unscoped));
    // With it: the record row and the stored response, Redis not asked.
    let scoped = oncely_without(
        &args(&base, &["inspect", "order-42", "--client", SECRET]),
        &["REDIS_URL"],
    )
    .await;
    assert_code(&scoped, 0);
    let view = stdout(&scoped);
    for shown in ["SUCCESS", "stored response", "201", "answered again until then"] {
        assert!(view.contains(shown), "{shown} missing: {view}");
    }
    assert!(
        !view.contains("flag (Redis)"),
        "Redis asked though not named: {view}"
    );
    let mut printed = format!("{}{}{view}", stdout(&unscoped), common::stderr(&unscoped));
    for command in [
        &["stuck"][..],
        &["stats"],
        &["inspect", "order-42", "--client", SECRET, "--json"],
    ] {
        let output = oncely(&args(&base, command)).await;
        printed.push_str(&stdout(&output));
        printed.push_str(&common::stderr(&output));
    }

    let mut redis = integration_tests::redis_connection(&redis_url()).await;
    let flag_keys: Vec<String> = oncely::redis::cmd("KEYS")
        .arg(format!("*{}*", shop_prefix(&shop)))
        .query_async(&mut redis)
        .await
        .expect("the flag's keys");
    assert!(!flag_keys.is_empty(), "the flag wrote nothing");
    for (place, text) in [
        ("a table", shop.dump().await),
        ("the command line's output", printed),
        ("the logs", logs.text()),
        ("the flag's Redis keys", flag_keys.join("\n")),
    ] {
        assert!(
            !text.contains(SECRET),
            "the client's API key is in {place}:\n{text}"
        );
        assert!(
            !text.contains("sk_live"),
            "a client's API key is in {place}:\n{text}"
        );
    }
}

/// The Redis prefix of the shop's flag.
fn shop_prefix(shop: &AnyShop) -> &str {
    match shop {
        AnyShop::Postgres(shop) => &shop.prefix,
        AnyShop::Mariadb(shop) => &shop.prefix,
    }
}
