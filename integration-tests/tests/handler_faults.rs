//! Handler bugs against the transactional record on a real PostgreSQL: a swallowed statement
//! error, a panic, a timeout that drops the stack's future, and input that is not what the
//! schema says. Each test asserts what a user relies on: the business rows, the record rows
//! and the outcome the adapter would act on.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use deadpool_postgres::Pool;
use deadpool_postgres::tokio_postgres;
use integration_tests::postgres::{
    BoxedStack, RecordMode, ScratchSchema, insert_stock_move, pool, stock_schema,
};
use oncely::record::{CommitRows, PgTransaction};
use oncely::{
    DeadLetterReason, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, Source,
    handler_fn,
};
use tower::ServiceBuilder;
use tower::timeout::TimeoutLayer;

fn order(id: &str) -> Delivery {
    Delivery::new(
        Source::new("orders"),
        format!(r#"{{"orderId":"{id}","sku":"sku-1"}}"#),
    )
}

async fn status_of(schema: &ScratchSchema, key: &str) -> Option<String> {
    let client = pool(1).get().await.expect("PostgreSQL");
    client
        .query_opt(
            &format!(
                "SELECT status FROM {}.consumption_record WHERE message_key = $1",
                schema.name()
            ),
            &[&key],
        )
        .await
        .expect("read the record")
        .map(|row| row.get(0))
}

async fn moves_of(schema: &ScratchSchema, key: &str) -> i64 {
    schema
        .count(&format!(
            "SELECT count(*) FROM stock_moves WHERE order_id = '{key}'"
        ))
        .await
}

/// The transactional record in `mode` on `pool` in front of `handler`, keyed by the body's
/// `/orderId`.
fn transactional<F, Fut>(
    mode: RecordMode,
    pool: &Pool,
    schema: &ScratchSchema,
    handler: F,
) -> Route<BoxedStack>
where
    F: FnMut(Envelope) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let stack = mode.stack(pool, schema.records(), handler_fn(handler));
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

fn the_transaction(envelope: &Envelope) -> PgTransaction {
    envelope
        .extensions()
        .get::<PgTransaction>()
        .expect("the transactional record in front")
        .clone()
}

/// Writes the stock move, then runs `bug` in the same transaction and ignores its error, as a
/// handler that treats a unique violation as "already applied" does.
async fn swallowing_handler(envelope: Envelope, bug: &str) -> Result<(), HandlerError> {
    insert_stock_move(&envelope).await?;
    let _ignored = the_transaction(&envelope).client().batch_execute(bug).await;
    Ok(())
}

#[tokio::test]
async fn a_swallowed_statement_error_is_retried_never_acked_as_processed() {
    for mode in RecordMode::ALL {
        for bug in [
            "SELECT 1/0",
            // The same order again: a unique violation the handler takes for "already applied".
            "INSERT INTO stock_moves (order_id) SELECT order_id FROM stock_moves",
        ] {
            let (schema, pool) = stock_schema(4).await;
            let route = transactional(mode, &pool, &schema, move |envelope| {
                swallowing_handler(envelope, bug)
            });

            handled_as_failed_with_nothing_committed(&route, &schema, "o-1", bug).await;
            assert_eq!(
                status_of(&schema, "o-1").await.as_deref(),
                Some("FAILURE"),
                "{bug}: the attempt is noted, not recorded as done"
            );

            // The redelivery, handled by a fixed handler, applies the effect once.
            let route = transactional(mode, &pool, &schema, |envelope: Envelope| async move {
                insert_stock_move(&envelope).await
            });
            assert_eq!(route.handle(order("o-1")).await, Outcome::Processed, "{bug}");
            assert_eq!(moves_of(&schema, "o-1").await, 1, "{bug}");
        }
    }
}

#[tokio::test]
async fn a_handler_that_ends_the_transaction_itself_is_retried() {
    for mode in RecordMode::ALL {
        // A write then "ROLLBACK"; or "ROLLBACK" (with or without a "BEGIN") then a write, which
        // would commit without the key's record and be applied again by the retry: the commit
        // checks the transaction is still the one that claimed the key, and outside it the
        // session is read-only. A write then "COMMIT": the record's guard trigger fails it.
        // Rows deferred to the commit after its own "ROLLBACK" are refused (a read-only
        // session) and answered as the handler's failure, not the store's.
        for (ending, write_first, defers) in [
            ("ROLLBACK", true, false),
            ("ROLLBACK; BEGIN", false, false),
            ("ROLLBACK", false, false),
            ("COMMIT", true, false),
            ("ROLLBACK", true, true),
        ] {
            let (schema, pool) = stock_schema(4).await;
            let first = Arc::new(AtomicUsize::new(0));
            let route = transactional(mode, &pool, &schema, move |envelope: Envelope| {
                let misbehaves = first.fetch_add(1, Ordering::SeqCst) == 0;
                async move {
                    if write_first || !misbehaves {
                        insert_stock_move(&envelope).await?;
                    }
                    if misbehaves {
                        the_transaction(&envelope).client().batch_execute(ending).await?;
                        if !write_first {
                            insert_stock_move(&envelope).await?;
                        }
                        if defers {
                            the_transaction(&envelope).defer(StockMoveAtCommit(envelope.key().to_string()));
                        }
                    }
                    Ok::<(), HandlerError>(())
                }
            });
            handled_as_failed_with_nothing_committed(
                &route,
                &schema,
                "o-1",
                &format!("{mode:?} {ending}, deferring: {defers}"),
            )
            .await;
            assert_eq!(route.handle(order("o-1")).await, Outcome::Processed, "{ending}");
            assert_eq!(moves_of(&schema, "o-1").await, 1, "{ending}: applied once");
        }
    }
}

/// A stock move deferred to the record's commit.
struct StockMoveAtCommit(String);

impl CommitRows for StockMoveAtCommit {
    fn absorb(&mut self, more: Self) -> Option<Self> {
        Some(more)
    }

    async fn write(self, client: &deadpool_postgres::Client) -> Result<(), tokio_postgres::Error> {
        client
            .execute("INSERT INTO stock_moves (order_id) VALUES ($1)", &[&self.0])
            .await?;
        Ok(())
    }
}

/// What a faulty first call does after writing the stock move.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Panic,
    Hang,
}

/// A stack on a pool of ONE connection, so the next delivery gets the very connection the
/// faulty one used: writes the stock move, then on the first call panics or hangs past a
/// `tower` timeout placed in front of the whole stack.
fn faulty_route(
    mode: RecordMode,
    pool: &Pool,
    schema: &ScratchSchema,
    fault: Fault,
) -> Route<
    impl tower::Service<Envelope, Response = Outcome, Error = tower::BoxError, Future: Send>
    + Clone
    + Send
    + Sync
    + use<>,
> {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = handler_fn(move |envelope: Envelope| {
        let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            insert_stock_move(&envelope).await?;
            match fault {
                Fault::Panic if first => panic!("bug in the handler"),
                Fault::Hang if first => tokio::time::sleep(Duration::from_secs(30)).await,
                Fault::Panic | Fault::Hang => {}
            }
            Ok::<(), HandlerError>(())
        }
    });
    let stack = ServiceBuilder::new()
        .layer(TimeoutLayer::new(Duration::from_millis(300)))
        .service(mode.stack(pool, schema.records(), handler));
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_or_a_timeout_mid_transaction_commits_nothing_and_poisons_no_connection() {
    for mode in RecordMode::ALL {
        for (fault, reason) in [
            (Fault::Panic, RetryReason::HandlerPanicked),
            (Fault::Hang, RetryReason::HandlerFailed),
        ] {
            let (schema, pool) = stock_schema(1).await;
            let route = faulty_route(mode, &pool, &schema, fault);

            let outcome = route.handle(order("o-cut")).await;
            assert_eq!(outcome.retry_reason(), Some(reason), "{fault:?}: {outcome}");
            // The next delivery on the pool's one connection must not commit the abandoned one.
            assert_eq!(
                route.handle(order("o-next")).await,
                Outcome::Processed,
                "{fault:?}"
            );
            assert_eq!(
                moves_of(&schema, "o-cut").await,
                0,
                "{fault:?}: half an effect committed"
            );
            // No record, or the failed attempt noted (the batched mode catches a panic itself).
            let status = status_of(&schema, "o-cut").await;
            assert!(
                matches!(status.as_deref(), None | Some("FAILURE")),
                "{mode:?} {fault:?}: {status:?}"
            );

            // The abandoned delivery's retry is new work, not a duplicate, and is not blocked.
            assert_eq!(
                route.handle(order("o-cut")).await,
                Outcome::Processed,
                "{fault:?}"
            );
            assert_eq!(moves_of(&schema, "o-cut").await, 1, "{fault:?}");
            assert_eq!(moves_of(&schema, "o-next").await, 1, "{fault:?}");
        }
    }
}

#[tokio::test]
async fn a_panic_at_the_attempt_limit_is_dead_lettered_saying_it_panicked() {
    for mode in RecordMode::ALL {
        let (schema, pool) = stock_schema(2).await;
        let route = transactional(mode, &pool, &schema, |envelope: Envelope| async move {
            insert_stock_move(&envelope).await?;
            panic!("index out of bounds");
            #[allow(unreachable_code)]
            Ok::<(), HandlerError>(())
        })
        .with_max_attempts(2);
        let first = route.handle(order("o-1")).await;
        assert_eq!(
            first.retry_reason(),
            Some(RetryReason::HandlerPanicked),
            "{first}"
        );
        let last = route.handle(order("o-1").with_attempt(2)).await;
        match &last {
            Outcome::DeadLetter(dead) => {
                assert_eq!(dead.reason, DeadLetterReason::AttemptsExhausted);
                assert!(dead.detail.contains("panicked: index out of bounds"), "{dead}");
            }
            other => panic!("expected a dead letter, got {other}"),
        }
        assert_eq!(moves_of(&schema, "o-1").await, 0);
    }
}

/// `with_max_panic_attempts(1)`: a panic is dead-lettered at once, while another failure of
/// the same route still gets its retries.
#[tokio::test]
async fn a_route_may_dead_letter_panics_sooner_than_other_failures() {
    let (schema, pool) = stock_schema(2).await;
    let route = transactional(
        RecordMode::PerDelivery,
        &pool,
        &schema,
        |envelope: Envelope| async move {
            insert_stock_move(&envelope).await?;
            if envelope.key().as_str() == "o-panics" {
                panic!("index out of bounds");
            }
            Err(HandlerError::transient("downstream unavailable"))
        },
    )
    .with_max_attempts(3)
    .with_max_panic_attempts(1);
    match route.handle(order("o-panics")).await {
        Outcome::DeadLetter(dead) => {
            assert_eq!(dead.reason, DeadLetterReason::AttemptsExhausted);
            assert!(dead.detail.contains("panicked: index out of bounds"), "{dead}");
        }
        other => panic!("expected a dead letter at the first panic, got {other}"),
    }
    let failed = route.handle(order("o-fails")).await;
    assert_eq!(
        failed.retry_reason(),
        Some(RetryReason::HandlerFailed),
        "{failed}"
    );
    // Without a panic limit, panics get the route's attempts, however many.
    let patient = transactional(
        RecordMode::PerDelivery,
        &pool,
        &schema,
        |_: Envelope| async move {
            panic!("index out of bounds");
            #[allow(unreachable_code)]
            Ok::<(), HandlerError>(())
        },
    )
    .with_max_attempts(20);
    let late = patient.handle(order("o-late").with_attempt(17)).await;
    assert_eq!(late.retry_reason(), Some(RetryReason::HandlerPanicked), "{late}");
    // Awaited last: it also lets the runtime close the connections the panics discarded,
    // before the schema is dropped.
    assert_eq!(
        moves_of(&schema, "o-panics").await + moves_of(&schema, "o-fails").await,
        0
    );
}

#[tokio::test]
async fn bad_input_is_dead_lettered_before_any_store_round_trip() {
    let (schema, pool) = stock_schema(2).await;
    let route = transactional(
        RecordMode::Batched,
        &pool,
        &schema,
        |envelope: Envelope| async move { insert_stock_move(&envelope).await },
    )
    .with_max_body_len(1024 * 1024);
    let source = || Source::new("orders");
    let cases = [
        (
            Delivery::new(source(), "{\"orderId\":\"o-\\u0000-1\"}"),
            DeadLetterReason::InvalidKey,
        ),
        (
            Delivery::new(source(), "{\"orderId\":\"o-\\n-1\"}"),
            DeadLetterReason::InvalidKey,
        ),
        (
            Delivery::new(source(), r#"{"orderId":123456789012345678901234567890}"#),
            DeadLetterReason::InvalidKey,
        ),
        (
            Delivery::new(source(), vec![b' '; 10 * 1024 * 1024]),
            DeadLetterReason::Oversize,
        ),
    ];
    for (delivery, reason) in cases {
        let outcome = route.handle(delivery.with_attempt(u32::MAX)).await;
        assert_eq!(outcome.dead_letter_reason(), Some(reason), "{outcome}");
    }
    assert_eq!(
        schema.count("SELECT count(*) FROM consumption_record").await,
        0,
        "no record was written or noted"
    );
}

/// Handles `order_id` once through `route` and checks it was answered a retry for a handler
/// failure, with no stock move committed; returns the outcome's text. `case` names the case
/// in failure messages.
async fn handled_as_failed_with_nothing_committed<
    S: integration_tests::RouteStack<oncely::BoxError> + 'static,
>(
    route: &Route<S>,
    schema: &ScratchSchema,
    order_id: &str,
    case: &str,
) -> String {
    let outcome = route.handle(order(order_id)).await;
    assert_eq!(
        outcome.retry_reason(),
        Some(RetryReason::HandlerFailed),
        "{case}: {outcome}"
    );
    assert_eq!(moves_of(schema, order_id).await, 0, "{case}: nothing committed");
    outcome.to_string()
}

#[tokio::test]
async fn a_handler_that_keeps_its_transaction_past_its_answer_commits_nothing() {
    for mode in RecordMode::ALL {
        let (schema, pool) = stock_schema(2).await;
        let kept: Arc<std::sync::Mutex<Option<PgTransaction>>> = Arc::default();
        let keeper = kept.clone();
        let route = transactional(mode, &pool, &schema, move |envelope: Envelope| {
            let keeper = keeper.clone();
            async move {
                insert_stock_move(&envelope).await?;
                // E.g. handed to a task that writes later, outside the record.
                *keeper.lock().unwrap() = Some(the_transaction(&envelope));
                Ok::<(), HandlerError>(())
            }
        });
        handled_as_failed_with_nothing_committed(&route, &schema, "o-1", "kept").await;
        drop(kept.lock().unwrap().take());
    }
}

#[tokio::test]
async fn a_commit_the_server_refuses_is_retried_and_its_connection_reused() {
    for mode in RecordMode::ALL {
        let (schema, pool) = stock_schema(1).await;
        schema
        .execute(
            "CREATE TABLE ledger (entry TEXT NOT NULL, CONSTRAINT one_entry UNIQUE (entry) DEFERRABLE INITIALLY DEFERRED)",
        )
        .await;
        let route = transactional(mode, &pool, &schema, |envelope: Envelope| async move {
            insert_stock_move(&envelope).await?;
            let entries = if envelope.key().as_str() == "o-twice" {
                2
            } else {
                1
            };
            for _ in 0..entries {
                the_transaction(&envelope)
                    .client()
                    .execute(
                        "INSERT INTO ledger (entry) VALUES ($1)",
                        &[&envelope.key().as_str()],
                    )
                    .await?;
            }
            Ok::<(), HandlerError>(())
        });
        let outcome = handled_as_failed_with_nothing_committed(&route, &schema, "o-twice", "refused").await;
        assert!(outcome.contains("commit was refused"), "{outcome}");
        assert_eq!(route.handle(order("o-once")).await, Outcome::Processed);
    }
}

#[tokio::test]
async fn a_handler_that_fails_and_keeps_its_transaction_cannot_write_with_it_later() {
    for mode in RecordMode::ALL {
        let (schema, pool) = stock_schema(2).await;
        let kept: Arc<std::sync::Mutex<Option<PgTransaction>>> = Arc::default();
        let keeper = kept.clone();
        let route = transactional(mode, &pool, &schema, move |envelope: Envelope| {
            let keeper = keeper.clone();
            async move {
                // E.g. a task it spawned, still running when the handler gave up.
                *keeper.lock().unwrap() = Some(the_transaction(&envelope));
                Err::<(), HandlerError>(HandlerError::transient("the warehouse did not answer"))
            }
        });
        handled_as_failed_with_nothing_committed(&route, &schema, "o-1", "failed").await;
        let late = kept.lock().unwrap().take().expect("the kept transaction");
        let written = late
            .client()
            .execute("INSERT INTO stock_moves (order_id) VALUES ('o-1')", &[])
            .await;
        assert!(
            written.is_err(),
            "{mode:?}: the kept handle wrote after the rollback"
        );
        drop(late);
        assert_eq!(moves_of(&schema, "o-1").await, 0, "{mode:?}");
    }
}
