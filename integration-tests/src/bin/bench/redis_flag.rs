//! `redis`: flag claims, and deliveries through the flag and the lock as one tier, next to
//! raw `SET NX PX`, on a `redis-server` the bench starts itself
//! on a free port and empties before every measurement, so each starts from the same empty
//! keyspace and the machine's shared Redis is left alone.

use std::process::Command;
use std::time::Duration;

use std::sync::Arc;

use integration_tests::postgres::{BoxedStack, boxed};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{counting_handler, redis_connection};
use oncely::flag::{FlagLayer, FlagStore, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::{BusinessKey, Delivery, Fingerprint, KeyExtractor, Outcome, Route, Source, Token};
use redis::aio::ConnectionManager;
use tower::ServiceBuilder;

use crate::measure::{IN_FLIGHT, Op, compare_at_each_level, op, throughput};
use crate::report::{Plot, Report, Row, Section, Target};

/// Bench keys in Redis expire on their own.
const KEY_TTL: Duration = Duration::from_secs(20);

/// What one operation of a Redis measurement does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Operation {
    /// The baseline: the store's raw limit for a flag's claim, one `SET NX PX`.
    RawSet,
    /// A flag claim: one `SET NX GET PX`.
    Claim,
    /// A flag claim, then its completion: two round trips.
    ClaimAndComplete,
    /// What a flag with the record behind it does instead: a look, then marking done (a
    /// `GET`, then a `SET PX`).
    LookAndMarkDone,
    /// A delivery through the flag and the lock as one tier, to a handler that does
    /// nothing: two scripts.
    Joint,
    /// The same, with the scripts of concurrent deliveries coalesced.
    JointCoalesced,
}

impl Operation {
    /// The operations measured against [`Operation::RawSet`], in table order.
    const MEASURED: [Operation; 5] = [
        Operation::Claim,
        Operation::ClaimAndComplete,
        Operation::LookAndMarkDone,
        Operation::Joint,
        Operation::JointCoalesced,
    ];

    fn name(self) -> &'static str {
        match self {
            Operation::RawSet => "raw `SET NX PX`",
            Operation::Claim => "flag claim (`SET NX GET PX`)",
            Operation::ClaimAndComplete => "flag claim + complete (2 round trips)",
            Operation::LookAndMarkDone => "flag with the record behind: look + mark done (`GET`, `SET PX`)",
            Operation::Joint => "a delivery through the flag and the lock as one tier (2 scripts)",
            Operation::JointCoalesced => "the same, coalesced (`with_coalescing(64, 1)`)",
        }
    }

    /// The operation on `connection`, through the flag store where it is the flag's.
    fn op(self, connection: &ConnectionManager) -> Op {
        let store = RedisFlagStore::new(connection.clone());
        match self {
            Operation::RawSet => op(connection.clone(), |mut connection, i| async move {
                let _: Option<String> = redis::cmd("SET")
                    .arg(format!("oncely:raw:{{{i}}}"))
                    .arg("i:00000000000000000000000000000000")
                    .arg("NX")
                    .arg("PX")
                    .arg(KEY_TTL.as_millis() as u64)
                    .query_async(&mut connection)
                    .await
                    .expect("raw SET");
            }),
            Operation::Claim => op(store, |store, i| async move {
                let key = BusinessKey::new(i.to_string());
                store.claim(&key, Token::random(), KEY_TTL).await.expect("claim");
            }),
            Operation::ClaimAndComplete => op(store, |store, i| async move {
                let (key, token) = (BusinessKey::new(i.to_string()), Token::random());
                store.claim(&key, token, KEY_TTL).await.expect("claim");
                store
                    .complete(&key, token, Fingerprint::of(b"bench"), KEY_TTL)
                    .await
                    .expect("complete");
            }),
            Operation::LookAndMarkDone => op(store, |store, i| async move {
                let key = BusinessKey::new(i.to_string());
                store.look(&key).await.expect("look");
                (store.mark_done(&key, Fingerprint::of(b"bench"), KEY_TTL).await).expect("mark done");
            }),
            Operation::Joint => deliveries(joint_route(connection, false)),
            Operation::JointCoalesced => deliveries(joint_route(connection, true)),
        }
    }
}

/// A route with the flag and the lock on `/sku` as one tier, coalesced or not, in front of
/// a handler that does nothing. Coalescing starts its tasks on the current runtime.
fn joint_route(connection: &ConnectionManager, coalesced: bool) -> Route<BoxedStack> {
    let flag = FlagLayer::new(RedisFlagStore::new(connection.clone()), KEY_TTL);
    let lock = LockLayer::new(
        RedisLockStore::new(connection.clone()),
        KeyExtractor::json_pointer("/sku"),
    );
    let joint = FlagLockLayer::new(flag, lock);
    let joint = if coalesced {
        joint.with_coalescing(64, 1)
    } else {
        joint
    };
    let (_, handler) = counting_handler();
    let stack = ServiceBuilder::new().layer(joint).service(handler);
    Route::new("bench", KeyExtractor::json_pointer("/orderId"), boxed(stack))
}

/// Each operation delivers a new order, on an entity of its own, through `route`.
fn deliveries(route: Route<BoxedStack>) -> Op {
    op(Arc::new(route), |route, i| async move {
        let body = format!(r#"{{"orderId":"{i}","sku":"{i}"}}"#);
        let outcome = route.handle(Delivery::new(Source::new("bench"), body)).await;
        assert_eq!(outcome, Outcome::Processed, "a bench delivery");
    })
}

/// Measures every [`Operation::MEASURED`] against [`Operation::RawSet`] at each in-flight
/// level, and adds the table and the claim's target to `report`.
pub(crate) async fn run(report: &mut Report) {
    let server = ScratchRedis::start();
    let connection = redis_connection(&server.url()).await;
    let flush = op(connection.clone(), |mut connection, _| async move {
        let () = redis::cmd("FLUSHALL")
            .query_async(&mut connection)
            .await
            .expect("FLUSHALL");
    });
    let raw_set = Operation::RawSet.op(&connection);
    // The first measurement in a fresh process and server runs visibly faster than the rest;
    // one discarded run keeps it from favouring whichever comes first.
    throughput(IN_FLIGHT[IN_FLIGHT.len() - 1], &raw_set).await;
    let measured = Operation::MEASURED.map(|operation| (operation.name(), operation.op(&connection)));
    let rows = compare_at_each_level(&flush, &raw_set, &measured).await;
    report.add_target(Target {
        what: "Redis flag claims at 64 in flight".into(),
        ratio: Row::last_ratio(&rows, Operation::Claim.name()),
        baseline: "raw SET NX PX".into(),
        at_least: 0.80,
    });
    report.add(Section {
        title: "Redis flag tier".into(),
        baseline_name: Operation::RawSet.name(),
        unit: None,
        rows,
        note: redis_benchmark(&server.url()).map(|line| {
            format!(
                "For scale, redis-benchmark on the same server (64 connections, no client library): {line}"
            )
        }),
        plot: Plot::Curves("Redis: "),
    });
}

/// The server's own limit for the same command, measured by redis-benchmark when present.
fn redis_benchmark(url: &str) -> Option<String> {
    let port = url.rsplit(':').next()?;
    let output = Command::new("redis-benchmark")
        .args(["-p", port, "-c", "64", "-n", "200000", "-r", "100000000", "-q"])
        .args(["SET", "oncely:rb:__rand_int__", "v", "NX", "PX", "20000"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .rev()
        .find(|line| line.contains("requests per second"))?;
    Some(line.rsplit('\r').next().unwrap_or(line).trim().to_owned())
}
