//! oncely-http on each SQL store (PostgreSQL and MariaDB), against a real server, Redis and
//! the store: the cases every store must pass, written once.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_lite::future::try_zip;
use integration_tests::both_stores;
use integration_tests::http::{
    HANDLER_TIMEOUT, ORDER, OTHER_ORDER, RawRequest, TENANT, TestServer, client, fetch_token, post_as,
    problem_type, send, sixty_four_copies, submit,
};
use integration_tests::http_stores::{AnyShop, HttpStore};
use integration_tests::logs::CapturedLogs;
use integration_tests::redis_url;

both_stores!(
    a_key_runs_once_among_64_copies_and_is_answered_again,
    a_handler_that_panics_commits_nothing_and_the_retry_runs,
    a_one_time_token_lets_one_submit_through,
    a_handler_that_swallows_a_failed_statement_commits_nothing,
    a_copy_that_waits_out_the_lock_timeout_is_answered_409,
    a_stored_response_is_never_replaced,
    with_the_batched_record_copies_apply_once_and_a_failure_spares_its_batch,
    a_client_that_hangs_up_in_a_batch_spares_its_neighbours,
);

/// A shop on `store` served with the flag in front of the record.
async fn shop_server(store: HttpStore) -> (AnyShop, TestServer) {
    let shop = AnyShop::new(store, 16).await;
    let server = TestServer::start(shop.app(&redis_url(), HANDLER_TIMEOUT).await).await;
    (shop, server)
}

async fn a_key_runs_once_among_64_copies_and_is_answered_again(store: HttpStore) {
    let (shop, server) = shop_server(store).await;
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
    let again = send(post_as(&server, "/orders", "acme", Some("k-64"), ORDER)).await;
    assert!(again.is_replay(), "{again:?}");
    assert_eq!(again.body, ran[0].body);
    let other = send(post_as(&server, "/orders", "acme", Some("k-64"), OTHER_ORDER)).await;
    assert_eq!(other.status, 422);
    assert_eq!(shop.effects().await, 1);
}

async fn a_handler_that_panics_commits_nothing_and_the_retry_runs(store: HttpStore) {
    let (shop, server) = shop_server(store).await;
    shop.faults().panics.store(1, Ordering::SeqCst);
    let panicked = send(post_as(&server, "/orders", "acme", Some("p"), ORDER)).await;
    assert_eq!(
        (panicked.status, problem_type(&panicked).as_str()),
        (500, "HandlerFailed")
    );
    assert_eq!(shop.effects().await, 0, "the panicking run's write was committed");
    let retried = send(post_as(&server, "/orders", "acme", Some("p"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(shop.effects().await, 1);
}

async fn a_one_time_token_lets_one_submit_through(store: HttpStore) {
    let (shop, server) = shop_server(store).await;
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
    let expire =
        |token: &str| shop.shift_sql("form_tokens", "expires_at", 700, &format!("token = '{token}'"));
    shop.execute(&expire(&expiring)).await;
    let expired = send(submit(&server, "acme", &expiring)).await;
    assert_eq!(
        (expired.status, problem_type(&expired).as_str()),
        (410, "TokenExpired")
    );
    // A token that ran before it expired still answers its result.
    shop.execute(&expire(&token)).await;
    assert!(send(submit(&server, "acme", &token)).await.is_replay());
    assert_eq!(shop.effects().await, 1);
}

async fn a_handler_that_swallows_a_failed_statement_commits_nothing(store: HttpStore) {
    let (shop, server) = shop_server(store).await;
    // The failed statement aborted the transaction (PostgreSQL) or would commit the rest
    // without it (MariaDB): the 201 the handler answers cannot be the key's result.
    shop.faults().swallowed.store(1, Ordering::SeqCst);
    let swallowed = send(post_as(&server, "/orders", "acme", Some("s"), ORDER)).await;
    assert_eq!(
        (swallowed.status, problem_type(&swallowed).as_str()),
        (500, "HandlerFailed")
    );
    assert_eq!(shop.effects().await, 0);
    let retried = send(post_as(&server, "/orders", "acme", Some("s"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(shop.effects().await, 1);
}

/// A copy that waits in the record for its key's first request until the store gives up
/// on it (a lock timeout) conflicts with a request in progress: 409 with `Retry-After`, as
/// draft-07 says, not 503.
async fn a_copy_that_waits_out_the_lock_timeout_is_answered_409(store: HttpStore) {
    let shop = AnyShop::new(store, 4).await;
    let server = TestServer::start(shop.impatient_app().await).await;
    // The first run's statement sleeps past the handler's timeout, holding the key's row.
    shop.faults().stalls.store(1, Ordering::SeqCst);
    let first = tokio::spawn(send(post_as(&server, "/orders", "acme", Some("w"), ORDER)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let copy = send(post_as(&server, "/orders", "acme", Some("w"), ORDER)).await;
    assert_eq!(
        (copy.status, problem_type(&copy).as_str()),
        (409, "KeyInFlight"),
        "{copy:?}"
    );
    assert!(copy.headers.get("retry-after").is_some(), "{copy:?}");
    let first = first.await.expect("the first request's task");
    assert_eq!(first.status, 500, "cut off by the handler's timeout: {first:?}");
    let retried = send(post_as(&server, "/orders", "acme", Some("w"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(shop.effects().await, 1);
}

/// A key whose record row went without its response (an earlier version's purge did that)
/// runs again when it comes back, but its new response never replaces the first one: the
/// commit fails (500, logged at error level) and nothing of the second run stays.
async fn a_stored_response_is_never_replaced(store: HttpStore) {
    let logs = CapturedLogs::start();
    // The record alone: the flag would answer the copy long before (until its window ends).
    let shop = AnyShop::new(store, 4).await;
    let server = TestServer::start(shop.record_only_app(false)).await;
    let first = send(post_as(&server, "/orders", "acme", Some("once"), ORDER)).await;
    assert_eq!(first.status, 201, "{first:?}");
    // The record row moved aside, then back: gone meanwhile, as a purge would leave it.
    shop.execute("UPDATE consumption_record SET message_key = CONCAT('aside-', message_key)")
        .await;
    let again = send(post_as(&server, "/orders", "acme", Some("once"), ORDER)).await;
    assert_eq!(
        (again.status, problem_type(&again).as_str()),
        (500, "HandlerFailed"),
        "{again:?}"
    );
    assert_eq!(shop.effects().await, 1, "the second run's effect was committed");
    // The second run's failure is noted on a row of its own; the first run's comes back.
    shop.execute("DELETE FROM consumption_record WHERE message_key NOT LIKE 'aside-%'")
        .await;
    shop.execute("UPDATE consumption_record SET message_key = SUBSTRING(message_key, 7)")
        .await;
    let replayed = send(post_as(&server, "/orders", "acme", Some("once"), ORDER)).await;
    assert!(replayed.is_replay(), "{replayed:?}");
    assert_eq!(replayed.body, first.body, "the stored response was replaced");
    let said = logs.lines("ERROR", "constraint");
    assert!(!said.is_empty(), "nothing said at error level: {}", logs.text());
}

/// On MariaDB a statement the handler cut off itself may still run on the server: the run
/// cannot commit, and that is the handler's failure (500), not a store's (503).
#[tokio::test]
async fn on_mariadb_a_statement_the_handler_cut_off_fails_the_handler() {
    let (shop, server) = shop_server(HttpStore::Mariadb).await;
    shop.faults().cut_off.store(1, Ordering::SeqCst);
    let cut = send(post_as(&server, "/orders", "acme", Some("c"), ORDER)).await;
    assert_eq!(
        (cut.status, problem_type(&cut).as_str()),
        (500, "HandlerFailed"),
        "{cut:?}"
    );
    assert_eq!(shop.effects().await, 0);
    let retried = send(post_as(&server, "/orders", "acme", Some("c"), ORDER)).await;
    assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    assert_eq!(shop.effects().await, 1);
}

async fn with_the_batched_record_copies_apply_once_and_a_failure_spares_its_batch(store: HttpStore) {
    let shop = AnyShop::new(store, 16).await;
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
    shop.faults()
        .panic_at_run
        .store(20, std::sync::atomic::Ordering::SeqCst);
    shop.faults()
        .unavailable
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let keys: Vec<String> = (0..64).map(|i| format!("b-{i}")).collect();
    let requests = keys.iter().map(|key| {
        let request =
            post_as(&server, "/orders", "acme", None, ORDER).header("idempotency-key", key.as_str());
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
            send(post_as(&server, "/orders", "acme", None, ORDER).header("idempotency-key", key)).await;
        assert_eq!((retried.status, retried.is_replay()), (201, false), "{retried:?}");
    }
    assert_eq!(shop.effects().await, 1 + 64);
}

/// 16 requests kept open and 16 whose clients hang up after 5 ms, batched together while
/// each run takes 3 ms: a request gone before its turn is taken out of its batch (its claim
/// withdrawn), and the batch commits the others. Each kept request runs once — a batch
/// rolled back would run its requests again — and no request gone before its turn runs.
/// Rounds until one request left between its claim and its turn (how arrivals spread over
/// the lanes varies) in a round where no batch lost a claim to another lane, at most five:
/// seen on a key the batch took over, which a withdrawal leaves noted.
async fn a_client_that_hangs_up_in_a_batch_spares_its_neighbours(store: HttpStore) {
    let logs = CapturedLogs::start();
    let shop = AnyShop::new(store, 16).await;
    let server = TestServer::start(shop.record_only_app(true)).await;
    shop.faults().pace_ms.store(3, Ordering::SeqCst);
    let mut effects = 0;
    for round in 0..5 {
        let Round { committed, clean } = hang_up_round(&shop, &server, &logs, round).await;
        effects += committed;
        assert_eq!(shop.effects().await, effects);
        let withdrawn = format!(
            "SELECT count(*) FROM consumption_record WHERE error_details LIKE '%withdrawn%' AND message_key LIKE '%:r{round}-%'"
        );
        if clean && shop.count(&withdrawn).await > 0 {
            return;
        }
    }
    panic!("in five rounds no request left between its claim and its turn: the test shows nothing");
}

/// What one round of [`a_client_that_hangs_up_in_a_batch_spares_its_neighbours`] did.
struct Round {
    /// The effects it committed.
    committed: i64,
    /// False if a batch lost a claim to another lane's (on MariaDB, a deadlock or a lock
    /// wait, which rolls back what the batch ran so far, hang-up or not): its reruns show
    /// nothing about hang-ups.
    clean: bool,
}

/// The batched record's reports of a batch that lost a claim, or the withdrawal of its gone
/// deliveries' claims, to another lane's (the server's verdict on a deadlock or a lock wait),
/// logged since `logs` began.
fn claims_lost(logs: &CapturedLogs) -> Vec<String> {
    let mut lost = logs.lines("DEBUG", "a batch lost its joiners' claims to another transaction");
    lost.extend(logs.lines("DEBUG", "a batch lost its claim to another transaction"));
    lost.extend(logs.lines(
        "DEBUG",
        "a batch lost its withdrawal of deliveries gone to another transaction",
    ));
    lost
}

/// One round of [`a_client_that_hangs_up_in_a_batch_spares_its_neighbours`].
async fn hang_up_round(shop: &AnyShop, server: &TestServer, logs: &CapturedLogs, round: usize) -> Round {
    let lost_before = claims_lost(logs).len();
    let body = |key: &str| format!(r#"{{"order":"{key}"}}"#);
    // Interleaved in key order, so that the batch's turns alternate between the two.
    let kept: Vec<String> = (0..16).map(|i| format!("r{round}-{i:02}-a-kept")).collect();
    let leaving: Vec<String> = (0..16).map(|i| format!("r{round}-{i:02}-b-leaving")).collect();
    // Half the leaving keys failed once already: the batch takes their rows over, and a
    // withdrawal leaves them noted; the others' claims are new, and a withdrawal leaves no row.
    let failed_before: Vec<&String> = leaving.iter().step_by(2).collect();
    shop.faults()
        .unavailable
        .store(failed_before.len() as u32, Ordering::SeqCst);
    for key in &failed_before {
        let (status, _) = RawRequest::post(server, "acme", key, &body(key))
            .await
            .answer()
            .await;
        assert_eq!(status, 503, "{key}");
    }
    // How often `key` ran in this round's storm.
    let runs = |key: &String| shop.faults().runs_of(&body(key)) - usize::from(failed_before.contains(&key));
    let mut sent = Vec::new();
    for (kept, leaving) in kept.iter().zip(&leaving) {
        sent.push(RawRequest::post(server, "acme", kept, &body(kept)).await);
        sent.push(RawRequest::post(server, "acme", leaving, &body(leaving)).await);
    }
    let mut kept_answers = Vec::new();
    for (index, request) in sent.into_iter().enumerate() {
        match index % 2 {
            0 => kept_answers.push(tokio::spawn(request.answer())),
            _ => {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    drop(request);
                });
            }
        }
    }
    for (key, answer) in kept.iter().zip(kept_answers) {
        let answer = answer.await.expect("a kept request's task");
        assert_eq!(answer, (201, false), "{key}");
    }
    let clean = claims_lost(logs).len() == lost_before;
    for key in &kept {
        assert!(
            runs(key) == 1 || (runs(key) == 2 && !clean),
            "{key} ran {} times: its batch rolled back. What the batches and the layer logged:\n{}",
            runs(key),
            [
                logs.lines("", "batch"),
                logs.lines("WARN", ""),
                logs.lines("ERROR", "")
            ]
            .concat()
            .join("\n")
        );
    }
    // Every run that started goes on to its end; none gone before its turn runs.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for key in &leaving {
        assert!(runs(key) <= 1, "{key} ran twice");
        if runs(key) == 0 && !failed_before.contains(&key) {
            let rows = format!("SELECT count(*) FROM consumption_record WHERE message_key LIKE '%:{key}'");
            assert_eq!(
                shop.count(&rows).await,
                0,
                "{key} never ran, and left a row behind"
            );
        }
    }
    // A request gone before its turn runs when its client comes back.
    if let Some(gone) = leaving.iter().find(|key| runs(key) == 0) {
        let answer = RawRequest::post(server, "acme", gone, &body(gone))
            .await
            .answer()
            .await;
        assert_eq!(answer, (201, false), "{gone}");
    }
    let ran = leaving.iter().filter(|key| runs(key) > 0).count();
    Round {
        committed: 16 + ran as i64,
        clean,
    }
}
