//! The batched transactional record against a real PostgreSQL: deliveries in flight together
//! share transactions, and one delivery's failure, conflict, copy or lost connection never
//! costs its neighbours their effect nor applies one twice. Each test asserts the business
//! rows, the record rows and the outcome the adapter would act on.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use integration_tests::postgres::{
    BoxedStack, CommitAnswerThief, RecordMode, ScratchSchema, insert_stock_move, schema_pool, stock_schema,
};
use oncely::postgres::deadpool_postgres::tokio_postgres::Error as PgError;
use oncely::postgres::deadpool_postgres::tokio_postgres::error::SqlState;
use oncely::record::{BatchAnswer, CommitRows, PgTransaction, PgTransactionalLayer};
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

fn orders(count: usize) -> Vec<Delivery> {
    (0..count).map(|i| order(&format!("o-{i}"))).collect()
}

fn route(stack: BoxedStack) -> Route<BoxedStack> {
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// Handles every delivery at once, each on its own task; the outcomes in the same order.
async fn handle_all<S, E>(route: &Route<S>, deliveries: Vec<Delivery>) -> Vec<Outcome>
where
    S: integration_tests::RouteStack<E> + 'static,
    E: Into<oncely::BoxError> + 'static,
{
    let tasks: Vec<_> = deliveries
        .into_iter()
        .map(|delivery| {
            let route = route.clone();
            tokio::spawn(async move { route.handle(delivery).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("a delivery's task"));
    }
    outcomes
}

/// Asserts that every delivery but the one at `failed` came back processed.
fn assert_processed_but(outcomes: &[Outcome], failed: usize, flight: &str) {
    for (i, outcome) in outcomes.iter().enumerate().filter(|(i, _)| *i != failed) {
        assert_eq!(*outcome, Outcome::Processed, "{flight}: delivery {i}");
    }
}

/// Stock moves per order.
async fn moves(schema: &ScratchSchema) -> HashMap<String, i64> {
    let client = schema_pool(schema.name(), 1).get().await.expect("PostgreSQL");
    client
        .query(
            "SELECT order_id, count(*) FROM stock_moves GROUP BY order_id",
            &[],
        )
        .await
        .expect("read the moves")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// How many transactions committed the `SUCCESS` records.
async fn committing_transactions(schema: &ScratchSchema) -> i64 {
    schema
        .count("SELECT count(DISTINCT xmin::text) FROM consumption_record WHERE status = 'SUCCESS'")
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_in_flight_together_share_commits_and_each_applies_once() {
    let (schema, pool) = stock_schema(8).await;
    let batched = route(RecordMode::Batched.stack(
        &pool,
        schema.records(),
        handler_fn(|envelope: Envelope| async move { insert_stock_move(&envelope).await }),
    ));
    let outcomes = handle_all(&batched, orders(64)).await;
    assert!(outcomes.iter().all(|o| *o == Outcome::Processed), "{outcomes:?}");
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 64);
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
    let transactions = committing_transactions(&schema).await;
    assert!(
        transactions <= 16,
        "64 deliveries in flight together took {transactions} commits"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_mid_batch_costs_its_neighbours_nothing() {
    let (schema, pool) = stock_schema(8).await;
    // Each fault on its own order; every other order is written and committed once.
    let handler = handler_fn(|envelope: Envelope| async move {
        insert_stock_move(&envelope).await?;
        match envelope.key().as_str() {
            "o-5" => panic!("bug in the handler"),
            "o-10" => Err(HandlerError::transient("payment service timed out")),
            "o-20" => Err(HandlerError::permanent("no such wallet")),
            "o-25" => {
                // A failed statement the handler ignores: the transaction is aborted.
                let tx = envelope.extensions().get::<PgTransaction>().unwrap().clone();
                let _ignored = tx.batch_execute("SELECT 1/0").await;
                Ok(())
            }
            // Hangs until the timeout in front cuts it off.
            "o-30" => std::future::pending().await,
            "o-35" => {
                // Its own COMMIT, whose failure it ignores: it would commit the claims of
                // the orders after it without their effects.
                let tx = envelope.extensions().get::<PgTransaction>().unwrap().clone();
                let _ignored = tx.batch_execute("COMMIT").await;
                Ok(())
            }
            _ => Ok(()),
        }
    });
    // Generous: every handler runs under it, and a healthy neighbour must not be cut off
    // while o-5's panic report is written (a backtrace, when RUST_BACKTRACE asks for one,
    // blocks its worker thread for a second or more on a loaded machine).
    let stack = ServiceBuilder::new()
        .layer(TimeoutLayer::new(Duration::from_secs(3)))
        .service(handler);
    let batched = route(RecordMode::Batched.stack(&pool, schema.records(), stack));
    let outcomes = handle_all(&batched, orders(40)).await;

    let reasons: HashMap<usize, Outcome> = outcomes
        .into_iter()
        .enumerate()
        .filter(|(_, outcome)| *outcome != Outcome::Processed)
        .collect();
    let reason = |i: usize| reasons.get(&i).and_then(Outcome::retry_reason);
    assert_eq!(reason(5), Some(RetryReason::HandlerPanicked), "{reasons:?}");
    assert_eq!(reason(10), Some(RetryReason::HandlerFailed), "{reasons:?}");
    assert_eq!(reason(25), Some(RetryReason::HandlerFailed), "{reasons:?}");
    assert_eq!(reason(30), Some(RetryReason::HandlerFailed), "{reasons:?}");
    assert_eq!(reason(35), Some(RetryReason::HandlerFailed), "{reasons:?}");
    assert_eq!(
        reasons.get(&20).and_then(Outcome::dead_letter_reason),
        Some(DeadLetterReason::Rejected),
        "{reasons:?}"
    );
    assert_eq!(reasons.len(), 6, "only the faulty orders fail: {reasons:?}");
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 34, "{moves:?}");
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
    for faulty in [5, 10, 20, 25, 30, 35] {
        assert!(
            !moves.contains_key(&format!("o-{faulty}")),
            "o-{faulty} committed"
        );
    }
    assert_eq!(
        schema
            .count("SELECT count(*) FROM consumption_record WHERE status = 'SUCCESS'")
            .await,
        34
    );
}

/// One lane, held by a slow first delivery while 64 orders queue: they open the next batch
/// together, and o-50 fails in it. Answers the outcomes of the 64 and how many transactions
/// committed their records (the slow one's included).
async fn one_failure_in_a_full_batch(stack: BoxedStack, schema: &ScratchSchema) -> (Vec<Outcome>, i64) {
    let route = route(stack);
    let slow = {
        let route = route.clone();
        tokio::spawn(async move { route.handle(order("slow")).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let outcomes = handle_all(&route, orders(64)).await;
    assert_eq!(slow.await.unwrap(), Outcome::Processed);
    (outcomes, committing_transactions(schema).await)
}

/// Whose handler it is in [`one_failure_in_a_full_batch`]: the slow one holds the lane,
/// o-50 fails.
fn part(envelope: &Envelope) -> Option<Result<(), HandlerError>> {
    match envelope.key().as_str() {
        "o-50" => Some(Err(HandlerError::transient("payment service timed out"))),
        "slow" => Some(Ok(())),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_neighbours_of_a_failed_delivery_commit_in_another_batch_not_one_by_one() {
    for set_handler in [false, true] {
        let (schema, pool) = stock_schema(8).await;
        let layer = PgTransactionalLayer::new(pool.clone(), schema.records())
            .batched()
            .with_lanes(1)
            .with_max_batch(64);
        let stack = match set_handler {
            false => integration_tests::postgres::boxed(tower::Layer::layer(
                &layer,
                handler_fn(|envelope: Envelope| async move {
                    if envelope.key().as_str() == "slow" {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    insert_stock_move(&envelope).await?;
                    part(&envelope).unwrap_or(Ok(()))
                }),
            )),
            true => integration_tests::postgres::boxed(layer.batch_handler(
                |tx: PgTransaction, batch: Vec<Envelope>| async move {
                    let mut answer = BatchAnswer::processed();
                    for (index, envelope) in batch.iter().enumerate() {
                        if envelope.key().as_str() == "slow" {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                        }
                        if let Some(Err(error)) = part(envelope) {
                            answer.fail(index, error);
                        }
                    }
                    insert_stock_moves(tx, batch).await?;
                    Ok(answer)
                },
            )),
        };
        let (outcomes, transactions) = one_failure_in_a_full_batch(stack, &schema).await;
        assert_eq!(
            outcomes[50].retry_reason(),
            Some(RetryReason::HandlerFailed),
            "set handler {set_handler}: {:?}",
            outcomes[50]
        );
        assert_processed_but(&outcomes, 50, &format!("set handler {set_handler}"));
        let moves = moves(&schema).await;
        assert_eq!(moves.len(), 64, "set handler {set_handler}: {moves:?}");
        assert!(moves.values().all(|count| *count == 1), "{moves:?}");
        assert!(
            !moves.contains_key("o-50"),
            "set handler {set_handler}: o-50 committed"
        );
        // The slow one's, then the 63 others in a few batches: one by one they would take 63.
        assert!(
            transactions <= 8,
            "set handler {set_handler}: 64 records took {transactions} commits"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_one_key_in_one_batch_and_across_batches_apply_once() {
    let (schema, pool) = stock_schema(8).await;
    let batched = route(RecordMode::Batched.stack(
        &pool,
        schema.records(),
        handler_fn(|envelope: Envelope| async move { insert_stock_move(&envelope).await }),
    ));
    // Eight copies of each of eight orders, interleaved, all in flight at once.
    let deliveries = (0..64).map(|i| order(&format!("o-{}", i % 8))).collect();
    let outcomes = handle_all(&batched, deliveries).await;
    for key in 0..8 {
        let of_key: Vec<&Outcome> = outcomes.iter().skip(key).step_by(8).collect();
        assert_eq!(
            of_key.iter().filter(|o| ***o == Outcome::Processed).count(),
            1,
            "o-{key}: {of_key:?}"
        );
        assert!(
            of_key
                .iter()
                .all(|o| **o == Outcome::Processed || **o == Outcome::Duplicate { tier: Tier::Record }),
            "o-{key}: {of_key:?}"
        );
    }
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 8);
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_payload_for_a_key_in_the_same_batch_is_dead_lettered() {
    let (schema, pool) = stock_schema(8).await;
    let batched = route(RecordMode::Batched.stack(
        &pool,
        schema.records(),
        handler_fn(|envelope: Envelope| async move { insert_stock_move(&envelope).await }),
    ));
    let mut deliveries = orders(16);
    deliveries.push(Delivery::new(
        Source::new("orders"),
        r#"{"orderId":"o-3","sku":"sku-2"}"#,
    ));
    let outcomes = handle_all(&batched, deliveries).await;
    let of_key = [&outcomes[3], &outcomes[16]];
    assert_eq!(
        of_key.iter().filter(|o| ***o == Outcome::Processed).count(),
        1,
        "{of_key:?}"
    );
    assert_eq!(
        of_key
            .iter()
            .filter_map(|o| o.dead_letter_reason())
            .collect::<Vec<_>>(),
        [DeadLetterReason::PayloadMismatch],
        "{of_key:?}"
    );
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 16);
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_mid_batch_applies_nothing_twice_and_loses_no_neighbour() {
    let (schema, pool) = stock_schema(8).await;
    let killer = pool.clone();
    let handler = handler_fn(move |envelope: Envelope| {
        let killer = killer.clone();
        async move {
            insert_stock_move(&envelope).await?;
            if envelope.key().as_str() == "o-8" && envelope.delivery().attempt() == 1 {
                let tx = envelope.extensions().get::<PgTransaction>().unwrap().clone();
                let pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
                let other = killer.get().await.map_err(HandlerError::transient)?;
                other.execute("SELECT pg_terminate_backend($1)", &[&pid]).await?;
                tx.execute("SELECT 1", &[]).await?;
            }
            Ok::<(), HandlerError>(())
        }
    });
    let batched = route(RecordMode::Batched.stack(&pool, schema.records(), handler));
    let outcomes = handle_all(&batched, orders(16)).await;
    assert!(matches!(outcomes[8], Outcome::RetryLater(_)), "{:?}", outcomes[8]);
    for (i, outcome) in outcomes.iter().enumerate().filter(|(i, _)| *i != 8) {
        assert_eq!(*outcome, Outcome::Processed, "o-{i}");
    }
    assert!(!moves(&schema).await.contains_key("o-8"));
    assert_eq!(
        batched.handle(order("o-8").with_attempt(2)).await,
        Outcome::Processed
    );
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 16);
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_never_applied_twice() {
    for mode in RecordMode::ALL {
        let (schema, _) = stock_schema(1).await;
        let thief = CommitAnswerThief::start().await;
        let pool = thief.schema_pool(schema.name(), 8);
        let route = route(mode.stack(
            &pool,
            schema.records(),
            handler_fn(|envelope: Envelope| async move { insert_stock_move(&envelope).await }),
        ));
        thief.arm();
        let outcomes = handle_all(&route, orders(16)).await;
        assert_eq!(thief.stolen(), 1, "{mode:?}");
        // The broker redelivers what was not acked.
        for (i, outcome) in outcomes.iter().enumerate() {
            let outcome = if outcome.is_settled() {
                outcome.clone()
            } else {
                route.handle(order(&format!("o-{i}")).with_attempt(2)).await
            };
            assert!(outcome.is_settled(), "{mode:?} o-{i}: {outcome}");
        }
        assert!(
            outcomes
                .iter()
                .any(|o| *o == Outcome::Duplicate { tier: Tier::Record } || !o.is_settled()),
            "{mode:?}: the delivery whose commit answer was lost was not told apart: {outcomes:?}"
        );
        let moves = moves(&schema).await;
        assert_eq!(moves.len(), 16, "{mode:?}");
        assert!(moves.values().all(|count| *count == 1), "{mode:?}: {moves:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_loses_a_deadlock_runs_its_deliveries_alone() {
    // PostgreSQL looks for a deadlock once, when a waiter's deadlock_timeout runs out: the
    // batch is its victim only if the cycle closes within the batch's first second of
    // waiting. On a loaded machine it may close later, and the test's own transaction is
    // then the victim: that run shows nothing, and the case runs again.
    for run in 1..=3 {
        if deadlock_with_a_claiming_batch().await {
            return;
        }
        println!("run {run}: the cycle closed after the batch had looked; running again");
    }
    panic!("the batch was never the deadlock's victim in three runs");
}

/// A batch claims o-1 and waits for o-2, which another transaction holds, then that one
/// asks for o-1: checks that the batch, failed by the deadlock, runs its deliveries alone.
/// False if PostgreSQL failed the other transaction instead.
async fn deadlock_with_a_claiming_batch() -> bool {
    let (schema, pool) = stock_schema(8).await;
    // One lane, kept busy by o-0 while o-1 and o-2 queue: they open the next batch together.
    let handler = handler_fn(|envelope: Envelope| async move {
        if envelope.key().as_str() == "o-0" {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        insert_stock_move(&envelope).await
    });
    let layer = PgTransactionalLayer::new(pool.clone(), schema.records())
        .batched()
        .with_lanes(1);
    let batched = route(integration_tests::postgres::boxed(tower::Layer::layer(
        &layer, handler,
    )));
    // Another transaction (another lane's, in production) holds o-2's record row, and waits
    // longer than the batch before it looks for deadlocks, so that the batch is the one
    // PostgreSQL fails.
    let other = schema_pool(schema.name(), 1).get().await.unwrap();
    let hold = "INSERT INTO consumption_record (message_key, status, payload_fingerprint) VALUES ($1, 'PROCESSING', 'x')";
    other
        .batch_execute("SET deadlock_timeout = '10s'; BEGIN")
        .await
        .unwrap();
    other.execute(hold, &[&"o-2"]).await.unwrap();
    let busy = {
        let batched = batched.clone();
        tokio::spawn(async move { batched.handle(order("o-0")).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The batch claims o-1, then waits for o-2.
    let handling = {
        let batched = batched.clone();
        tokio::spawn(async move { handle_all(&batched, vec![order("o-1"), order("o-2")]).await })
    };
    assert_eq!(busy.await.unwrap(), Outcome::Processed);
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1";
    let claim_here = format!("INSERT INTO %{}%", schema.name());
    for _ in 0..100 {
        if other
            .query_one(waiting, &[&claim_here])
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Taking o-1 closes the cycle: the batch's claim fails after its deadlock_timeout (1 s),
    // this insert then goes through, and its rollback lets the deliveries in.
    let closed = other.execute(hold, &[&"o-1"]).await;
    other.batch_execute("ROLLBACK").await.unwrap();
    match closed {
        Err(error) if error.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED) => {
            handling.abort();
            return false;
        }
        closed => closed.map(drop).unwrap(),
    }
    let outcomes = handling.await.unwrap();
    assert_eq!(
        outcomes,
        [Outcome::Processed, Outcome::Processed],
        "no attempt spent on a deadlock"
    );
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 3);
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
    true
}

/// The set handler of the tests: one `INSERT … SELECT FROM unnest` for the whole batch; a
/// body without a `sku` fails the batch (as a `?` on a parse error would).
async fn insert_stock_moves(tx: PgTransaction, batch: Vec<Envelope>) -> Result<BatchAnswer, HandlerError> {
    let mut orders = Vec::with_capacity(batch.len());
    for envelope in &batch {
        if envelope.delivery().json()?.pointer("/sku").is_none() {
            return Err(HandlerError::permanent("an order without a sku"));
        }
        orders.push(envelope.key().as_str().to_owned());
    }
    tx.execute(
        "INSERT INTO stock_moves (order_id) SELECT unnest($1::text[])",
        &[&orders],
    )
    .await?;
    Ok(BatchAnswer::processed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_writes_a_batch_at_once_and_a_bad_envelope_fails_alone() {
    let (schema, pool) = stock_schema(8).await;
    let records = PgTransactionalLayer::new(pool.clone(), schema.records()).batched();
    let route = Route::new(
        "deduct_stock",
        KeyExtractor::json_pointer("/orderId"),
        records.batch_handler(insert_stock_moves),
    );
    // A flight of good orders, with a copy of one of them: one statement per batch.
    let mut deliveries = orders(48);
    deliveries.push(order("o-3"));
    let outcomes = handle_all(&route, deliveries).await;
    assert!(outcomes.iter().all(Outcome::is_settled), "{outcomes:?}");
    assert_eq!(moves(&schema).await.len(), 48);
    let transactions = committing_transactions(&schema).await;
    assert!(transactions <= 16, "48 orders took {transactions} commits");

    // A flight with one bad order: it alone fails; the others are written once.
    let mut deliveries: Vec<Delivery> = (100..116).map(|i| order(&format!("o-{i}"))).collect();
    deliveries[7] = Delivery::new(Source::new("orders"), r#"{"orderId":"o-107"}"#);
    let outcomes = handle_all(&route, deliveries).await;
    assert_eq!(
        outcomes[7].dead_letter_reason(),
        Some(DeadLetterReason::Rejected),
        "{:?}",
        outcomes[7]
    );
    assert_processed_but(&outcomes, 7, "orders from o-100");
    let moves = moves(&schema).await;
    assert_eq!(moves.len(), 48 + 15, "{moves:?}");
    assert!(moves.values().all(|count| *count == 1), "{moves:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_dropped_while_waiting_for_its_turn_leaves_no_record_without_its_effect() {
    let (schema, pool) = stock_schema(8).await;
    // One lane: both orders share its transaction; o-0 holds it for 300 ms.
    let records = PgTransactionalLayer::new(pool.clone(), schema.records())
        .batched()
        .with_lanes(1);
    let handler = handler_fn(|envelope: Envelope| async move {
        if envelope.key().as_str() == "o-0" {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        insert_stock_move(&envelope).await
    });
    let route = Route::new(
        "deduct_stock",
        KeyExtractor::json_pointer("/orderId"),
        ServiceBuilder::new().layer(records).service(handler),
    );
    let slow = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("o-0")).await }
    });
    // o-0 first: had o-1 reached the lane first, it would have been done before it could go.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiting = tokio::spawn({
        let route = route.clone();
        async move { route.handle(order("o-1")).await }
    });
    // Gone while o-0's handler runs: a shutdown, a timeout in front.
    tokio::time::sleep(Duration::from_millis(100)).await;
    waiting.abort();
    assert_eq!(slow.await.unwrap(), Outcome::Processed);
    assert_eq!(
        schema
            .count(
                "SELECT count(*) FROM consumption_record r WHERE status = 'SUCCESS'
                 AND NOT EXISTS (SELECT 1 FROM stock_moves m WHERE m.order_id = r.message_key)"
            )
            .await,
        0,
        "a key recorded as processed without its effect"
    );
    assert_eq!(route.handle(order("o-1")).await, Outcome::Processed);
    let moves = moves(&schema).await;
    assert_eq!((moves.get("o-0"), moves.get("o-1")), (Some(&1), Some(&1)));
}

/// Receipts deferred to the record's commit (`PgTransaction::defer`): gathered per
/// transaction, written by one statement each; `written` counts the statements that
/// succeeded.
struct Receipts {
    orders: Vec<String>,
    written: Arc<AtomicUsize>,
}

impl CommitRows for Receipts {
    fn absorb(&mut self, more: Self) -> Option<Self> {
        self.orders.extend(more.orders);
        None
    }

    async fn write(self, client: &oncely::postgres::deadpool_postgres::Client) -> Result<(), PgError> {
        client
            .execute(
                "INSERT INTO receipts (order_id) SELECT unnest($1::text[])",
                &[&self.orders],
            )
            .await?;
        self.written.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_deferred_to_the_commit_are_written_once_per_transaction_with_it_or_not_at_all() {
    for mode in RecordMode::ALL {
        let (schema, pool) = stock_schema(8).await;
        // o-7's receipt breaks a constraint: found only as the record commits, it must take
        // o-7's stock move down with it, and nobody else's.
        schema
            .execute("CREATE TABLE receipts (order_id TEXT PRIMARY KEY CHECK (order_id <> 'o-7'))")
            .await;
        let written = Arc::new(AtomicUsize::new(0));
        let counted = written.clone();
        let handler = handler_fn(move |envelope: Envelope| {
            let written = counted.clone();
            async move {
                insert_stock_move(&envelope).await?;
                let tx = envelope.extensions().get::<PgTransaction>().unwrap().clone();
                let order = envelope.key().to_string();
                tx.defer(Receipts {
                    orders: vec![order.clone()],
                    written,
                });
                // Deferred, then failed: the receipt must never be written.
                if order == "o-10" {
                    return Err(HandlerError::transient("payment service timed out"));
                }
                Ok(())
            }
        });
        let deferring = route(mode.stack(&pool, schema.records(), handler));
        let outcomes = handle_all(&deferring, orders(40)).await;

        let failed: Vec<_> = outcomes
            .iter()
            .enumerate()
            .filter(|(_, outcome)| **outcome != Outcome::Processed)
            .map(|(i, outcome)| (i, outcome.retry_reason()))
            .collect();
        assert_eq!(
            failed,
            [
                (7, Some(RetryReason::HandlerFailed)),
                (10, Some(RetryReason::HandlerFailed))
            ],
            "{mode:?}"
        );
        let moves = moves(&schema).await;
        assert_eq!(moves.len(), 38, "{mode:?}: {moves:?}");
        assert!(
            !moves.contains_key("o-7") && !moves.contains_key("o-10"),
            "{mode:?}"
        );
        let receipts = schema.count("SELECT count(*) FROM receipts").await;
        let with_moves = schema
            .count("SELECT count(*) FROM receipts JOIN stock_moves USING (order_id)")
            .await;
        assert_eq!((receipts, with_moves), (38, 38), "{mode:?}");
        let transactions = committing_transactions(&schema).await;
        assert_eq!(
            written.load(Ordering::SeqCst) as i64,
            transactions,
            "{mode:?}: one receipt statement per committed transaction"
        );
        if mode == RecordMode::Batched {
            assert!(
                transactions < 38,
                "{mode:?}: {transactions} commits for 38 orders"
            );
        }
    }
}
