//! The retention service's lease and batches on PostgreSQL: a session advisory lock per
//! record table, held by the connection that purges.

use std::time::Duration;

use super::PgRecordStore;
use crate::error::StoreError;
use crate::record::{RetentionRunner, RetentionStore};
use crate::store::postgres::Checkout;
use crate::store::postgres::claims::to_i64;

/// Holds the table's purge lease on its connection until it steps down.
pub struct PgRetentionRunner {
    checkout: Checkout,
    purge: Purge,
    lease: String,
}

/// How a pass deletes, decided when it takes the lease.
enum Purge {
    /// Old `SUCCESS` rows.
    Records(String),
    /// Old `SUCCESS` rows whose stored response expired, with it (a count comes back).
    Answered(String),
}

impl RetentionStore for PgRecordStore {
    type Runner = PgRetentionRunner;

    async fn lead(&self) -> Result<Option<PgRetentionRunner>, StoreError> {
        let checkout = Checkout::get(&self.pool).await?;
        // A session lock, not a transaction's: it must span the pass's many short
        // transactions, one per batch. Keyed by the table, so routes on other tables purge
        // side by side.
        let lease = format!("oncely.retention:{}", self.table);
        let row = checkout
            .client()
            .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&lease])
            .await?;
        let held: bool = row.get(0);
        if !held {
            checkout.mark_clean();
            return Ok(None);
        }
        // Stored responses beside the table (oncely-http's): a record row goes only with
        // its response, once that expired, or the key would run again while its first
        // answer can still be replayed.
        let purge = match &self.statements.purge_answered {
            Some(answered) => {
                let exists = "SELECT to_regclass($1) IS NOT NULL";
                let row = checkout
                    .client()
                    .query_one(exists, &[&answered.responses.to_string()])
                    .await?;
                match row.get(0) {
                    true => Purge::Answered(answered.statement.clone()),
                    false => Purge::Records(self.statements.purge.clone()),
                }
            }
            None => Purge::Records(self.statements.purge.clone()),
        };
        Ok(Some(PgRetentionRunner {
            checkout,
            purge,
            lease,
        }))
    }

    fn name(&self) -> String {
        self.table.to_string()
    }
}

/// Each batch is one autocommit `DELETE`. The checkout stays unclean while the lease is
/// held: dropped mid-pass, its connection is closed rather than pooled, and the server lets
/// the lock go with the session.
impl RetentionRunner for PgRetentionRunner {
    async fn purge_batch(&mut self, age: Duration, rows: u32) -> Result<u64, StoreError> {
        // Saturating: an age past what PostgreSQL's intervals hold fails the pass, never
        // wraps around to a small one.
        let age_ms = to_i64(u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        let client = self.checkout.client();
        let rows = i64::from(rows);
        match &self.purge {
            Purge::Records(purge) => Ok(client.execute(purge, &[&age_ms, &rows]).await?),
            Purge::Answered(purge) => {
                let purged: i64 = client.query_one(purge, &[&age_ms, &rows]).await?.get(0);
                Ok(u64::try_from(purged).unwrap_or(0))
            }
        }
    }

    async fn step_down(self) -> Result<(), StoreError> {
        let client = self.checkout.client();
        client
            .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&self.lease])
            .await?;
        self.checkout.mark_clean();
        Ok(())
    }
}

impl std::fmt::Debug for PgRetentionRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgRetentionRunner")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}
