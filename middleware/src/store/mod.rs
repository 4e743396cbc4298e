//! Each store's one home: its plumbing, its SQL or scripts, its migrations, and every tier's
//! backend on it (`memory/`, `redis/`, `postgres/`, `mysql/`), and what the SQL stores share
//! (`sql/`: the claim decision, the batched mode's lanes), and how the requests of concurrent
//! deliveries share round trips (`coalesce.rs`). Nothing here is imported by users: each
//! tier re-exports its backends where users look for them (`oncely::flag::RedisFlagStore`,
//! `oncely::record::PgTransactionalLayer`, …).

#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub(crate) mod coalesce;
#[cfg(feature = "memory")]
pub(crate) mod memory;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod sql;
