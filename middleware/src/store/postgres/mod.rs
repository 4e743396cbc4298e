//! The PostgreSQL store: the record tier's backends (transactional, its half of the batched
//! mode, three-step, the reconciler's statements, the operator's view in `admin.rs`), the state guard's store, the lock store,
//! the pre-filter's rebuild, and what they share —
//! connections that return to the pool only when clean, validated names, migrations
//! (`migrations/`), and every statement on oncely's tables.
//!
//! Every value goes to the server as a bound parameter. Schema, table and column names
//! cannot be parameters, so they are validated as plain identifiers ([`Ident`]) and quoted
//! before they are put into SQL.

pub(crate) mod admin;
pub(crate) mod claims;
pub(crate) mod lock;
mod migrate;
mod names;
#[cfg(feature = "prefilter")]
pub(crate) mod prefilter;
pub(crate) mod record;
pub(crate) mod state;
mod status_columns;

use std::sync::atomic::{AtomicBool, Ordering};

use deadpool_postgres::tokio_postgres::NoTls;
use deadpool_postgres::tokio_postgres::error::SqlState;
use deadpool_postgres::{Object, Pool};

use crate::error::StoreError;
pub use migrate::{migrate, migrate_lock, migrate_script, migrate_state};
pub use names::{Ident, Table, responses_table};
pub use status_columns::StatusColumns;

/// True when `error` is PostgreSQL ending a transaction, or a statement, to let another
/// through: a deadlock, a serialization conflict, or a lock wait past `lock_timeout` (55P03,
/// MySQL's 1205): nothing is wrong with the store, and the same work in other company (or a
/// moment later) passes.
pub(crate) fn lost_to_another_transaction(error: &StoreError) -> bool {
    match error {
        StoreError::Failed { source } => source
            .downcast_ref::<deadpool_postgres::tokio_postgres::Error>()
            .and_then(|error| error.code())
            .is_some_and(|code| {
                [
                    SqlState::T_R_DEADLOCK_DETECTED,
                    SqlState::T_R_SERIALIZATION_FAILURE,
                    SqlState::LOCK_NOT_AVAILABLE,
                ]
                .contains(code)
            }),
        StoreError::Malformed { .. } => false,
    }
}

/// A pooled connection that goes back to the pool only once its user has said the session
/// is clean: no transaction open, no statement still running.
///
/// Dropped without [`mark_clean`](Checkout::mark_clean) — a future dropped by a timeout or
/// a shutdown, a panic, an error that left the transaction's state unknown — the connection
/// is taken out of the pool and closed, which makes the server roll back whatever it had
/// open, and the statement it may still be running is cancelled: the server would otherwise
/// finish it, holding its row and index locks, before it noticed the closed connection.
/// deadpool's default recycling only checks that a connection is not closed, so returning such a connection would let the next user's `BEGIN` run inside the abandoned
/// transaction and its `COMMIT` commit the abandoned writes.
pub(crate) struct Checkout {
    object: Option<Object>,
    clean: AtomicBool,
}

impl Checkout {
    /// Takes a connection from `pool`.
    pub(crate) async fn get(pool: &Pool) -> Result<Self, StoreError> {
        let object = pool.get().await?;
        Ok(Checkout {
            object: Some(object),
            clean: AtomicBool::new(false),
        })
    }

    /// The connection.
    pub(crate) fn client(&self) -> &deadpool_postgres::Client {
        self.object.as_ref().expect("taken only on drop")
    }

    /// Says the session is clean: on drop the connection goes back to the pool.
    pub(crate) fn mark_clean(&self) {
        self.clean.store(true, Ordering::Release);
    }

    /// Runs `run` on the connection and marks it clean once `run` finished, whatever it
    /// answered: for statements outside a transaction, whose failure leaves nothing open.
    pub(crate) async fn run<T>(
        pool: &Pool,
        run: impl AsyncFnOnce(&deadpool_postgres::Client) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let checkout = Checkout::get(pool).await?;
        let answer = run(checkout.client()).await;
        checkout.mark_clean();
        answer
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(object) = self.object.take()
            && !self.clean.load(Ordering::Acquire)
        {
            let cancel = object.cancel_token();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    // Over TLS-only servers this fails; closing the connection still ends the
                    // transaction once the statement is done.
                    let _ = cancel.cancel_query(NoTls).await;
                });
            }
            // Detached from the pool, the client is dropped here and its connection closed.
            drop(Object::take(object));
        }
    }
}
