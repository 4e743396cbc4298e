//! `http`: requests per second of an order endpoint behind oncely-http's layer (the Redis
//! flag in front of the transactional record, the row and the stored response written in
//! the record's transaction) next to the same endpoint writing its row without the layer,
//! both served by axum on loopback and loaded by an HTTP client in this process, at the same
//! concurrency.

use integration_tests::http::{Shop, TENANT, TestServer, client};
use integration_tests::redis_url;

use crate::measure::{Op, ROUNDS, compare_at_each_level, op};
use crate::report::{Plot, Report, Section, Target};

/// The endpoints measured against the one without the layer, in table order.
const LAYERED: [&str; 3] = [
    "with the layer, the record per request (row, response and record in one transaction)",
    "with the layer, the record batched",
    "with the layer, the Redis flag in front of the record per request",
];

/// Measures both endpoints at each in-flight level and adds the table and the target.
pub(crate) async fn run(report: &mut Report) {
    let shop = Shop::new(16).await;
    let plain = TestServer::start(shop.plain_app()).await;
    let servers = [
        TestServer::start(shop.record_only_app(false)).await,
        TestServer::start(shop.record_only_app(true)).await,
        TestServer::start(shop.app(shop.pool.clone(), &redis_url()).await).await,
    ];
    let nothing = op((), |(), _| async {});
    let baseline = post_order(plain.url("/orders"), None);
    let measured: Vec<_> = LAYERED
        .iter()
        .zip(&servers)
        .enumerate()
        .map(|(variant, (what, server))| (*what, post_order(server.url("/orders"), Some(variant))))
        .collect();
    let rows = compare_at_each_level(&nothing, &baseline, &measured).await;
    let batched = rows.iter().rfind(|row| row.what == LAYERED[1]).expect("measured");
    report.add_target(Target {
        what: format!(
            "HTTP endpoint with the Idempotency-Key layer (the record batched) at {} in flight",
            batched.in_flight
        ),
        ratio: batched.ratio(),
        baseline: "the endpoint writing its row without the layer".into(),
        at_least: 0.8,
    });
    report.add_target(Target {
        what: format!(
            "HTTP endpoint, the record batched, at {} in flight: its lowest round of {ROUNDS}",
            batched.in_flight
        ),
        ratio: batched.lowest_ratio.expect("measured in rounds"),
        baseline: "the endpoint writing its row in the same round".into(),
        at_least: 0.7,
    });
    report.add(Section {
        title: "HTTP endpoint (axum on loopback, PostgreSQL pool of 16, the client in the same process)"
            .into(),
        baseline_name: "the endpoint writing its row without the layer",
        unit: Some("requests"),
        rows,
        note: Some(
            "Every request carries a new Idempotency-Key; the layered endpoint's row, its stored \
             response and its record commit in one transaction (batched: with the other \
             requests of its batch). The response is written as the record commits \
             (PgTransaction::defer): one statement per transaction, however many requests it \
             holds. One transaction per request costs the claim, the response and the checked \
             commit besides the handler's insert; batched, concurrent requests share them."
                .into(),
        ),
        plot: Plot::Curves("HTTP: "),
    });
}

/// A `POST` of a new order to `url`, with a fresh key of the endpoint `variant`'s own when
/// given (the endpoints share a record table); the answer must be 201.
fn post_order(url: String, variant: Option<usize>) -> Op {
    op((client(), url), move |(client, url), i| async move {
        let mut request = client
            .post(&url)
            .header(TENANT, "bench")
            .header("content-type", "application/json")
            .body(format!(r#"{{"orderId":"{i}"}}"#));
        if let Some(variant) = variant {
            request = request.header("idempotency-key", format!("bench-{variant}-{i}"));
        }
        let response = request.send().await.expect("the endpoint answers");
        assert_eq!(response.status().as_u16(), 201, "{:?}", response.text().await);
    })
}
