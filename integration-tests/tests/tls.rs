//! Every store over TLS, against the real TLS listeners `services.sh tls` starts beside the
//! plain ones (see `tls.sh`): the store suites on each, the connection seen encrypted from
//! the server's side, and a certificate from another CA — or no client certificate where
//! the server asks for one — refused with the certificate named, not a hang and not plain
//! text. The adapter contract suite over `amqps://` is in `adapter_contract.rs`.

use std::future::Future;
use std::time::Duration;

use integration_tests::postgres::ScratchSchema;
use integration_tests::redis_server::ScratchRedisCluster;
use integration_tests::tls::{
    amqp_tls_addr, another_ca, database_tls_url, mysql_tls_url, redis_tls_url, settings, without_client_cert,
};
use integration_tests::unique;
use oncely::flag::RedisFlagStore;
use oncely::lock::RedisLockStore;
use oncely::mysql::sqlx::mysql::MySqlPoolOptions;
use oncely::mysql::{Table, migrate};
use oncely::record::{MysqlRecordStore, PgRecordStore};
use oncely::state_guard::PgStateStore;
use oncely::tls::TlsSettings;

/// An error within 10 s, not a connection and not a hang: its text with its sources'.
async fn refused<T, E: std::error::Error>(what: &str, attempt: impl Future<Output = Result<T, E>>) -> String {
    let answer = tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 10 s"));
    let error = match answer {
        Ok(_) => panic!("{what}: connected"),
        Err(error) => error,
    };
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// [`refused`], by this client's verdict on the server's certificate: the text names it.
async fn refused_certificate<T, E: std::error::Error>(
    what: &str,
    attempt: impl Future<Output = Result<T, E>>,
) -> String {
    let error = refused(what, attempt).await;
    assert!(
        error.contains("invalid peer certificate: UnknownIssuer"),
        "{what}: {error}"
    );
    error
}

/// A pool as a user makes one: `config`, then `manager`, which picks TLS by the mode.
fn pg_pool(url: &str, settings: &TlsSettings, size: usize) -> deadpool_postgres::Pool {
    let config = oncely::tls::postgres::config(url, settings).expect("a valid DATABASE_TLS_URL");
    let manager =
        oncely::tls::postgres::manager(config, settings, Default::default()).expect("the test certificates");
    deadpool_postgres::Pool::builder(manager)
        .max_size(size)
        .build()
        .expect("a pool")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_passes_the_record_and_state_suites() {
    let pool = pg_pool(&database_tls_url(), &settings(), 16);
    let client = pool.get().await.expect("a TLS connection");
    let seen = client
        .query_one(
            "SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("the server's view of this connection");
    assert!(seen.get::<_, bool>(0), "the server sees a plain-text connection");
    // The server asks for a client certificate (its ssl_ca_file is set) and verified ours.
    let client_dn: Option<String> = seen.get(1);
    assert_eq!(client_dn.as_deref(), Some("/CN=oncely-test-client"));
    drop(client);
    let schema = ScratchSchema::new(&pool).await;
    oncely::store_suite!(record, run: PgRecordStore::new(pool.clone(), schema.records()));
    oncely::store_suite!(state, run: PgStateStore::new(pool.clone(), schema.table("entity_state")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_a_certificate_from_another_ca() {
    let pool = pg_pool(&database_tls_url(), &another_ca(), 1);
    refused_certificate("PostgreSQL", pool.get()).await;
    // Settings for TLS and a URL that names no mode, or `prefer`: TLS is required (through
    // `manager`, a plain connection would have been made), not fallen back from.
    let url = database_tls_url().replace("?sslmode=require", "");
    assert!(
        !url.contains("sslmode"),
        "DATABASE_TLS_URL with another mode: {url}"
    );
    for url in [url.clone(), format!("{url}?sslmode=prefer")] {
        let pool = pg_pool(&url, &another_ca(), 1);
        refused_certificate(&format!("PostgreSQL, {url}"), pool.get()).await;
    }
}

async fn mysql_pool(
    settings: &TlsSettings,
    database: Option<&str>,
) -> Result<oncely::mysql::sqlx::MySqlPool, oncely::mysql::sqlx::Error> {
    let options = oncely::tls::mysql::options(&mysql_tls_url(), settings)?;
    let options = match database {
        Some(database) => options.database(database),
        None => options,
    };
    MySqlPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_over_tls_passes_the_record_suite() {
    let admin = mysql_pool(&settings(), None).await.expect("a TLS connection");
    let (_, cipher): (String, String) =
        oncely::mysql::sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            .fetch_one(&admin)
            .await
            .expect("the session's cipher");
    assert!(!cipher.is_empty(), "the server sees a plain-text connection");
    let database = format!("oncely_tls_{}", oncely::Token::random());
    oncely::mysql::sqlx::query(&format!("CREATE DATABASE {database}"))
        .execute(&admin)
        .await
        .expect("a database of the test's own");
    let pool = mysql_pool(&settings(), Some(&database))
        .await
        .expect("a TLS pool");
    let table = Table::new("consumption_record").expect("a valid name");
    migrate(&pool, &table).await.expect("migrate");
    oncely::store_suite!(record, run: MysqlRecordStore::new(pool.clone(), table.clone()));
    oncely::mysql::sqlx::query(&format!("DROP DATABASE {database}"))
        .execute(&admin)
        .await
        .expect("drop the test's database");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_refuses_a_certificate_from_another_ca() {
    refused_certificate("MariaDB", mysql_pool(&another_ca(), None)).await;
    // Settings for TLS and a URL that names no mode: the identity is verified.
    let url = mysql_tls_url().replace("?ssl-mode=VERIFY_IDENTITY", "");
    assert!(
        !url.contains("ssl-mode"),
        "MYSQL_TLS_URL with another mode: {url}"
    );
    let options = oncely::tls::mysql::options(&url, &another_ca()).expect("a valid URL");
    refused(
        "MariaDB, no ssl-mode",
        MySqlPoolOptions::new().connect_with(options),
    )
    .await;
}

async fn redis_connection(
    settings: &TlsSettings,
) -> Result<redis::aio::MultiplexedConnection, redis::RedisError> {
    let client =
        oncely::tls::redis::client(redis_tls_url().as_str(), settings).expect("a valid REDIS_TLS_URL");
    client.get_multiplexed_async_connection().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_with_a_client_certificate_passes_the_flag_and_lock_suites() {
    let connection = redis_connection(&settings()).await.expect("a TLS connection");
    oncely::store_suite!(flag, run: RedisFlagStore::new(connection.clone()).with_prefix(unique("tls")));
    oncely::store_suite!(lock, run: RedisLockStore::new(connection.clone()).with_prefix(unique("tls")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refuses_another_ca_and_a_client_without_a_certificate() {
    refused_certificate("Redis", redis_connection(&another_ca())).await;
    // The server asks for a client certificate: without one, the handshake (or the first
    // command, which TLS 1.3 sends before the server's verdict) fails — the server hangs
    // up, which is all a client learns of why.
    let refused_without = async {
        let mut connection = redis_connection(&without_client_cert()).await?;
        redis::cmd("PING").query_async::<String>(&mut connection).await
    };
    refused("Redis without a client certificate", refused_without).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_over_tls_passes_the_flag_and_lock_suites() {
    let cluster = ScratchRedisCluster::start_tls();
    let client = oncely::tls::redis::cluster_client(cluster.urls(), &settings()).expect("a cluster client");
    let connection = client
        .get_async_connection()
        .await
        .expect("a TLS cluster connection");
    oncely::store_suite!(flag, run: RedisFlagStore::new(connection.clone()).with_prefix(unique("tls")));
    oncely::store_suite!(lock, run: RedisLockStore::new(connection.clone()).with_prefix(unique("tls")));
}

async fn amqp_connection(settings: &TlsSettings) -> Result<lapin::Connection, lapin::Error> {
    let config = oncely_amqp::tls::config(settings).expect("the test certificates");
    let runtime = lapin::runtime::default_runtime()?;
    lapin::Connection::connect_with_config(&amqp_tls_addr(), Default::default(), config, runtime).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_refuses_another_ca_and_a_client_without_a_certificate() {
    let connection = amqp_connection(&settings()).await.expect("an amqps connection");
    connection.close(200, "done".into()).await.expect("close");
    refused_certificate("RabbitMQ", amqp_connection(&another_ca())).await;
    refused(
        "RabbitMQ without a client certificate",
        amqp_connection(&without_client_cert()),
    )
    .await;
}
