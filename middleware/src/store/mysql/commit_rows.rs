//! Rows the handlers of a MySQL record transaction leave for the tier to write as it
//! commits: [`MysqlCommitRows`], PostgreSQL's `CommitRows` on sqlx.

use std::future::Future;
use std::pin::Pin;

use sqlx::MySqlConnection;

use crate::store::sql::deferred::{Deferred, Gathered};

/// Rows a handler hands to the transactional record on MySQL or MariaDB
/// ([`MysqlTransaction::defer`](crate::record::MysqlTransaction::defer)), written in the
/// record's XA transaction just before it commits.
///
/// What it buys, and its limits, are PostgreSQL's (`CommitRows`, feature `postgres`): with
/// the batched record, the rows of every handler in a batch are gathered
/// ([`absorb`](MysqlCommitRows::absorb)) and written by one statement instead of one
/// statement and round trip per delivery; nothing in the transaction reads them; a
/// constraint they break fails the commit (the batch's deliveries then run alone, and the
/// one whose rows fail is retried); rows of a transaction that does not commit are dropped
/// unwritten. Keep a gathered statement under the server's `max_allowed_packet` (16 MiB on
/// MariaDB, 64 MiB on MySQL 8) and its 65,535 placeholders: refuse to absorb past them.
/// Keep no [`MysqlTransaction`](crate::record::MysqlTransaction) in the rows.
pub trait MysqlCommitRows: Send + 'static {
    /// Takes `more` into these rows when one statement writes both (the same table, say);
    /// gives it back otherwise, and it is written by a statement of its own.
    fn absorb(&mut self, more: Self) -> Option<Self>
    where
        Self: Sized;

    /// Writes the rows on `connection`, inside the record's transaction.
    fn write(self, connection: &mut MySqlConnection) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// A [`MysqlCommitRows`] of any type, waiting for the commit.
pub(crate) trait Pending: Gathered {
    fn write<'a>(
        self: Box<Self>,
        connection: &'a mut MySqlConnection,
    ) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>>;
}

impl<R: MysqlCommitRows> Pending for R {
    fn write<'a>(
        self: Box<Self>,
        connection: &'a mut MySqlConnection,
    ) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>> {
        Box::pin(MysqlCommitRows::write(*self, connection))
    }
}

/// The rows one transaction's handlers deferred, in the order they first did.
#[derive(Default)]
pub(crate) struct DeferredRows(Deferred<dyn Pending>);

impl DeferredRows {
    /// Gathers `rows` into the first deferred rows of its type that absorb them.
    pub(crate) fn add<R: MysqlCommitRows>(&self, rows: R) {
        self.0.add(rows, R::absorb, |rows| Box::new(rows));
    }

    /// Writes every deferred row on `connection`, and forgets them; stops at the first
    /// failure.
    pub(crate) async fn write(&self, connection: &mut MySqlConnection) -> Result<(), sqlx::Error> {
        for rows in self.0.take() {
            rows.write(connection).await?;
        }
        Ok(())
    }
}
