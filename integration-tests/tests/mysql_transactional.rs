//! The transactional record on a real MariaDB (`MYSQL_URL`): the effect and the record
//! commit together, and no handler bug — a swallowed statement error, its own `COMMIT`,
//! `ROLLBACK` or DDL, a panic, a timeout, a kept transaction, a killed connection — and no
//! lost commit answer commits one without the other or applies an effect twice. Each test
//! asserts the business rows, the record rows and the outcome the adapter acts on, in a
//! database of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use integration_tests::commit_thief::CommitAnswerThief;
use integration_tests::mysql::StockDatabase;
use integration_tests::postgres::{BoxedStack, boxed};
use oncely::mysql::sqlx::{self, Executor, MySqlPool};
use oncely::record::{BatchAnswer, MysqlTransaction, MysqlTransactionalLayer};
use oncely::{
    DeadLetterReason, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, Source,
    Tier, handler_fn,
};
use tower::ServiceBuilder;
use tower::timeout::TimeoutLayer;

fn order(id: &str) -> Delivery {
    Delivery::new(
        Source::new("orders"),
        format!(r#"{{"orderId":"{id}","sku":"sku-1"}}"#),
    )
}

fn the_transaction(envelope: &Envelope) -> MysqlTransaction {
    envelope
        .extensions()
        .get::<MysqlTransaction>()
        .expect("the transactional record in front")
        .clone()
}

/// The effect: one stock move for the envelope's order, in the record's transaction.
async fn insert_stock_move(envelope: &Envelope) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO stock_moves (order_id) VALUES (?)")
        .bind(envelope.key().as_str())
        .execute(&the_transaction(envelope))
        .await?;
    Ok(())
}

type BoxedRoute = Route<BoxedStack>;

/// The transactional record's two modes: a transaction per delivery, or shared by the
/// deliveries in flight.
#[derive(Clone, Copy, Debug)]
enum Mode {
    PerDelivery,
    Batched,
}

impl Mode {
    const ALL: [Mode; 2] = [Mode::PerDelivery, Mode::Batched];
}

/// The transactional record on `pool` in front of `handler`, keyed by the body's `/orderId`,
/// with a `tower` timeout of `timeout` in front of the whole stack.
fn route_with_timeout<F, Fut>(mode: Mode, pool: &MySqlPool, timeout: Duration, handler: F) -> BoxedRoute
where
    F: FnMut(Envelope) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    let records = MysqlTransactionalLayer::new(pool.clone(), StockDatabase::records());
    let in_front = ServiceBuilder::new().layer(TimeoutLayer::new(timeout));
    let stack = match mode {
        Mode::PerDelivery => boxed(in_front.layer(records).service(handler_fn(handler))),
        Mode::Batched => boxed(in_front.layer(records.batched()).service(handler_fn(handler))),
    };
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

fn route<F, Fut>(mode: Mode, pool: &MySqlPool, handler: F) -> BoxedRoute
where
    F: FnMut(Envelope) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    route_with_timeout(mode, pool, Duration::from_secs(30), handler)
}

/// The handler a fixed release runs: the stock move, and nothing else.
fn fixed(mode: Mode, pool: &MySqlPool) -> BoxedRoute {
    route(mode, pool, |envelope: Envelope| async move {
        insert_stock_move(&envelope).await
    })
}

/// Handles `order_id` through `route` and checks it was answered a retry for a handler
/// failure with no stock move committed and the attempt noted as `FAILURE`; then a fixed
/// handler applies it once. `case` names the case in failure messages.
async fn retried_with_nothing_committed(
    mode: Mode,
    route: &BoxedRoute,
    database: &StockDatabase,
    order_id: &str,
    case: &str,
) {
    let outcome = route.handle(order(order_id)).await;
    assert_eq!(
        outcome.retry_reason(),
        Some(RetryReason::HandlerFailed),
        "{mode:?} {case}: {outcome}"
    );
    assert_eq!(
        database.moves_of(order_id).await,
        0,
        "{mode:?} {case}: nothing committed"
    );
    assert_eq!(
        database.status_of(order_id).await.as_deref(),
        Some("FAILURE"),
        "{mode:?} {case}: the attempt is noted, not recorded as done"
    );
    let fixed = fixed(mode, &database.pool(2).await);
    assert_eq!(fixed.handle(order(order_id)).await, Outcome::Processed, "{case}");
    assert_eq!(
        database.moves_of(order_id).await,
        1,
        "{mode:?} {case}: applied once"
    );
    assert_eq!(
        database.status_of(order_id).await.as_deref(),
        Some("SUCCESS"),
        "{case}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_an_order_apply_its_effect_once_with_its_record() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let route = fixed(mode, &database.pool(16).await);
        // 32 copies at once: the first claims the key; the others wait on its index record and
        // then find SUCCESS.
        let copies: Vec<_> = (0..32)
            .map(|_| {
                let route = route.clone();
                tokio::spawn(async move { route.handle(order("o-1")).await })
            })
            .collect();
        let mut processed = 0;
        for copy in copies {
            match copy.await.unwrap() {
                Outcome::Processed => processed += 1,
                Outcome::Duplicate { tier: Tier::Record } => {}
                other => panic!("a copy answered {other}"),
            }
        }
        assert_eq!(processed, 1);
        assert_eq!(database.moves_of("o-1").await, 1);
        assert_eq!(database.status_of("o-1").await.as_deref(), Some("SUCCESS"));

        // A later copy is a duplicate; the same key with another payload is dead-lettered.
        assert_eq!(
            route.handle(order("o-1")).await,
            Outcome::Duplicate { tier: Tier::Record }
        );
        let other_payload = Delivery::new(Source::new("orders"), r#"{"orderId":"o-1","sku":"sku-2"}"#);
        assert_eq!(
            route.handle(other_payload).await.dead_letter_reason(),
            Some(DeadLetterReason::PayloadMismatch)
        );
        assert_eq!(database.all_moves().await, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_statement_error_is_retried_never_acked_as_processed() {
    for mode in Mode::ALL {
        for bug in [
            // The same order again: a unique violation the handler takes for "already applied".
            "INSERT INTO stock_moves (order_id) SELECT order_id FROM stock_moves",
            "INSERT INTO stock_moves (order_id) VALUES (NULL)",
            "UPDATE no_such_table SET quantity = 0",
        ] {
            let database = StockDatabase::new().await;
            let route = route(
                mode,
                &database.pool(2).await,
                move |envelope: Envelope| async move {
                    insert_stock_move(&envelope).await?;
                    // MySQL undoes only the failed statement and would commit the rest.
                    let _ignored = the_transaction(&envelope).execute(bug).await;
                    Ok(())
                },
            );
            retried_with_nothing_committed(mode, &route, &database, "o-1", bug).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_ends_the_transaction_itself_is_retried() {
    for mode in Mode::ALL {
        // Each would end a plain transaction, most with an implicit COMMIT of the record and
        // the write before it; a write after it would then commit on its own. The handler
        // ignores the error each gets inside the tier's XA transaction.
        for ending in [
            "COMMIT",
            "ROLLBACK",
            "START TRANSACTION",
            "BEGIN",
            "CREATE TABLE implicit_commit (id INT)",
            "TRUNCATE stock_moves",
            "LOCK TABLES stock_moves WRITE",
        ] {
            for write_first in [true, false] {
                let database = StockDatabase::new().await;
                let route = route(
                    mode,
                    &database.pool(2).await,
                    move |envelope: Envelope| async move {
                        if write_first {
                            insert_stock_move(&envelope).await?;
                        }
                        let _ignored = the_transaction(&envelope).execute(ending).await;
                        if !write_first {
                            insert_stock_move(&envelope).await?;
                        }
                        Ok(())
                    },
                );
                let case = format!("{ending} (write first: {write_first})");
                retried_with_nothing_committed(mode, &route, &database, "o-1", &case).await;
            }
        }
    }
}

/// What a faulty first call does after writing the stock move.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Panic,
    Hang,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_or_a_timeout_mid_transaction_commits_nothing_and_poisons_no_connection() {
    for mode in Mode::ALL {
        for (fault, reason) in [
            (Fault::Panic, RetryReason::HandlerPanicked),
            (Fault::Hang, RetryReason::HandlerFailed),
        ] {
            let database = StockDatabase::new().await;
            // ONE connection: the next delivery gets the very connection the faulty one used,
            // unless it was closed.
            let pool = database.pool(1).await;
            let calls = Arc::new(AtomicUsize::new(0));
            let route = route_with_timeout(
                mode,
                &pool,
                Duration::from_millis(300),
                move |envelope: Envelope| {
                    let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                    async move {
                        insert_stock_move(&envelope).await?;
                        match fault {
                            Fault::Panic if first => panic!("bug in the handler"),
                            Fault::Hang if first => tokio::time::sleep(Duration::from_secs(30)).await,
                            Fault::Panic | Fault::Hang => {}
                        }
                        Ok(())
                    }
                },
            );
            let outcome = route.handle(order("o-cut")).await;
            assert_eq!(outcome.retry_reason(), Some(reason), "{fault:?}: {outcome}");
            // The next delivery must not commit the abandoned one.
            assert_eq!(
                route.handle(order("o-next")).await,
                Outcome::Processed,
                "{fault:?}"
            );
            assert_eq!(
                database.moves_of("o-cut").await,
                0,
                "{fault:?}: half an effect committed"
            );
            let status = database.status_of("o-cut").await;
            assert!(
                matches!(status.as_deref(), None | Some("FAILURE")),
                "{fault:?}: {status:?}"
            );
            // The abandoned delivery's retry is new work, not a duplicate, and is not blocked by
            // locks the abandoned transaction held.
            assert_eq!(
                route.handle(order("o-cut")).await,
                Outcome::Processed,
                "{fault:?}"
            );
            assert_eq!(database.moves_of("o-cut").await, 1, "{fault:?}");
            assert_eq!(database.moves_of("o-next").await, 1, "{fault:?}");
        }
    }
}

/// Creates `stock` with one row, `sku-1` (quantity 10), and locks that row in a transaction
/// of its own, held until the answer is rolled back or dropped.
async fn stock_row_held_elsewhere(database: &StockDatabase) -> sqlx::Transaction<'static, sqlx::MySql> {
    sqlx::raw_sql("CREATE TABLE stock (sku VARCHAR(16) PRIMARY KEY, quantity INT); INSERT INTO stock VALUES ('sku-1', 10)")
        .execute(&database.pool)
        .await
        .unwrap();
    let mut holder = database.pool.begin().await.unwrap();
    sqlx::query("SELECT quantity FROM stock WHERE sku = 'sku-1' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    holder
}

/// A handler cut off by a timeout while its statement waits for a row lock: closing the
/// connection alone would leave that statement waiting on the server — holding the key's
/// claim — until the lock wait timeout (50 s by default). The tier kills it, so the
/// redelivery claims the key at once; without the kill the redelivery would wait for the
/// claim and be cut off by the same timeout, answering a retry instead of processing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_cut_off_while_waiting_for_a_lock_releases_the_key_at_once() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let holder = stock_row_held_elsewhere(&database).await;
        let pool = database.pool(4).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let route = route_with_timeout(
            mode,
            &pool,
            Duration::from_millis(300),
            move |envelope: Envelope| {
                let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                async move {
                    insert_stock_move(&envelope).await?;
                    if first {
                        sqlx::query("UPDATE stock SET quantity = quantity - 1 WHERE sku = 'sku-1'")
                            .execute(&the_transaction(&envelope))
                            .await?;
                    }
                    Ok(())
                }
            },
        );
        let outcome = route.handle(order("o-1")).await;
        assert_eq!(
            outcome.retry_reason(),
            Some(RetryReason::HandlerFailed),
            "{outcome}"
        );
        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        assert_eq!(database.moves_of("o-1").await, 1);
        holder.rollback().await.unwrap();
    }
}

/// A handler that bounds a statement with a timeout of its own and swallows the timeout:
/// the statement, still waiting for a lock on the server, could apply after the handler
/// answered. Nothing commits, and the tier kills the session rather than waiting for the
/// statement, so the key is free for the redelivery at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_the_handler_cut_off_itself_fails_the_delivery() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let holder = stock_row_held_elsewhere(&database).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let route = route(mode, &database.pool(4).await, move |envelope: Envelope| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                insert_stock_move(&envelope).await?;
                if first {
                    let tx = the_transaction(&envelope);
                    // Bounds the test if the tier waited for the statement after all.
                    tx.execute("SET SESSION innodb_lock_wait_timeout = 5").await?;
                    let update = sqlx::query("UPDATE stock SET quantity = quantity - 1 WHERE sku = 'sku-1'")
                        .execute(&tx);
                    let _swallowed = tokio::time::timeout(Duration::from_millis(200), update).await;
                }
                Ok(())
            }
        });
        let outcome = route.handle(order("o-1")).await;
        assert_eq!(
            outcome.retry_reason(),
            Some(RetryReason::HandlerFailed),
            "{outcome}"
        );
        assert!(outcome.to_string().contains("cut off"), "{outcome}");
        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        assert_eq!(database.moves_of("o-1").await, 1);
        holder.rollback().await.unwrap();
        let quantity: i32 = sqlx::query_scalar("SELECT quantity FROM stock")
            .fetch_one(&database.pool)
            .await
            .unwrap();
        assert_eq!(quantity, 10, "the cut-off update did not apply");
    }
}

/// `SET autocommit = 0` is allowed inside XA; a connection pooled with it would leave every
/// later statement on it in a transaction nobody commits. The tier gives it back with
/// autocommit on: a plain write on the pool's one connection afterwards is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_turns_autocommit_off_leaves_no_open_transaction_on_the_pool() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let pool = database.pool(1).await;
        let route = route(mode, &pool, |envelope: Envelope| async move {
            the_transaction(&envelope).execute("SET autocommit = 0").await?;
            insert_stock_move(&envelope).await
        });
        assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
        sqlx::query("INSERT INTO stock_moves (order_id) VALUES ('plain')")
            .execute(&pool)
            .await
            .unwrap();
        // Read on another connection: only what was committed.
        assert_eq!(database.moves_of("plain").await, 1);
        assert_eq!(database.moves_of("o-1").await, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_keeps_its_transaction_past_its_answer_commits_nothing() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let kept: Arc<std::sync::Mutex<Option<MysqlTransaction>>> = Arc::default();
        let keeper = kept.clone();
        let route = route(mode, &database.pool(2).await, move |envelope: Envelope| {
            let keeper = keeper.clone();
            async move {
                insert_stock_move(&envelope).await?;
                // E.g. handed to a task that writes later, outside the record.
                *keeper.lock().unwrap() = Some(the_transaction(&envelope));
                Ok(())
            }
        });
        retried_with_nothing_committed(mode, &route, &database, "o-1", "kept").await;
        let late = kept.lock().unwrap().take().expect("the kept handle");
        let written = sqlx::query("INSERT INTO stock_moves (order_id) VALUES ('late')")
            .execute(&late)
            .await;
        assert!(written.is_err(), "a kept handle wrote after the answer");
        assert_eq!(database.moves_of("late").await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_mid_handler_commits_nothing_and_the_retry_applies_once() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let pool = database.pool(4).await;
        let killer = pool.clone();
        let route = route(mode, &pool, move |envelope: Envelope| {
            let killer = killer.clone();
            async move {
                insert_stock_move(&envelope).await?;
                if envelope.delivery().attempt() == 1 {
                    let tx = the_transaction(&envelope);
                    let id: u64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS UNSIGNED)")
                        .fetch_one(&tx)
                        .await?;
                    killer.execute(format!("KILL {id}").as_str()).await?;
                    // Swallowed: the commit must still see the connection is gone.
                    let _ignored = tx.execute("SELECT 1").await;
                }
                Ok(())
            }
        });
        let outcome = route.handle(order("o-1")).await;
        // The swallowed failure is the handler's: seen through the handle, not only at commit.
        assert_eq!(
            outcome.retry_reason(),
            Some(RetryReason::HandlerFailed),
            "{outcome}"
        );
        assert_eq!(database.moves_of("o-1").await, 0, "nothing committed");
        assert_eq!(
            route.handle(order("o-1").with_attempt(2)).await,
            Outcome::Processed
        );
        assert_eq!(database.moves_of("o-1").await, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_never_applied_twice() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let thief = CommitAnswerThief::start_mysql().await;
        let route = fixed(mode, &database.pool_through(&thief, 8).await);
        thief.arm();
        let orders: Vec<_> = (0..16)
            .map(|i| {
                let route = route.clone();
                tokio::spawn(async move { route.handle(order(&format!("o-{i}"))).await })
            })
            .collect();
        let mut outcomes = Vec::new();
        for order in orders {
            outcomes.push(order.await.unwrap());
        }
        assert_eq!(thief.stolen(), 1, "{mode:?}");
        // Per delivery, the one whose commit answer was lost is retried; batched, its
        // batch's deliveries run again alone and find their keys done.
        let told_apart = outcomes
            .iter()
            .filter(|outcome| !outcome.is_settled() || **outcome == Outcome::Duplicate { tier: Tier::Record })
            .count();
        assert!(
            told_apart >= 1,
            "{mode:?}: the lost commit answer was not seen: {outcomes:?}"
        );
        // The broker redelivers what was not acked: the record says it was committed.
        for (i, outcome) in outcomes.iter().enumerate() {
            if !outcome.is_settled() {
                let again = route.handle(order(&format!("o-{i}")).with_attempt(2)).await;
                assert_eq!(again, Outcome::Duplicate { tier: Tier::Record }, "{mode:?} o-{i}");
            }
        }
        for i in 0..16 {
            assert_eq!(database.moves_of(&format!("o-{i}")).await, 1, "o-{i}");
        }
    }
}

/// Copies of one order wait on the first's claim; when the first fails and rolls back,
/// they race for the key, and InnoDB may pick one of them as a deadlock victim (each holds
/// the shared lock of its duplicate-key check and wants the exclusive one). Whatever it
/// picks, retried as the broker would, the effect is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_racing_a_failed_first_attempt_apply_the_effect_once() {
    for mode in Mode::ALL {
        let database = StockDatabase::new().await;
        let calls = Arc::new(AtomicUsize::new(0));
        let route = route(mode, &database.pool(16).await, move |envelope: Envelope| {
            let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                insert_stock_move(&envelope).await?;
                if first {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return Err(HandlerError::transient("downstream timed out"));
                }
                Ok(())
            }
        });
        let first = {
            let route = route.clone();
            tokio::spawn(async move { route.handle(order("o-1")).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let copies: Vec<_> = (0..8)
            .map(|_| {
                let route = route.clone();
                tokio::spawn(async move { route.handle(order("o-1")).await })
            })
            .collect();
        assert!(first.await.unwrap().retry_reason().is_some());
        let mut outcomes = Vec::new();
        for copy in copies {
            outcomes.push(copy.await.unwrap());
        }
        let mut processed = outcomes.iter().filter(|o| **o == Outcome::Processed).count();
        for outcome in outcomes.iter().filter(|outcome| !outcome.is_settled()) {
            assert!(
                matches!(
                    outcome.retry_reason(),
                    Some(
                        RetryReason::Conflict(_)
                            | RetryReason::StoreUnavailable(_)
                            | RetryReason::InFlight(_)
                    )
                ),
                "{outcome}"
            );
            // Redelivered.
            if route.handle(order("o-1").with_attempt(2)).await == Outcome::Processed {
                processed += 1;
            }
        }
        assert_eq!(processed, 1, "{outcomes:?}");
        assert_eq!(database.moves_of("o-1").await, 1);
    }
}

/// In a batch, one delivery's failure rolls back nothing of its neighbours for good: they
/// run again (in another batch, or alone) and are applied once; the failing one is retried
/// and applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_delivery_in_a_batch_costs_its_neighbours_nothing() {
    let database = StockDatabase::new().await;
    let route = route(
        Mode::Batched,
        &database.pool(8).await,
        |envelope: Envelope| async move {
            insert_stock_move(&envelope).await?;
            if envelope.key().as_str() == "o-7" && envelope.delivery().attempt() == 1 {
                return Err(HandlerError::transient("downstream timed out"));
            }
            Ok(())
        },
    );
    let orders: Vec<_> = (0..16)
        .map(|i| {
            let route = route.clone();
            tokio::spawn(async move { route.handle(order(&format!("o-{i}"))).await })
        })
        .collect();
    for (i, handled) in orders.into_iter().enumerate() {
        let outcome = handled.await.unwrap();
        match i {
            7 => assert_eq!(
                outcome.retry_reason(),
                Some(RetryReason::HandlerFailed),
                "{outcome}"
            ),
            _ => assert_eq!(outcome, Outcome::Processed, "o-{i}"),
        }
    }
    assert_eq!(database.moves_of("o-7").await, 0);
    assert_eq!(
        route.handle(order("o-7").with_attempt(2)).await,
        Outcome::Processed
    );
    for i in 0..16 {
        assert_eq!(database.moves_of(&format!("o-{i}")).await, 1, "o-{i}");
    }
}

/// A set handler writes a whole batch's effects in one multi-row `INSERT`; copies of
/// orders, in the same burst, are answered as duplicates and never written twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_writes_each_order_once() {
    let database = StockDatabase::new().await;
    let records = MysqlTransactionalLayer::new(database.pool(8).await, StockDatabase::records()).batched();
    let stock_moves = |tx: MysqlTransaction, batch: Vec<Envelope>| async move {
        let mut insert = sqlx::QueryBuilder::new("INSERT INTO stock_moves (order_id) ");
        insert.push_values(&batch, |mut row, envelope| {
            row.push_bind(envelope.key().as_str().to_owned());
        });
        insert.build().execute(&tx).await?;
        Ok(BatchAnswer::processed())
    };
    let stack = boxed(records.batch_handler(stock_moves));
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    let deliveries: Vec<_> = (0..80)
        .map(|i| {
            let route = route.clone();
            // The last 16 are copies of the first 16. A copy that found its original's claim
            // still open (a loaded machine outwaits the row lock) is retried, as the broker
            // would redeliver it; it must then find the original's commit.
            tokio::spawn(async move {
                let id = format!("o-{}", i % 64);
                for _ in 0..20 {
                    match route.handle(order(&id)).await {
                        outcome if outcome.retry_reason() == Some(RetryReason::InFlight(Tier::Record)) => {
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await
                        }
                        outcome => return outcome,
                    }
                }
                panic!("{id} stayed in flight for 2 s")
            })
        })
        .collect();
    let mut processed = 0;
    for delivery in deliveries {
        match delivery.await.unwrap() {
            Outcome::Processed => processed += 1,
            Outcome::Duplicate { tier: Tier::Record } => {}
            other => panic!("{other}"),
        }
    }
    assert_eq!(processed, 64);
    assert_eq!(database.all_moves().await, 64);
}

/// A set handler is never called with an empty batch: a lane whose claims all found their
/// keys done (copies) has nothing to write — a multi-row `INSERT` of no rows would fail, and
/// with it the joiners the lane takes in next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_is_never_called_with_no_envelopes() {
    let database = StockDatabase::new().await;
    let records = MysqlTransactionalLayer::new(database.pool(8).await, StockDatabase::records()).batched();
    let empty_calls = Arc::new(AtomicUsize::new(0));
    let counted = empty_calls.clone();
    let stock_moves = move |tx: MysqlTransaction, batch: Vec<Envelope>| {
        let counted = counted.clone();
        async move {
            if batch.is_empty() {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            for envelope in &batch {
                sqlx::query("INSERT INTO stock_moves (order_id) VALUES (?)")
                    .bind(envelope.key().as_str())
                    .execute(&tx)
                    .await?;
            }
            Ok(BatchAnswer::processed())
        }
    };
    let stack = boxed(records.batch_handler(stock_moves));
    let route = Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack);
    assert_eq!(route.handle(order("o-done")).await, Outcome::Processed);
    for round in 0..8 {
        let deliveries: Vec<_> = (0..16)
            .map(|i| {
                let route = route.clone();
                let id = match i % 2 {
                    0 => "o-done".to_owned(),
                    _ => format!("o-{round}-{i}"),
                };
                tokio::spawn(async move { (route.handle(order(&id)).await, id) })
            })
            .collect();
        for delivery in deliveries {
            let (outcome, id) = delivery.await.unwrap();
            let expected = match id.as_str() {
                "o-done" => Outcome::Duplicate { tier: Tier::Record },
                _ => Outcome::Processed,
            };
            assert_eq!(outcome, expected, "{id}");
        }
    }
    assert_eq!(empty_calls.load(Ordering::SeqCst), 0);
    assert_eq!(database.all_moves().await, 1 + 8 * 8);
}
