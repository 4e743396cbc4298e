//! The shop of [`http`](crate::http) with its record, stored responses, tokens and effects
//! on MariaDB (or MySQL): the same endpoints, the same faults, one XA transaction per
//! request (or per batch).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use oncely::FingerprintPolicy;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::mysql::sqlx::{self, MySqlPool};
use oncely::record::{MysqlTransaction, MysqlTransactionalLayer};
use oncely_http::{ClientScope, IdempotencyLayer, MysqlResponses, MysqlTokens, TokenField, TokenIssuer};
use tower::ServiceBuilder;

use crate::http::{
    CUT_OFF_SLEEP, Faults, HANDLER_TIMEOUT, MAX_BODY, RESPONSE_EXPIRY, TENANT, after_the_effect,
};
use crate::mysql::StockDatabase;

/// The shop on MariaDB: its database (the record, stored responses, tokens and `effects`),
/// a pool on it, and the faults its handler injects.
pub struct MariaShop {
    /// The database, dropped with the shop.
    pub database: StockDatabase,
    /// The application's pool.
    pub pool: MySqlPool,
    /// The handler's faults.
    pub faults: Arc<Faults>,
    /// The Redis flag's key prefix, the shop's own.
    pub prefix: String,
}

impl MariaShop {
    /// A shop in a database of its own, with its tables migrated, and a pool of
    /// `pool_size` connections.
    pub async fn new(pool_size: u32) -> Self {
        let database = StockDatabase::new().await;
        let effects = "CREATE TABLE effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                       path VARCHAR(64) NOT NULL, body TEXT NOT NULL) ENGINE = InnoDB";
        sqlx::raw_sql(effects)
            .execute(&database.pool)
            .await
            .expect("the effects table");
        let pool = database.pool(pool_size).await;
        let shop = MariaShop {
            database,
            pool,
            faults: Arc::default(),
            prefix: oncely::testing::unique("oncely-http-mariadb"),
        };
        shop.responses().migrate().await.expect("migrate the responses");
        shop.tokens().migrate().await.expect("migrate the tokens");
        shop
    }

    /// The stored responses beside the record table.
    pub fn responses(&self) -> MysqlResponses {
        MysqlResponses::new(self.pool.clone(), &StockDatabase::records()).expect("a table name")
    }

    /// The one-time tokens.
    pub fn tokens(&self) -> MysqlTokens {
        let table = oncely::mysql::Table::new("form_tokens").expect("a table name");
        MysqlTokens::new(self.pool.clone(), table)
    }

    /// The shop's app with its record on its pool and its flag on the Redis at `redis_url`,
    /// the handler cut off after `timeout`: `POST /orders` under an `Idempotency-Key`
    /// scoped by tenant, `POST /forms/orders` under one-time tokens issued by `POST /tokens`.
    pub async fn app(&self, redis_url: &str, timeout: Duration) -> Router {
        let redis = crate::redis_connection(redis_url).await;
        let flag = FlagLayer::new(
            RedisFlagStore::new(redis).with_prefix(self.prefix.clone()),
            Duration::from_secs(3600),
        );
        let record = MysqlTransactionalLayer::new(self.pool.clone(), StockDatabase::records());
        let tiers = ServiceBuilder::new().layer(flag).layer(record);
        let keyed = IdempotencyLayer::new(tiers.clone(), self.responses(), ClientScope::header(TENANT))
            .with_max_body_len(MAX_BODY)
            .with_timeout(timeout)
            .with_expiry(RESPONSE_EXPIRY);
        let once = IdempotencyLayer::new(tiers, self.responses(), ClientScope::header(TENANT))
            .with_one_time_tokens(self.tokens(), TokenField::Form("_token".to_owned()))
            .with_fingerprint(FingerprintPolicy::off());
        let issuer = TokenIssuer::new(
            self.tokens(),
            Duration::from_secs(600),
            ClientScope::header(TENANT),
        );
        let keyed_routes = Router::new().route("/orders", post(create_order)).layer(keyed);
        let token_routes = Router::new()
            .route("/forms/orders", post(create_order))
            .layer(once);
        keyed_routes
            .merge(token_routes)
            .route_service("/tokens", issuer)
            .with_state(self.faults.clone())
    }

    /// `POST /orders` behind the layer with the transactional record alone (no flag: copies
    /// of a key wait in the record), one transaction per request, or `batched`.
    pub fn record_only_app(&self, batched: bool) -> Router {
        let record = MysqlTransactionalLayer::new(self.pool.clone(), StockDatabase::records());
        let (responses, clients) = (self.responses(), ClientScope::header(TENANT));
        let orders = Router::new().route("/orders", post(create_order));
        let orders = match batched {
            true => orders.layer(
                IdempotencyLayer::new(record.batched(), responses, clients)
                    .with_timeout(HANDLER_TIMEOUT)
                    .with_expiry(RESPONSE_EXPIRY),
            ),
            false => orders.layer(
                IdempotencyLayer::new(record, responses, clients)
                    .with_timeout(HANDLER_TIMEOUT)
                    .with_expiry(RESPONSE_EXPIRY),
            ),
        };
        orders.with_state(self.faults.clone())
    }

    /// `POST /orders` behind the transactional record alone, one transaction per request,
    /// cut off after [`HANDLER_TIMEOUT`], on a pool whose sessions wait at most a second for
    /// a row lock (`innodb_lock_wait_timeout`): a copy of a key in flight gives up waiting.
    pub async fn impatient_app(&self) -> Router {
        let options: sqlx::mysql::MySqlConnectOptions =
            crate::mysql::mysql_url().parse().expect("a valid MYSQL_URL");
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .after_connect(|connection, _| {
                Box::pin(async move {
                    use sqlx::Executor;
                    let wait_a_second = "SET SESSION innodb_lock_wait_timeout = 1";
                    connection.execute(wait_a_second).await.map(|_| ())
                })
            })
            .connect_with(options.database(&self.database.name))
            .await
            .expect("an impatient pool");
        let record = MysqlTransactionalLayer::new(pool.clone(), StockDatabase::records());
        let responses = MysqlResponses::new(pool, &StockDatabase::records()).expect("a table name");
        let layer = IdempotencyLayer::new(record, responses, ClientScope::header(TENANT))
            .with_timeout(HANDLER_TIMEOUT);
        Router::new()
            .route("/orders", post(create_order))
            .layer(layer)
            .with_state(self.faults.clone())
    }

    /// Every row of every table of the shop's database, as text (binary columns as they
    /// are, read as UTF-8).
    pub async fn dump(&self) -> String {
        use sqlx::{Column, Row, ValueRef};
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()",
        )
        .fetch_all(&self.database.pool)
        .await
        .expect("the shop's tables");
        let mut dump = String::new();
        for table in tables {
            let rows = sqlx::query(&format!("SELECT * FROM `{table}`"))
                .fetch_all(&self.database.pool)
                .await
                .expect("a table's rows");
            for row in rows {
                for column in row.columns() {
                    let raw = row.try_get_raw(column.ordinal()).expect("a column");
                    if !raw.is_null() {
                        let bytes: Vec<u8> = row.try_get_unchecked(column.ordinal()).unwrap_or_default();
                        dump.push_str(&String::from_utf8_lossy(&bytes));
                        dump.push(' ');
                    }
                }
                dump.push('\n');
            }
        }
        dump
    }

    /// The number of effects written.
    pub async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&self.database.pool)
            .await
            .expect("count the effects")
    }
}

/// The order handler on MariaDB: writes one `effects` row in the record's transaction,
/// then maybe a fault, then answers as the PostgreSQL shop's does.
async fn create_order(
    State(faults): State<Arc<Faults>>,
    Extension(tx): Extension<MysqlTransaction>,
    uri: axum::http::Uri,
    body: Bytes,
) -> Response {
    let text = String::from_utf8_lossy(&body);
    faults.ran(&text);
    let written = sqlx::query("INSERT INTO effects (path, body) VALUES (?, ?)")
        .bind(uri.path())
        .bind(text.as_ref())
        .execute(&tx)
        .await;
    if let Err(error) = written {
        return (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response();
    }
    if Faults::take(&faults.swallowed) {
        let _ = sqlx::query("SELECT * FROM no_such_table").execute(&tx).await;
    }
    if Faults::take(&faults.stalls) {
        let stall = (HANDLER_TIMEOUT * 4).as_secs_f64();
        let _ = sqlx::query("SELECT SLEEP(?)").bind(stall).execute(&tx).await;
    }
    if Faults::take(&faults.cut_off) {
        let sleep = sqlx::query("SELECT SLEEP(?)")
            .bind(CUT_OFF_SLEEP.as_secs_f64())
            .execute(&tx);
        let _ = tokio::time::timeout(Duration::from_millis(50), sleep).await;
    }
    drop(tx);
    after_the_effect(&faults, &uri).await
}
