//! What the end-to-end measurements share — a channel to RabbitMQ, a Redis of the bench's
//! own, a PostgreSQL schema and a MySQL/MariaDB database with the handler's table — and the
//! stacks they build on them.

use std::convert::Infallible;
use std::time::Duration;

use deadpool_postgres::Pool;
use integration_tests::amqp::connect;
use integration_tests::mysql::{self, StockDatabase};
use integration_tests::postgres::{
    BoxedStack, ScratchSchema, boxed, insert_stock_move, pool, schema_pool, stock_moves,
};
use integration_tests::redis_server::ScratchRedis;
use integration_tests::{redis_connection, unique};
use lapin::Channel;
use oncely::flag::{FlagLayer, RedisFlagStore};
use oncely::flag_lock::FlagLockLayer;
use oncely::lock::{LockLayer, RedisLockStore};
use oncely::mysql::sqlx::MySqlPool;
use oncely::record::{MysqlTransaction, MysqlTransactionalLayer, PgTransactionalLayer, TransactionSafe};
use oncely::{BoxError, Envelope, HandlerError, KeyExtractor, Outcome, handler_fn};
use tower::{Layer, ServiceBuilder};

use crate::baseline::Writer;

/// Where a stack keeps its record and its handler's row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    Postgres,
    Mysql,
}

impl Store {
    /// As the report names it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Store::Postgres => "PostgreSQL",
            Store::Mysql => "MariaDB",
        }
    }
}

/// How the record tier runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Record {
    /// A transaction per delivery.
    PerDelivery,
    /// Batched, with per-delivery handlers.
    Batched,
    /// Batched, with a batch handler writing a batch's rows in one statement.
    BatchHandler,
}

impl Record {
    /// As the report names it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Record::PerDelivery => "record per delivery",
            Record::Batched => "batched record",
            Record::BatchHandler => "batched record + batch handler",
        }
    }
}

/// Connections and scratch stores of the measurements.
pub(crate) struct Services {
    /// Held for the channel's sake.
    _connection: lapin::Connection,
    pub(crate) channel: Channel,
    redis: ScratchRedis,
    pub(crate) schema: ScratchSchema,
    /// Connections that search the schema first.
    schema_pool: Pool,
    /// The MySQL/MariaDB database, dropped with the services.
    _mysql: StockDatabase,
    /// Connections to it.
    mysql_pool: MySqlPool,
}

impl Services {
    pub(crate) async fn start() -> Self {
        let connection = connect().await.expect("RabbitMQ");
        let channel = connection.create_channel().await.expect("a channel");
        let redis = ScratchRedis::start();
        let schema = ScratchSchema::new(&pool(16)).await;
        let schema_pool = schema_pool(schema.name(), 16);
        // No unique index: a doubled effect shows as two rows.
        schema
            .execute("CREATE TABLE stock_moves (order_id TEXT NOT NULL)")
            .await;
        let mysql = StockDatabase::new().await;
        Services {
            _connection: connection,
            channel,
            redis,
            schema,
            schema_pool,
            mysql_pool: mysql.pool(16).await,
            _mysql: mysql,
        }
    }

    /// The at-least-once consumer's row writer on `store`, on a pool the size of the stacks'.
    pub(crate) fn writer(&self, store: Store) -> Writer {
        match store {
            Store::Postgres => Writer::Postgres(self.schema_pool.clone()),
            Store::Mysql => Writer::Mysql(self.mysql_pool.clone()),
        }
    }

    /// A Redis flag with a prefix of its own, so that no measurement sees another's keys.
    pub(crate) async fn flag(&self) -> FlagLayer<RedisFlagStore<redis::aio::ConnectionManager>> {
        let flags =
            RedisFlagStore::new(redis_connection(&self.redis.url()).await).with_prefix(unique("bench"));
        FlagLayer::new(flags, Duration::from_secs(600))
    }

    /// The record tier on `store`, run as `record`, with its handler writing the order's
    /// row in the record's transaction.
    pub(crate) fn record(&self, store: Store, record: Record) -> BoxedStack {
        match store {
            Store::Postgres => {
                let layer = PgTransactionalLayer::new(self.schema_pool.clone(), self.schema.records());
                match record {
                    Record::PerDelivery => boxed(layer.layer(pg_handler())),
                    Record::Batched => boxed(layer.batched().layer(pg_handler())),
                    Record::BatchHandler => boxed(layer.batched().batch_handler(stock_moves)),
                }
            }
            Store::Mysql => {
                let layer = MysqlTransactionalLayer::new(self.mysql_pool.clone(), StockDatabase::records());
                match record {
                    Record::PerDelivery => boxed(layer.layer(mysql_handler())),
                    Record::Batched => boxed(layer.batched().layer(mysql_handler())),
                    Record::BatchHandler => boxed(layer.batched().batch_handler(mysql::stock_moves)),
                }
            }
        }
    }

    /// The full stack in front of `records` (the record tier with its handler): the Redis
    /// flag with the record behind it and the Redis lock on the body's `/sku`, as one tier
    /// ([`FlagLockLayer`], its scripts coalesced), as the fast path composes them.
    pub(crate) async fn full_stack<S>(&self, records: S) -> BoxedStack
    where
        S: tower::Service<Envelope, Response = Outcome> + Clone + Send + Sync + 'static,
        S::Future: Send,
        S::Error: Into<BoxError>,
    {
        let connection = redis_connection(&self.redis.url()).await;
        let lock = LockLayer::new(
            RedisLockStore::new(connection).with_prefix(unique("bench")),
            KeyExtractor::json_pointer("/sku"),
        );
        let flag = self.flag().await.with_record_behind();
        boxed(
            ServiceBuilder::new()
                .layer(FlagLockLayer::new(flag, lock).with_coalescing(64, 1))
                .service(records),
        )
    }

    /// Orders of `orders` with more than one row on PostgreSQL: effects applied twice.
    pub(crate) async fn doubled(&self, orders: &[String]) -> i64 {
        let client = self.schema_pool.get().await.expect("PostgreSQL");
        let doubled = "SELECT count(*) FROM (SELECT order_id FROM stock_moves WHERE order_id = ANY($1) \
                       GROUP BY order_id HAVING count(*) > 1) doubled";
        let row = client.query_one(doubled, &[&orders]).await;
        row.expect("count the doubled orders").get(0)
    }
}

/// A handler that does nothing: the runner's and its tiers' cost alone.
pub(crate) fn nothing()
-> impl tower::Service<Envelope, Response = Outcome, Error = Infallible, Future: Send> + Clone + Send + Sync {
    handler_fn(|_: Envelope| async { Ok::<(), HandlerError>(()) })
}

/// The handler that writes the order's row in the PostgreSQL record's transaction.
fn pg_handler() -> impl tower::Service<Envelope, Response = Outcome, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ TransactionSafe {
    handler_fn(|envelope: Envelope| async move { insert_stock_move(&envelope).await })
}

/// The same in the MySQL/MariaDB record's transaction.
fn mysql_handler() -> impl tower::Service<Envelope, Response = Outcome, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ TransactionSafe {
    handler_fn(|envelope: Envelope| async move {
        let tx = envelope.extensions().get::<MysqlTransaction>().cloned();
        let tx = tx.expect("the MySQL transactional record in front");
        mysql::stock_move(tx, envelope.key().clone()).await?;
        Ok::<(), HandlerError>(())
    })
}
