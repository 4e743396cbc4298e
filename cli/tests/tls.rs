//! `oncely` over TLS, as an operator runs it against managed services: `stats` on
//! PostgreSQL and MariaDB, `inspect` with Redis, and `dlq list` on RabbitMQ, each through
//! the listeners `services.sh tls` starts, with `--ca-cert` and a client certificate; and a
//! certificate from another CA refused with the service and its address named, never a hang.

mod common;

use common::{assert_code, json, oncely, stderr};
use integration_tests::amqp::{connect, scratch_topology};
use integration_tests::postgres::{ScratchSchema, pool};
use integration_tests::tls::{amqp_tls_addr, database_tls_url, mysql_tls_url, redis_tls_url, tls_dir};
use oncely::Fingerprint;

/// `--ca-cert` with `ca`, and the client certificate.
fn tls_args(ca: &str) -> Vec<String> {
    let file = |name: &str| tls_dir().join(name).to_string_lossy().into_owned();
    vec![
        "--ca-cert".into(),
        file(ca),
        "--client-cert".into(),
        file("client.pem"),
        "--client-key".into(),
        file("client.key"),
    ]
}

fn with(base: Vec<String>, more: &[&str]) -> Vec<String> {
    base.into_iter()
        .chain(more.iter().map(|more| more.to_string()))
        .collect()
}

/// A schema with one `SUCCESS` row, `o-1`, in its record table.
async fn postgres_scratch() -> ScratchSchema {
    let schema = ScratchSchema::new(&pool(2)).await;
    let fingerprint = Fingerprint::of(b"{}").to_string();
    schema
        .execute(&format!(
            "INSERT INTO consumption_record (message_key, status, payload_fingerprint) VALUES ('o-1', 'SUCCESS', '{fingerprint}')"
        ))
        .await;
    schema
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_inspect_over_tls_on_postgres_and_redis() {
    let schema = postgres_scratch().await;
    let base = with(
        tls_args("ca.pem"),
        &[
            "--json",
            "--database-url",
            &database_tls_url(),
            "--schema",
            schema.name(),
        ],
    );
    let output = oncely(&with(base.clone(), &["stats"])).await;
    assert_code(&output, 0);
    assert_eq!(json(&output)["success"], 1, "{}", json(&output));

    let inspect = with(base, &["--redis-url", &redis_tls_url(), "inspect", "o-1"]);
    let output = oncely(&inspect).await;
    assert_code(&output, 0);
    let view = json(&output);
    assert_eq!(view["record"]["status"], "SUCCESS", "{view}");
    assert!(view["unavailable"].as_array().is_none_or(Vec::is_empty), "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_over_tls_on_mariadb() {
    let pool = integration_tests::mysql::scratch_database(2).await;
    let table = oncely::mysql::Table::new("consumption_record").expect("a valid name");
    oncely::mysql::migrate(&pool, &table).await.expect("migrate");
    let database: String = oncely::mysql::sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(&pool)
        .await
        .expect("the scratch database's name");
    let args = with(
        tls_args("ca.pem"),
        &[
            "--json",
            "--store",
            "mysql",
            "--mysql-url",
            &mysql_tls_url(),
            "--schema",
            &database,
            "stats",
        ],
    );
    let output = oncely(&args).await;
    assert_code(&output, 0);
    assert_eq!(json(&output)["success"], 0, "{}", json(&output));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_over_amqps_with_a_client_certificate() {
    let topology = scratch_topology("cli-tls");
    let channel = connect().await.unwrap().create_channel().await.unwrap();
    topology.declare(&channel).await.unwrap();
    let args = with(
        tls_args("ca.pem"),
        &[
            "--json",
            "--amqp-addr",
            &amqp_tls_addr(),
            "dlq",
            "list",
            "--queue",
            topology.queue(),
        ],
    );
    let output = oncely(&args).await;
    assert_code(&output, 0);
    assert_eq!(common::reasons(&json(&output)), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused_naming_the_service_and_its_address() {
    let schema = postgres_scratch().await;
    let started = std::time::Instant::now();
    let stats = with(
        tls_args("other-ca.pem"),
        &[
            "--database-url",
            &database_tls_url(),
            "--schema",
            schema.name(),
            "stats",
        ],
    );
    let output = oncely(&stats).await;
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(
        error.contains("PostgreSQL at postgres://postgres@127.0.0.1:5432"),
        "{error}"
    );
    assert!(error.contains("UnknownIssuer"), "{error}");

    let topology = scratch_topology("cli-tls-refused");
    let dlq = with(
        tls_args("other-ca.pem"),
        &[
            "--amqp-addr",
            &amqp_tls_addr(),
            "dlq",
            "list",
            "--queue",
            topology.queue(),
        ],
    );
    let output = oncely(&dlq).await;
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(
        error.contains("RabbitMQ at amqps://guest:***@127.0.0.1:5671"),
        "{error}"
    );
    assert!(error.to_lowercase().contains("certificate"), "{error}");

    let mysql = with(
        tls_args("other-ca.pem"),
        &["--store", "mysql", "--mysql-url", &mysql_tls_url(), "stats"],
    );
    let output = oncely(&mysql).await;
    assert_code(&output, 1);
    let error = stderr(&output);
    assert!(error.contains("MySQL at mysql://root@127.0.0.1:3306"), "{error}");
    assert!(error.contains("UnknownIssuer"), "{error}");

    // Each failed at the handshake, not at the 5 s timeout.
    assert!(
        started.elapsed() < std::time::Duration::from_secs(12),
        "{:?}",
        started.elapsed()
    );

    // A CA file that is not there is the settings' fault, named.
    let missing = with(
        vec!["--ca-cert".into(), "/nonexistent/ca.pem".into()],
        &["--database-url", &database_tls_url(), "stats"],
    );
    let output = oncely(&missing).await;
    assert_code(&output, 2);
    assert!(
        stderr(&output).contains("/nonexistent/ca.pem"),
        "{}",
        stderr(&output)
    );
}
