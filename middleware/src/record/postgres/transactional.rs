//! The transactional mode: the record and the handler's writes commit together.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use deadpool_postgres::{Object, Pool};
use tower_layer::Layer;
use tower_service::Service;

use super::sql::{ClaimRequest, Statements, claim_batch, record_error, to_i64};
use crate::envelope::Envelope;
use crate::lock::LockLease;
use crate::outcome::{DeadLetterReason, Outcome, RetryReason, Tier};
use crate::postgres::Table;
use crate::record::store::{Begin, RecordStatus};
use crate::service::{BoxFuture, take_ready};

/// The open transaction of the delivery being handled, as the handler finds it in the
/// envelope's [extensions](crate::Envelope::extensions).
///
/// Write the business effect through [`client`](PgTransaction::client): it runs inside the
/// transaction that also holds the key's record, and commits only if the stack answers
/// processed. Do not `COMMIT` or `ROLLBACK` it yourself, and do not keep it after the
/// handler returns.
///
/// ```no_run
/// # use oncely::{Envelope, HandlerError};
/// use oncely::record::PgTransaction;
///
/// async fn deduct_stock(envelope: Envelope) -> Result<(), HandlerError> {
///     let tx = envelope.extensions().get::<PgTransaction>().expect("PgTransactionalLayer in front");
///     tx.client()
///         .execute("UPDATE stock SET quantity = quantity - 1 WHERE sku = $1", &[&"sku-1"])
///         .await?;
///     Ok(())
/// }
/// ```
#[derive(Clone)]
pub struct PgTransaction(Arc<Object>);

impl PgTransaction {
    /// The connection, inside the open transaction.
    pub fn client(&self) -> &deadpool_postgres::Client {
        &self.0
    }
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PgTransaction")
    }
}

/// The record tier in transactional mode.
///
/// Per envelope: take a pooled connection, `BEGIN`, claim the key's row as `SUCCESS`
/// (insert, or take over a `FAILURE` row), hand the transaction to the tiers behind as a
/// [`PgTransaction`], then `COMMIT` if they answer processed, duplicate or stale, and
/// `ROLLBACK` otherwise. Commit happens before the adapter acks.
///
/// | the key's row | outcome |
/// |---|---|
/// | none, or `FAILURE` | claimed in the transaction: the tiers behind run |
/// | `SUCCESS` | [`Duplicate`](crate::Outcome::Duplicate) from [`Tier::Record`](crate::Tier::Record) |
/// | another payload's fingerprint | [`DeadLetter`](crate::Outcome::DeadLetter) (`payload_mismatch`) |
/// | being claimed by another open transaction | waits for it (the unique index), then as above |
///
/// Any failure — the handler's, a lost connection, a failed commit — rolls back the record
/// and the business writes together and answers [`RetryLater`](crate::Outcome::RetryLater);
/// the failure is then noted on the row as `FAILURE` with its text and a retry count, in a
/// separate statement. A commit whose answer is lost may have committed: the redelivery then
/// finds `SUCCESS` and is a duplicate, so nothing is applied twice either way.
#[derive(Clone)]
pub struct PgTransactionalLayer {
    pool: Pool,
    table: Table,
    statements: Arc<Statements>,
}

impl PgTransactionalLayer {
    /// A transactional record tier on `pool` using the record table `table`.
    pub fn new(pool: Pool, table: Table) -> Self {
        PgTransactionalLayer {
            statements: Statements::new(&table),
            pool,
            table,
        }
    }
}

impl fmt::Debug for PgTransactionalLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionalLayer")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for PgTransactionalLayer {
    type Service = crate::telemetry::Measured<PgTransactionalService<crate::telemetry::Passed<S>>>;

    fn layer(&self, inner: S) -> Self::Service {
        crate::telemetry::measured(crate::outcome::Tier::Record, inner, |inner| {
            PgTransactionalService {
                inner,
                config: self.clone(),
            }
        })
    }
}

/// The service made by [`PgTransactionalLayer`].
#[derive(Clone, Debug)]
pub struct PgTransactionalService<S> {
    inner: S,
    config: PgTransactionalLayer,
}

fn unavailable(error: impl fmt::Display) -> Outcome {
    Outcome::retry_later(
        RetryReason::StoreUnavailable(Tier::Record),
        error.to_string(),
        None,
    )
}

impl<S> Service<Envelope> for PgTransactionalService<S>
where
    S: Service<Envelope, Response = Outcome> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: fmt::Display + Send + 'static,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut envelope: Envelope) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        let config = self.config.clone();
        Box::pin(async move {
            let client = match config.pool.get().await {
                Ok(client) => Arc::new(client),
                Err(error) => return Ok(unavailable(error)),
            };
            let request = ClaimRequest {
                key: envelope.key().clone(),
                fingerprint: envelope.fingerprint(),
                fencing_token: envelope
                    .extensions()
                    .get::<LockLease>()
                    .map(LockLease::fencing_token),
                lease: None,
            };
            if let Err(error) = client.batch_execute("BEGIN").await {
                discard(client);
                return Ok(unavailable(error));
            }
            let claim = claim_batch(
                &*client,
                &config.statements,
                std::slice::from_ref(&request),
                RecordStatus::Success,
            )
            .await
            .map(|mut answers| answers.remove(0));
            let stop = match claim {
                Ok(Begin::Started { .. }) => None,
                Ok(Begin::Done) => Some(Outcome::Duplicate { tier: Tier::Record }),
                Ok(Begin::Conflict { recorded }) => Some(Outcome::dead_letter(
                    DeadLetterReason::PayloadMismatch,
                    format!(
                        "key {} was recorded with payload {recorded}, this one is {}",
                        request.key, request.fingerprint
                    ),
                )),
                Ok(Begin::Fenced) => Some(Outcome::retry_later(
                    RetryReason::LeaseLost,
                    format!(
                        "key {} was written under a newer lock than this delivery's",
                        request.key
                    ),
                    None,
                )),
                Ok(Begin::InProgress) => Some(Outcome::retry_later(
                    RetryReason::InFlight(Tier::Record),
                    format!("key {} is PROCESSING", request.key),
                    None,
                )),
                Err(error) => Some(unavailable(error)),
            };
            if let Some(outcome) = stop {
                finish(client, "ROLLBACK").await;
                return Ok(outcome);
            }

            envelope.extensions_mut().insert(PgTransaction(client.clone()));
            let answer = inner.call(envelope).await;
            let failure = match &answer {
                Ok(outcome) if outcome.is_settled() => None,
                Ok(outcome) => Some(outcome.to_string()),
                Err(error) => Some(error.to_string()),
            };
            match failure {
                None => {
                    if let Err(error) = client.batch_execute("COMMIT").await {
                        discard(client);
                        return Ok(unavailable(format!("commit failed: {error}")));
                    }
                    // Dropping the last handle returns the connection to the pool.
                    drop(client);
                }
                Some(failure) => {
                    finish(client, "ROLLBACK").await;
                    note_failure(&config, &request, &failure).await;
                }
            }
            answer
        })
    }
}

/// Ends the transaction; a connection that cannot is not returned to the pool.
async fn finish(client: Arc<Object>, statement: &str) {
    match client.batch_execute(statement).await {
        Ok(()) => drop(client),
        Err(error) => {
            tracing::warn!(%error, statement, "could not end the record transaction; dropping the connection");
            discard(client);
        }
    }
}

/// Drops the connection instead of returning it to the pool: its transaction state is
/// unknown, and the next delivery must not inherit it.
fn discard(client: Arc<Object>) {
    if let Ok(object) = Arc::try_unwrap(client) {
        drop(Object::take(object));
    }
}

/// Records a failed attempt after the rollback, outside the transaction: best effort, for
/// operators; the outcome does not depend on it.
async fn note_failure(config: &PgTransactionalLayer, request: &ClaimRequest, error: &str) {
    let noted = async {
        let client = config.pool.get().await.map_err(record_error)?;
        let fence = request.fencing_token.map(to_i64);
        let fingerprint = request.fingerprint.to_string();
        client
            .execute(
                &config.statements.note_failure,
                &[&request.key.as_str(), &fingerprint, &fence, &error],
            )
            .await
            .map_err(record_error)
    };
    if let Err(failure) = noted.await {
        tracing::warn!(key = %request.key, %failure, "could not note the failed attempt");
    }
}
