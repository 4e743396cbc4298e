//! Run with: `cargo run -p payment-callback --bin driver -- --serve` (the endpoint in this
//! process, on a free loopback port), or `-- --url http://127.0.0.1:3000/notify` against a
//! running `server`. It prints what was credited, and exits non-zero if any order was
//! credited twice or not at all.
//!
//! Plays a payment provider: every order is paid, and its notification is posted on WeChat
//! Pay's retry schedule (15 s, 15 s, 30 s, 3 min, 10 min, 20 min, 30 min, 30 min, 30 min,
//! 60 min, 3 h, 3 h, 3 h, 6 h, 6 h), compressed in time, until it reads `SUCCESS`. On top:
//! - notifications start in random order, and some orders are created only after their
//!   first notification was sent (the endpoint answers 503 until then);
//! - some acknowledgements are "lost": the provider sends the notification again anyway;
//! - some orders are paid twice, under a second transaction id (a double-clicked pay button):
//!   the second must not be credited;
//! - one notification arrives as 64 concurrent copies.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use oncely::postgres::deadpool_postgres::Pool;
use payment_callback::{Notification, app, setup};

/// WeChat Pay's notification retry schedule: the wait before each retry.
const SCHEDULE_SECS: [u64; 15] = [
    15, 15, 30, 180, 600, 1200, 1800, 1800, 1800, 3600, 10800, 10800, 10800, 21600, 21600,
];

#[derive(Parser)]
struct Args {
    /// Serve the endpoint in this process, on a free loopback port.
    #[arg(long)]
    serve: bool,
    /// The endpoint to notify, when not serving it here.
    #[arg(long, default_value = "http://127.0.0.1:3000/notify")]
    url: String,
    /// Orders to pay.
    #[arg(long, default_value_t = 300)]
    orders: usize,
    /// How many times faster than real time the schedule runs (15 s → 7.5 ms at 2000).
    #[arg(long, default_value_t = 2000.0)]
    speedup: f64,
}

/// What the endpoint answered, by kind, over the whole run.
#[derive(Default)]
struct Answers(Mutex<BTreeMap<String, u64>>);

impl Answers {
    fn count(&self, kind: String) {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(kind)
            .or_default() += 1;
    }
}

/// One payment the provider notifies: an order paid under a transaction id.
#[derive(Clone)]
struct Payment {
    notification: Notification,
    /// Acknowledgements the provider "loses" before it believes one.
    lost_acks: u32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (pool, records) = setup().await?;
    let url = if args.serve {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/notify", listener.local_addr()?);
        let app = app(pool.clone(), records).await?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    } else {
        args.url.clone()
    };
    let run = format!("run-{}", oncely::Token::random());
    let payments = payments(&run, args.orders);
    let second_payments = payments.len() - args.orders;
    let (early, late) = create_orders(&pool, &run, args.orders).await?;
    println!(
        "notifying {url}: {} orders, {} payments",
        args.orders,
        payments.len()
    );

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let answers = Arc::new(Answers::default());
    let mut providers = Vec::new();
    // The first payment arrives as 64 concurrent copies.
    for copy in 0..64 {
        let mut payment = payments[0].clone();
        payment.lost_acks = u32::from(copy == 0);
        providers.push(tokio::spawn(notify(
            client.clone(),
            url.clone(),
            payment,
            args.speedup,
            answers.clone(),
        )));
    }
    for payment in payments.into_iter().skip(1) {
        let start = Duration::from_millis(fastrand::u64(0..200));
        let (client, url, answers) = (client.clone(), url.clone(), answers.clone());
        providers.push(tokio::spawn(async move {
            tokio::time::sleep(start).await;
            notify(client, url, payment, args.speedup, answers).await
        }));
    }
    // The late orders appear while their notifications are already being retried.
    tokio::time::sleep(Duration::from_millis(300)).await;
    create(&pool, &late).await?;
    let mut gave_up = 0;
    for provider in providers {
        gave_up += u64::from(!provider.await?);
    }
    let expected = Expected {
        orders: early.len() + late.len(),
        late: late.len(),
        second_payments,
    };
    report(&pool, &run, &expected, &answers, gave_up).await
}

/// Every order's payment, in random order, 5 % of orders paid a second time.
fn payments(run: &str, orders: usize) -> Vec<Payment> {
    let mut payments = Vec::new();
    for order in 0..orders {
        let paid = |transaction: String| Payment {
            notification: Notification {
                transaction_id: transaction,
                out_trade_no: format!("{run}-order-{order}"),
                amount_cents: 100 + order as i64,
                trade_state: "SUCCESS".to_owned(),
                notified_at_ms: 0,
            },
            lost_acks: u32::from(fastrand::u8(0..100) < 30) + u32::from(fastrand::u8(0..100) < 10),
        };
        payments.push(paid(format!("{run}-txn-{order}")));
        if fastrand::u8(0..100) < 5 {
            payments.push(paid(format!("{run}-txn-{order}-again")));
        }
    }
    fastrand::shuffle(&mut payments[1..]);
    payments
}

/// Creates 90 % of the orders now; answers their ids, and those of the rest, to create later.
async fn create_orders(
    pool: &Pool,
    run: &str,
    orders: usize,
) -> Result<(Vec<String>, Vec<String>), Box<dyn std::error::Error>> {
    let ids: Vec<String> = (0..orders).map(|order| format!("{run}-order-{order}")).collect();
    let (early, late): (Vec<_>, Vec<_>) = ids
        .into_iter()
        .enumerate()
        .partition(|(order, _)| order % 10 != 7);
    let early: Vec<String> = early.into_iter().map(|(_, id)| id).collect();
    create(pool, &early).await?;
    Ok((early, late.into_iter().map(|(_, id)| id).collect()))
}

async fn create(pool: &Pool, ids: &[String]) -> Result<(), Box<dyn std::error::Error>> {
    pool.get()
        .await?
        .execute(
            "INSERT INTO payment_callback.orders (id, amount_cents) SELECT id, 0 FROM unnest($1::text[]) AS id",
            &[&ids],
        )
        .await?;
    Ok(())
}

/// Notifies `payment` on the provider's schedule until it believes a `SUCCESS`; false when
/// the schedule ran out first.
async fn notify(
    client: reqwest::Client,
    url: String,
    mut payment: Payment,
    speedup: f64,
    answers: Arc<Answers>,
) -> bool {
    let waits = std::iter::once(0).chain(SCHEDULE_SECS);
    for wait in waits {
        tokio::time::sleep(Duration::from_secs_f64(wait as f64 / speedup)).await;
        payment.notification.notified_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |now| now.as_millis() as u64);
        let body = serde_json::to_vec(&payment.notification).unwrap_or_default();
        let sent = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await;
        let Ok(response) = sent else {
            answers.count("no answer".to_owned());
            continue;
        };
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.bytes().await.unwrap_or_default();
        let code = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|body| body["code"].as_str().map(str::to_owned));
        let success = (200..300).contains(&status) && code.as_deref() == Some("SUCCESS");
        answers.count(match (status, replayed) {
            (_, true) => format!("{status} SUCCESS, answered again"),
            (200..=299, false) => format!("{status} {}", code.as_deref().unwrap_or("?")),
            _ => format!("{status} (retried)"),
        });
        if success {
            if payment.lost_acks == 0 {
                return true;
            }
            payment.lost_acks -= 1;
        }
    }
    false
}

/// What the run must end with.
#[derive(Clone, Copy)]
struct Expected {
    orders: usize,
    late: usize,
    second_payments: usize,
}

/// Prints what was credited; an error when an order was credited twice or not at all, or a
/// second payment was noted as a refund due other than once.
async fn report(
    pool: &Pool,
    run: &str,
    expected: &Expected,
    answers: &Answers,
    gave_up: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let client = pool.get().await?;
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE credits = 1), count(*) FILTER (WHERE credits > 1),
                    count(*) FILTER (WHERE credits = 0),
                    (SELECT count(*) FROM payment_callback.refunds_due WHERE order_id LIKE $1 || '-%')
             FROM (SELECT o.id, count(c.order_id) AS credits FROM payment_callback.orders o
                   LEFT JOIN payment_callback.credits c ON c.order_id = o.id
                   WHERE o.id LIKE $1 || '-%' GROUP BY o.id) AS per_order",
            &[&run],
        )
        .await?;
    let (once, twice, missed, refunds): (i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let Expected {
        orders,
        late,
        second_payments,
    } = *expected;
    println!("orders            {orders} ({late} created after their first notification)");
    println!(
        "notifications     {} answered:",
        answers.0.lock().map_or(0, |a| a.values().sum::<u64>())
    );
    for (kind, count) in answers.0.lock().map_err(|_| "poisoned")?.iter() {
        println!("  {count:>6}  {kind}");
    }
    println!("credited          {once} orders once, {twice} twice, {missed} never");
    println!("refunds due       {refunds} of {second_payments} second payments (not credited)");
    if gave_up > 0 {
        println!("gave up           {gave_up} payments ran out of retries");
    }
    if twice > 0 || missed > 0 || once != orders as i64 || refunds != second_payments as i64 {
        let wrong = format!("{twice} orders credited twice, {missed} never, {refunds} refunds due");
        return Err(wrong.into());
    }
    Ok(())
}
