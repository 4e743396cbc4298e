//! How the lanes of the batched record on a real PostgreSQL treat each other: a copy of a key
//! another lane's open batch holds waits behind that batch instead of blocking its own
//! batch's neighbours on the key's row lock, and a lane that becomes idle while another
//! commits fills its batch instead of starting a transaction for one delivery. Each test
//! asserts the business rows, the outcomes and how many transactions committed.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use integration_tests::postgres::{BoxedStack, boxed, insert_stock_move, schema_pool, stock_schema};
use integration_tests::recorder::Counts;
use oncely::record::PgTransactionalLayer;
use oncely::{
    DeadLetterReason, Delivery, Envelope, HandlerError, KeyExtractor, Outcome, RetryReason, Route, Source,
    Tier, handler_fn,
};
use tokio::sync::Semaphore;
use tower::Layer;

/// What the tiers recorded in this test process (its global recorder, which the lanes' tasks
/// record to).
static COUNTS: LazyLock<&'static Counts> = LazyLock::new(|| {
    let counts: &'static Counts = Box::leak(Box::default());
    metrics::set_global_recorder(counts).expect("the only recorder of this test binary");
    counts
});

fn order(id: &str) -> Delivery {
    Delivery::new(Source::new("orders"), format!(r#"{{"orderId":"{id}"}}"#))
}

fn route(stack: BoxedStack) -> Route<BoxedStack> {
    Route::new("deduct_stock", KeyExtractor::json_pointer("/orderId"), stack)
}

/// Stock moves of `order`.
async fn moves_of(pool: &oncely::postgres::deadpool_postgres::Pool, order: &str) -> i64 {
    let client = pool.get().await.expect("PostgreSQL");
    let row = (client.query_one("SELECT count(*) FROM stock_moves WHERE order_id = $1", &[&order]))
        .await
        .expect("count the moves");
    row.get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_key_another_batch_holds_waits_behind_it_not_its_neighbours() {
    for first_fails in [false, true] {
        let (schema, pool) = stock_schema(8).await;
        let gate = Arc::new(Semaphore::new(0));
        let held = match first_fails {
            false => "held",
            true => "held-fails",
        };
        let layer = PgTransactionalLayer::new(pool.clone(), schema.records())
            .batched()
            .with_lanes(2);
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stack = boxed(layer.layer(handler_fn({
            let (gate, runs) = (gate.clone(), runs.clone());
            move |envelope: Envelope| {
                let (gate, runs) = (gate.clone(), runs.clone());
                async move {
                    insert_stock_move(&envelope).await?;
                    let first = envelope.key().as_str().starts_with("held")
                        && runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
                    if first {
                        gate.acquire().await.expect("the gate").forget();
                        if envelope.key().as_str() == "held-fails" {
                            return Err(HandlerError::transient("the payment service timed out"));
                        }
                    }
                    Ok::<(), HandlerError>(())
                }
            }
        })));
        let route = route(stack);
        let spawn = |id: &str| {
            let (route, delivery) = (route.clone(), order(id));
            tokio::spawn(async move { route.handle(delivery).await })
        };
        let original = spawn(held);
        // The original's batch is open, its handler waiting at the gate.
        while runs.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let copy = spawn(held);
        // The same key with another payload, parked behind the original too.
        let other_payload = {
            let route = route.clone();
            let body = format!(r#"{{"orderId":"{held}","sku":"other"}}"#);
            let delivery = Delivery::new(Source::new("orders"), body);
            tokio::spawn(async move { route.handle(delivery).await })
        };
        let neighbour = spawn("neighbour");
        // The neighbour commits while the original's batch is still open: the copy did not
        // take its batch into a wait on the original's row lock.
        let neighbour = tokio::time::timeout(Duration::from_secs(10), neighbour).await;
        let Ok(neighbour) = neighbour else {
            // Let the held batch go, so that the failure reads as this and not as a hang.
            gate.add_permits(2);
            panic!("first fails {first_fails}: the neighbour waited for the held key's batch");
        };
        assert_eq!(neighbour.expect("its task"), Outcome::Processed);
        gate.add_permits(1);
        let (original, copy) = (original.await.expect("its task"), copy.await.expect("its task"));
        let other_payload = other_payload.await.expect("its task");
        match first_fails {
            // Answered from the original's commit, as their claims would find the key's row.
            false => {
                assert_eq!(original, Outcome::Processed);
                assert_eq!(copy, Outcome::Duplicate { tier: Tier::Record });
                let reason = other_payload.dead_letter_reason();
                assert_eq!(
                    reason,
                    Some(DeadLetterReason::PayloadMismatch),
                    "{other_payload:?}"
                );
            }
            // Rolled back: one of the copies, released behind it, runs and applies the
            // effect; the other finds it done (or, with the other payload, in conflict).
            true => {
                let failed = original.retry_reason();
                assert_eq!(failed, Some(RetryReason::HandlerFailed), "{original:?}");
                let copies = [&copy, &other_payload];
                let processed = copies.iter().filter(|o| ***o == Outcome::Processed).count();
                assert_eq!(processed, 1, "{copy:?} {other_payload:?}");
            }
        }
        let stock = schema_pool(schema.name(), 1);
        assert_eq!(moves_of(&stock, held).await, 1, "first fails {first_fails}");
        assert_eq!(
            moves_of(&stock, "neighbour").await,
            1,
            "first fails {first_fails}"
        );
    }
}

/// How many transactions committed the `SUCCESS` records.
async fn committing_transactions(pool: &oncely::postgres::deadpool_postgres::Pool) -> i64 {
    let client = pool.get().await.expect("PostgreSQL");
    let row = client
        .query_one(
            "SELECT count(DISTINCT xmin::text) FROM consumption_record WHERE status = 'SUCCESS'",
            &[],
        )
        .await
        .expect("count the commits");
    row.get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_that_becomes_idle_while_another_commits_fills_its_batch() {
    let counts = *COUNTS;
    let (schema, pool) = stock_schema(8).await;
    // A long linger, so that only the rule under test ends the collecting.
    let layer = PgTransactionalLayer::new(pool.clone(), schema.records())
        .batched()
        .with_lanes(2)
        .with_max_linger(Duration::from_secs(2));
    let stack = boxed(layer.layer(handler_fn(|envelope: Envelope| async move {
        insert_stock_move(&envelope).await?;
        if envelope.key().as_str() == "slow" {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        Ok::<(), HandlerError>(())
    })));
    let route = route(stack);
    let slow = {
        let route = route.clone();
        tokio::spawn(async move { route.handle(order("slow")).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Twenty orders one after another, 10 ms apart, while the slow one's batch is open: a
    // lane that started a transaction for each as it came would commit about twenty times.
    let mut trickle = Vec::new();
    for n in 0..20 {
        let (route, delivery) = (route.clone(), order(&format!("o-{n}")));
        trickle.push(tokio::spawn(async move { route.handle(delivery).await }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for outcome in trickle {
        assert_eq!(outcome.await.expect("its task"), Outcome::Processed);
    }
    assert_eq!(slow.await.expect("its task"), Outcome::Processed);
    let stock = schema_pool(schema.name(), 1);
    for n in 0..20 {
        assert_eq!(moves_of(&stock, &format!("o-{n}")).await, 1, "o-{n}");
    }
    // The slow one's, and the twenty collected while it was open (one more if the first of
    // them went in before the slow one's batch was seen open).
    let transactions = committing_transactions(&stock).await;
    assert!(transactions <= 3, "21 deliveries took {transactions} commits");
    // The batched record's metrics say the same (this test alone commits in this process's
    // lanes while it runs... the other test may too, so only what is certain is checked).
    let committed = counts.get("oncely_batches_total{ending=committed}");
    assert!(
        committed >= transactions as u64,
        "{committed} batches counted, {transactions} committed"
    );
    assert!(counts.get("oncely_batch_deliveries_total{}") >= 21);
}
