//! The shop on either SQL store, for the HTTP cases every store must pass: each case is
//! written once over [`AnyShop`] and run on both ([`both_stores!`](crate::both_stores)).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use oncely::mysql::sqlx;

use crate::http::{Faults, Shop};
use crate::http_mariadb::MariaShop;

/// Which store a shop keeps its record, responses, tokens and effects in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpStore {
    /// PostgreSQL, `DATABASE_URL`.
    Postgres,
    /// MariaDB or MySQL, `MYSQL_URL`.
    Mariadb,
}

/// A shop on one store.
pub enum AnyShop {
    /// On PostgreSQL.
    Postgres(Shop),
    /// On MariaDB.
    Mariadb(MariaShop),
}

impl AnyShop {
    /// A shop on `store`, with a pool of `pool_size` connections.
    pub async fn new(store: HttpStore, pool_size: u32) -> Self {
        match store {
            HttpStore::Postgres => AnyShop::Postgres(Shop::new(pool_size as usize).await),
            HttpStore::Mariadb => AnyShop::Mariadb(MariaShop::new(pool_size).await),
        }
    }

    /// Its store.
    pub fn store(&self) -> HttpStore {
        match self {
            AnyShop::Postgres(_) => HttpStore::Postgres,
            AnyShop::Mariadb(_) => HttpStore::Mariadb,
        }
    }

    /// The faults its handler injects.
    pub fn faults(&self) -> &Arc<Faults> {
        match self {
            AnyShop::Postgres(shop) => &shop.faults,
            AnyShop::Mariadb(shop) => &shop.faults,
        }
    }

    /// Its app (the flag in front of the transactional record) on its own pool, the handler
    /// cut off after `timeout`.
    pub async fn app(&self, redis_url: &str, timeout: Duration) -> Router {
        match self {
            AnyShop::Postgres(shop) => shop.app_with_timeout(shop.pool.clone(), redis_url, timeout).await,
            AnyShop::Mariadb(shop) => shop.app(redis_url, timeout).await,
        }
    }

    /// `POST /orders` behind the transactional record alone, per request or `batched`.
    pub fn record_only_app(&self, batched: bool) -> Router {
        match self {
            AnyShop::Postgres(shop) => shop.record_only_app(batched),
            AnyShop::Mariadb(shop) => shop.record_only_app(batched),
        }
    }

    /// `POST /orders` behind the record alone, on a pool whose sessions wait at most a
    /// second for a row lock.
    pub async fn impatient_app(&self) -> Router {
        match self {
            AnyShop::Postgres(shop) => shop.impatient_app(),
            AnyShop::Mariadb(shop) => shop.impatient_app().await,
        }
    }

    /// The arguments that point `oncely` at the shop's record table.
    pub fn cli_args(&self) -> Vec<String> {
        match self {
            AnyShop::Postgres(shop) => vec!["--schema".into(), shop.schema.name().to_owned()],
            AnyShop::Mariadb(shop) => vec![
                "--store".into(),
                "mysql".into(),
                "--schema".into(),
                shop.database.name.clone(),
            ],
        }
    }

    /// Every row of every table of the shop's schema or database, as text: what a dump or
    /// a backup would hold.
    pub async fn dump(&self) -> String {
        match self {
            AnyShop::Postgres(shop) => shop.dump().await,
            AnyShop::Mariadb(shop) => shop.dump().await,
        }
    }

    /// The number of effects written.
    pub async fn effects(&self) -> i64 {
        match self {
            AnyShop::Postgres(shop) => shop.effects().await,
            AnyShop::Mariadb(shop) => shop.effects().await,
        }
    }

    /// Runs `sql` in the shop's schema or database.
    pub async fn execute(&self, sql: &str) {
        match self {
            AnyShop::Postgres(shop) => shop.schema.execute(sql).await,
            AnyShop::Mariadb(shop) => {
                sqlx::raw_sql(sql)
                    .execute(&shop.database.pool)
                    .await
                    .unwrap_or_else(|error| panic!("{sql}: {error}"));
            }
        }
    }

    /// The number `sql` (a `SELECT count(*)` or similar) answers in the shop's schema or
    /// database.
    pub async fn count(&self, sql: &str) -> i64 {
        match self {
            AnyShop::Postgres(shop) => shop.schema.count(sql).await,
            AnyShop::Mariadb(shop) => sqlx::query_scalar(sql)
                .fetch_one(&shop.database.pool)
                .await
                .unwrap_or_else(|error| panic!("{sql}: {error}")),
        }
    }

    /// The statement that moves `column` of `table`'s rows where `filter` holds
    /// `seconds` into the past (or the future, when negative), in this store's SQL.
    pub fn shift_sql(&self, table: &str, column: &str, seconds: i64, filter: &str) -> String {
        match self {
            AnyShop::Postgres(_) => format!(
                "UPDATE {table} SET {column} = {column} - make_interval(secs => {seconds}) WHERE {filter}"
            ),
            AnyShop::Mariadb(_) => {
                format!("UPDATE {table} SET {column} = {column} - INTERVAL {seconds} SECOND WHERE {filter}")
            }
        }
    }
}

/// Runs each async case `name(store: HttpStore)` listed as a test on each store, in modules
/// `postgres` and `mariadb`.
#[macro_export]
macro_rules! both_stores {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case($crate::http_stores::HttpStore::Postgres).await
                }
            )*
        }
        mod mariadb {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case($crate::http_stores::HttpStore::Mariadb).await
                }
            )*
        }
    };
}
