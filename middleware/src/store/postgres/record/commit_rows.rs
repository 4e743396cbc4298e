//! Rows the handlers of a record transaction leave for the tier to write as it commits.

use std::future::Future;
use std::pin::Pin;

use deadpool_postgres::Client;
use deadpool_postgres::tokio_postgres::Error;

use crate::store::sql::deferred::{Deferred, Gathered};

/// Rows a handler hands to the transactional record
/// ([`PgTransaction::defer`](crate::record::PgTransaction::defer)), written in the record's
/// transaction just before its `COMMIT`.
///
/// What it buys: with the batched record, the rows of every handler in a batch are gathered
/// ([`absorb`](CommitRows::absorb)) and written by one statement, where a write of each
/// handler's own would cost the batch a statement and a round trip per delivery, one after
/// another on the batch's connection. oncely-http stores its responses this way.
///
/// Its limits: the rows are written after every handler of the transaction has answered, so
/// nothing in the transaction reads them, and a constraint they break is found only then —
/// the write failing rolls back the whole transaction (the batch: each delivery then runs
/// alone, and the one whose rows fail is retried). Rows of a transaction that does not
/// commit are dropped unwritten. Two deliveries of a batch whose rows write the same row
/// (`ON CONFLICT … DO UPDATE` twice in one statement fails) must be folded together by
/// [`absorb`](CommitRows::absorb). Keep no [`PgTransaction`](crate::record::PgTransaction)
/// in the rows: the tier would see the transaction still held, and commit nothing.
pub trait CommitRows: Send + 'static {
    /// Takes `more` into these rows when one statement writes both (the same table, say);
    /// gives it back otherwise, and it is written by a statement of its own.
    fn absorb(&mut self, more: Self) -> Option<Self>
    where
        Self: Sized;

    /// Writes the rows on `client`, inside the record's transaction.
    fn write(self, client: &Client) -> impl Future<Output = Result<(), Error>> + Send;
}

/// A [`CommitRows`] of any type, waiting for the commit.
pub(super) trait Pending: Gathered {
    fn write(
        self: Box<Self>,
        client: &Client,
    ) -> Pin<Box<dyn Future<Output = Result<(), Error>> + Send + '_>>;
}

impl<R: CommitRows> Pending for R {
    fn write(
        self: Box<Self>,
        client: &Client,
    ) -> Pin<Box<dyn Future<Output = Result<(), Error>> + Send + '_>> {
        Box::pin(CommitRows::write(*self, client))
    }
}

/// The rows one transaction's handlers deferred, in the order they first did.
#[derive(Default)]
pub(super) struct DeferredRows(Deferred<dyn Pending>);

impl DeferredRows {
    /// Gathers `rows` into the first deferred rows of its type that absorb them.
    pub(super) fn add<R: CommitRows>(&self, rows: R) {
        self.0.add(rows, R::absorb, |rows| Box::new(rows));
    }

    /// Writes every deferred row on `client`, and forgets them; stops at the first failure.
    pub(super) async fn write(&self, client: &Client) -> Result<(), Error> {
        for rows in self.0.take() {
            rows.write(client).await?;
        }
        Ok(())
    }
}
