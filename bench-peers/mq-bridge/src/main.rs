//! Run with: `CARGO_TARGET_DIR=/root/.cache/oncely/peer-target cargo run --release --bin mq-bridge-peer -- --amqp-addr amqp://guest:guest@127.0.0.1:5672/%2f --queue q --database-url postgres://postgres@127.0.0.1:5432/test --schema s --messages 1000`
//!
//! Benchmark peer: mq-bridge 1.3's `deduplication` route, as a user of that crate would write
//! it. An AMQP input with the `deduplication` middleware (store: a PostgreSQL table, key: the
//! AMQP `message_id`), a handler that writes one `stock_moves` row per message that gets
//! through, in its own transaction, and the route's at-least-once ack after the handler. It
//! measures, from the first delivery to the last settle, what it takes to consume a queue
//! with duplicates this way, and leaves the doubled rows for the caller to count.
//!
//! A separate crate (its own `[workspace]` and lock file) so that mq-bridge's dependency tree
//! (sled, sqlx 0.9 with its SQLite and MySQL drivers, rustls and aws-lc) stays out of the main
//! workspace's build and CI.
//!
//! mq-bridge's throughput knobs, all exposed here:
//! - `--prefetch` → the AMQP input's `prefetch_count` (`basic.qos`; mq-bridge's default 100);
//! - `--concurrency` → the route's `concurrency`: worker tasks, each taking a whole batch and
//!   running the handler over it one message at a time (mq-bridge's default 1; here by
//!   default prefetch / batch size, so every batch of the prefetch window has a worker);
//! - `--batch-size` → the route's `batch_size`: most messages one read hands to one worker,
//!   and what the dedup store reserves and marks in one statement (mq-bridge's default 512;
//!   here 8).
//!
//! Reading, and the dedup claim, happen on one task; only the handler runs on the workers.
//! The AMQP input declares the queue itself (durable, no arguments), so the queue must be a
//! classic durable queue without x-arguments. sqlx connects with `sslmode=prefer`: append
//! `?sslmode=disable` to `--database-url` to compare with a client that does not use TLS.
//! Optional `--dedup-key <template>` (e.g. `${payload:orderId}`) keys the dedup on a business
//! field instead of the message id; `--timeout-secs` bounds the wait (default 600).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use mq_bridge::errors::ConsumerError;
use mq_bridge::models::{AmqpConfig, DeduplicationMiddleware, Endpoint, EndpointType, Middleware};
use mq_bridge::traits::{BoxFuture, CustomMiddlewareFactory, MessageConsumer, MessageDisposition};
use mq_bridge::{CanonicalMessage, Handled, HandlerError, ReceivedBatch, Route};

/// What the run saw. Shared by the counting middleware (deliveries, settles) and the handler.
#[derive(Default, Debug)]
struct Tally {
    delivered: AtomicU64,
    /// Deliveries the route settled with an ack: a handled message or a dropped duplicate.
    acked: AtomicU64,
    nacked: AtomicU64,
    /// Rows whose transaction committed.
    handled: AtomicU64,
    /// Bodies the handler refused (no JSON, no orderId): acked unhandled, not duplicates.
    rejected: AtomicU64,
    first_delivery: Mutex<Option<Instant>>,
    last_settle: Mutex<Option<Instant>>,
}

/// Counts deliveries and settles. It sits *inside* the dedup middleware (next to the AMQP
/// consumer), because duplicates never reach the handler: the dedup acks them itself, and
/// only a layer below it sees those acks. It adds one counter update per batch.
struct Counting {
    inner: Box<dyn MessageConsumer>,
    tally: Arc<Tally>,
}

#[async_trait]
impl MessageConsumer for Counting {
    async fn receive_batch(&mut self, max: usize) -> Result<ReceivedBatch, ConsumerError> {
        let ReceivedBatch { messages, commit } = self.inner.receive_batch(max).await?;
        if !messages.is_empty() {
            self.tally.first_delivery.lock().unwrap().get_or_insert_with(Instant::now);
            self.tally.delivered.fetch_add(messages.len() as u64, Relaxed);
        }
        let tally = Arc::clone(&self.tally);
        let commit: mq_bridge::traits::BatchCommitFunc = Box::new(move |dispositions| {
            Box::pin(async move {
                let nacks = dispositions.iter().filter(|d| matches!(d, MessageDisposition::Nack)).count();
                let acks = dispositions.len() - nacks;
                commit(dispositions).await?;
                tally.nacked.fetch_add(nacks as u64, Relaxed);
                tally.acked.fetch_add(acks as u64, Relaxed);
                // Commits run concurrently: keep the latest.
                let now = Instant::now();
                let mut last = tally.last_settle.lock().unwrap();
                *last = Some(last.map_or(now, |l| l.max(now)));
                Ok(())
            }) as BoxFuture<'static, anyhow::Result<()>>
        });
        Ok(ReceivedBatch { messages, commit })
    }
    fn commit_requires_order(&self) -> bool {
        self.inner.commit_requires_order()
    }
    fn set_exit_on_empty(&mut self, exit_on_empty: bool) {
        self.inner.set_exit_on_empty(exit_on_empty)
    }
    fn on_connect_hook(&self) -> Option<BoxFuture<'_, anyhow::Result<()>>> {
        self.inner.on_connect_hook()
    }
    fn on_disconnect_hook(&self) -> Option<BoxFuture<'_, anyhow::Result<()>>> {
        self.inner.on_disconnect_hook()
    }
    async fn status(&self) -> mq_bridge::traits::EndpointStatus {
        self.inner.status().await
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[derive(Debug)]
struct CountingFactory(Arc<Tally>);

#[async_trait]
impl CustomMiddlewareFactory for CountingFactory {
    async fn apply_consumer(
        &self,
        inner: Box<dyn MessageConsumer>,
        _route: &str,
        _config: &serde_json::Value,
    ) -> anyhow::Result<Box<dyn MessageConsumer>> {
        Ok(Box::new(Counting { inner, tally: Arc::clone(&self.0) }))
    }
}

struct Args {
    amqp_addr: String,
    queue: String,
    database_url: String,
    schema: String,
    messages: u64,
    prefetch: u16,
    concurrency: usize,
    batch_size: usize,
    dedup_key: Option<String>,
    timeout: Duration,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut flags = std::collections::HashMap::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let name = flag.strip_prefix("--").ok_or_else(|| anyhow::anyhow!("unexpected {flag}"))?;
        let value = it.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
        flags.insert(name.to_string(), value);
    }
    let mut take = |name: &str| flags.remove(name);
    let required = |v: Option<String>, name: &str| v.ok_or_else(|| anyhow::anyhow!("--{name} is required"));
    let prefetch: u16 = take("prefetch").map(|v| v.parse()).transpose()?.unwrap_or(64);
    let mut args = Args {
        amqp_addr: required(take("amqp-addr"), "amqp-addr")?,
        queue: required(take("queue"), "queue")?,
        database_url: required(take("database-url"), "database-url")?,
        schema: required(take("schema"), "schema")?,
        messages: required(take("messages"), "messages")?.parse()?,
        prefetch,
        concurrency: 0,
        batch_size: take("batch-size").map(|v| v.parse()).transpose()?.unwrap_or(8),
        dedup_key: take("dedup-key"),
        timeout: Duration::from_secs(take("timeout-secs").map(|v| v.parse()).transpose()?.unwrap_or(600)),
    };
    // Defaults split the prefetch window into batches of 8 and give each batch a worker:
    // several workers write at once, and the dedup's per-batch statements are amortised.
    // (On 2 cores, 8×8 and 16×4 measured alike at prefetch 64; 1×512, mq-bridge's default,
    // about half as fast, and 64×1 as slow as that.)
    args.concurrency = match take("concurrency") {
        Some(v) => v.parse()?,
        None => usize::from(args.prefetch).div_ceil(args.batch_size).max(1),
    };
    if let Some(unknown) = flags.keys().next() {
        anyhow::bail!("unknown flag --{unknown}");
    }
    // Interpolated into SQL and into the dedup store's URL, so it must be a plain identifier.
    if args.schema.is_empty() || !args.schema.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        anyhow::bail!("--schema must be a plain identifier");
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = parse_args()?;
    let tally = Arc::new(Tally::default());
    mq_bridge::extensions::register_middleware_factory("count", Arc::new(CountingFactory(tally.clone())))?;

    // The handler's own pool: one connection per worker, since a worker runs one message at a
    // time. mq-bridge re-exports the sqlx it is built with, so a user needs no second driver.
    let pool = mq_bridge::sqlx::postgres::PgPoolOptions::new()
        .max_connections(args.concurrency as u32)
        .connect(&args.database_url)
        .await?;
    let insert: &'static str =
        Box::leak(format!("INSERT INTO {}.stock_moves (order_id) VALUES ($1)", args.schema).into_boxed_str());
    let handled = tally.clone();
    let handler = move |msg: CanonicalMessage| {
        let (pool, handled) = (pool.clone(), handled.clone());
        async move {
            let body: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap_or_default();
            let Some(order_id) = body["orderId"].as_str().map(str::to_owned) else {
                handled.rejected.fetch_add(1, Relaxed);
                return Err(HandlerError::NonRetryable(anyhow::anyhow!("body has no orderId")));
            };
            // One transaction per message, committed before the handler returns: the route
            // acks (after the dedup marks the key) only once this is durable.
            let retry = |e: mq_bridge::sqlx::Error| HandlerError::Retryable(e.into());
            let mut tx = pool.begin().await.map_err(retry)?;
            mq_bridge::sqlx::query(insert).bind(order_id).execute(&mut *tx).await.map_err(retry)?;
            tx.commit().await.map_err(retry)?;
            handled.handled.fetch_add(1, Relaxed);
            Ok::<_, HandlerError>(Handled::Ack)
        }
    };

    // The dedup store: a table in the run's schema, on the same database. The store URL's
    // last path segment names the table (`postgres://…/db/<schema>.<table>`).
    let (base, query) = match args.database_url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (args.database_url.as_str(), String::new()),
    };
    let store = format!("{}/{}.mqb_dedup{query}", base.trim_end_matches('/'), args.schema);
    let mut amqp = AmqpConfig::new(&args.amqp_addr).with_queue(&args.queue);
    amqp.prefetch_count = Some(args.prefetch);
    let mut input = Endpoint::new(EndpointType::Amqp(amqp));
    // Listed outer first: the dedup wraps the counter, which wraps the AMQP consumer.
    input.middlewares = vec![
        Middleware::Deduplication(DeduplicationMiddleware {
            store: Some(store),
            sled_path: None,
            // Far longer than a run: no key may expire while its copies are still queued.
            ttl_seconds: 86_400,
            key: args.dedup_key.clone(),
            replay_response: false,
        }),
        Middleware::Custom { name: "count".into(), config: serde_json::Value::Null },
    ];
    let route = Route::new(input, Endpoint::null())
        .with_handler(handler)
        .with_concurrency(args.concurrency)
        .with_batch_size(args.batch_size);
    let handle = route.run("mq_bridge_peer").await?;

    let deadline = Instant::now() + args.timeout;
    while tally.acked.load(Relaxed) < args.messages {
        if Instant::now() > deadline || handle.outcome().is_some() {
            eprintln!(
                "gave up: delivered {} acked {} nacked {} handled {} (route outcome {:?})",
                tally.delivered.load(Relaxed),
                tally.acked.load(Relaxed),
                tally.nacked.load(Relaxed),
                tally.handled.load(Relaxed),
                handle.outcome()
            );
            std::process::exit(1);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let first = tally.first_delivery.lock().unwrap().expect("a delivery before a settle");
    let last = tally.last_settle.lock().unwrap().expect("a settle");
    handle.stop().await;
    let _ = handle.join().await;

    let (seen, handled) = (tally.acked.load(Relaxed), tally.handled.load(Relaxed));
    let rejected = tally.rejected.load(Relaxed);
    let (delivered, nacked) = (tally.delivered.load(Relaxed), tally.nacked.load(Relaxed));
    if delivered != seen || nacked > 0 || rejected > 0 {
        eprintln!("note: {delivered} deliveries, {nacked} nacked, {rejected} bodies rejected");
    }
    println!(
        "{}",
        serde_json::json!({
            "seen": seen,
            "handled": handled,
            "duplicates_dropped": seen - handled - rejected,
            "seconds": (last - first).as_secs_f64(),
        })
    );
    Ok(())
}
