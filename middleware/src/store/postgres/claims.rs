//! Every statement on the consumption record table, rendered once per table: the record
//! tier's claims (both modes), settling, the reconciler's and the pre-filter rebuild's
//! reads. Whoever changes the table's meaning changes it here.

use std::sync::Arc;
use std::time::SystemTime;

use deadpool_postgres::tokio_postgres::Row;

use super::{Table, responses_table};
use crate::envelope::BusinessKey;
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::record::{Begin, ConsumptionRecord, RecordStatus};
pub(crate) use crate::store::sql::{ClaimRequest, to_i64};
use crate::store::sql::{FoundRecord, parse_fingerprint, parse_status, refused_claim};

/// The SQL text of every statement, with the table name filled in.
#[derive(Debug)]
pub(crate) struct Statements {
    /// Claims a batch of keys: inserts new rows, takes over `FAILURE` rows and `PROCESSING`
    /// rows past their lease when the fingerprint matches and the fencing token is not older.
    /// `$1` keys, `$2` fingerprints, `$3` fencing tokens, `$4` lease in ms (NULL: no lease),
    /// `$5` the status to claim with. Returns the claimed keys with their retry counts.
    pub(crate) claim: String,
    /// Reads what stopped a claim: status, fingerprint, lease running, fencing token.
    inspect: String,
    /// Settles a three-step attempt: `$1` key, `$2` retry count, `$3` status, `$4` error.
    pub(crate) settle: String,
    /// Notes a rolled-back transactional attempt: a `FAILURE` row with the error text and one
    /// more retry; never touches a row in another status or with another fingerprint.
    pub(crate) note_failure: String,
    /// One key's record.
    pub(crate) get: String,
    /// The reconciler's batch of `PROCESSING` rows past their lease, oldest lease first.
    pub(crate) stuck: String,
    /// The reconciler's verdict on one stuck row, only if it is still that stuck attempt.
    pub(crate) reconcile: String,
    /// Takes back the batch's claims of the keys `$1` (their deliveries went away before
    /// their handlers ran), with the note `$2` on the keys it took over.
    pub(crate) withdraw: String,
    /// Deletes up to `$2` `SUCCESS` rows not updated for `$1` ms.
    pub(crate) purge: String,
    /// The same where stored responses live beside the table (`responses` names their
    /// table, `statement` deletes): only rows whose response expired (or that have none),
    /// each with its response, in one statement that answers how many record rows went.
    pub(crate) purge_answered: Option<AnsweredPurge>,
    /// A page of `SUCCESS` keys settled within `$1` seconds, after id `$2`, `$3` rows.
    #[cfg(feature = "prefilter")]
    pub(crate) recent_successes: String,
}

/// The retention's purge where stored responses may live beside the record table.
#[derive(Debug)]
pub(crate) struct AnsweredPurge {
    /// Their table, which the purge uses only when it exists.
    pub(crate) responses: Table,
    pub(crate) statement: String,
}

impl Statements {
    pub(crate) fn new(table: &Table) -> Arc<Self> {
        // A fingerprint of a route whose check is off matches any other (`Fingerprint::matches`).
        let same_payload = format!(
            "(r.payload_fingerprint = EXCLUDED.payload_fingerprint
              OR '{unchecked}' IN (r.payload_fingerprint, EXCLUDED.payload_fingerprint))",
            unchecked = Fingerprint::UNCHECKED
        );
        Arc::new(Statements {
            claim: format!(
                "INSERT INTO {table} AS r (message_key, status, payload_fingerprint, fencing_token, lease_until)
                 SELECT k, $5, f, t, now() + l * interval '1 millisecond'
                 FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS b(k, f, t, l)
                 ON CONFLICT (message_key) DO UPDATE
                 SET status = EXCLUDED.status, retry_count = r.retry_count + 1,
                     fencing_token = COALESCE(EXCLUDED.fencing_token, r.fencing_token),
                     lease_until = EXCLUDED.lease_until, updated_at = now()
                 WHERE {same_payload}
                   AND (r.status = 'FAILURE' OR (r.status = 'PROCESSING' AND r.lease_until < now()))
                   AND (r.fencing_token IS NULL OR EXCLUDED.fencing_token IS NULL
                        OR EXCLUDED.fencing_token >= r.fencing_token)
                 RETURNING message_key, retry_count, txid_current()"
            ),
            inspect: format!(
                "SELECT message_key, status, payload_fingerprint, COALESCE(lease_until > now(), false), fencing_token
                 FROM {table} WHERE message_key = ANY($1)"
            ),
            settle: format!(
                "UPDATE {table} SET status = $3, error_details = COALESCE($4, error_details),
                        lease_until = NULL, updated_at = now()
                 WHERE message_key = $1 AND status = 'PROCESSING' AND retry_count = $2"
            ),
            note_failure: format!(
                "INSERT INTO {table} AS r (message_key, status, payload_fingerprint, fencing_token, error_details)
                 VALUES ($1, 'FAILURE', $2, $3, $4)
                 ON CONFLICT (message_key) DO UPDATE
                 SET retry_count = r.retry_count + 1, error_details = EXCLUDED.error_details, updated_at = now()
                 WHERE r.status = 'FAILURE' AND {same_payload}"
            ),
            get: format!(
                "SELECT message_key, status, retry_count, error_details, payload_fingerprint,
                        created_at, updated_at, fencing_token
                 FROM {table} WHERE message_key = $1"
            ),
            stuck: format!(
                "SELECT message_key, retry_count FROM {table} WHERE status = 'PROCESSING' AND lease_until < now()
                 ORDER BY lease_until LIMIT $1"
            ),
            reconcile: format!(
                "UPDATE {table} SET status = $3, error_details = $4, lease_until = NULL, updated_at = now()
                 WHERE message_key = $1 AND retry_count = $2 AND status = 'PROCESSING' AND lease_until < now()"
            ),
            // A key first claimed by this batch goes as if never claimed; a key it took over
            // is left as a failed attempt leaves it.
            withdraw: format!(
                "WITH fresh AS (DELETE FROM {table} WHERE message_key = ANY($1::text[])
                                  AND status = 'SUCCESS' AND retry_count = 0 RETURNING message_key)
                 UPDATE {table} SET status = 'FAILURE', lease_until = NULL, updated_at = now(), error_details = $2
                 WHERE message_key = ANY($1::text[]) AND status = 'SUCCESS'
                   AND message_key NOT IN (SELECT message_key FROM fresh)"
            ),
            purge: format!(
                "DELETE FROM {table} WHERE id IN (
                     SELECT id FROM {table} WHERE status = 'SUCCESS'
                       AND updated_at < now() - $1::bigint * interval '1 millisecond' LIMIT $2)"
            ),
            purge_answered: responses_table(table).ok().map(|responses| AnsweredPurge {
                statement: format!(
                    "WITH picked AS (
                         SELECT r.id FROM {table} r WHERE r.status = 'SUCCESS'
                           AND r.updated_at < now() - $1::bigint * interval '1 millisecond'
                           AND NOT EXISTS (SELECT 1 FROM {responses} s
                                           WHERE s.message_key = r.message_key AND s.expires_at > now())
                         LIMIT $2),
                     gone AS (DELETE FROM {table} WHERE id IN (SELECT id FROM picked) RETURNING message_key),
                     answers AS (DELETE FROM {responses} WHERE message_key IN (SELECT message_key FROM gone))
                     SELECT count(*) FROM gone"
                ),
                responses,
            }),
            #[cfg(feature = "prefilter")]
            recent_successes: format!(
                "SELECT id, message_key FROM {table}
                 WHERE status = 'SUCCESS' AND updated_at > now() - make_interval(secs => $1) AND id > $2
                 ORDER BY id LIMIT $3"
            ),
        })
    }
}

/// The answers of a [`claim_batch`], in the order of its requests, and the id of the
/// transaction that claimed (`txid_current()`), if any key was claimed.
pub(crate) struct Claimed {
    pub(crate) answers: Vec<Begin>,
    pub(crate) transaction_id: Option<i64>,
}

/// Claims `requests` (distinct keys) with one statement, plus one more to inspect the keys
/// it could not claim.
pub(crate) async fn claim_batch(
    client: &impl deadpool_postgres::GenericClient,
    statements: &Statements,
    requests: &[ClaimRequest],
    status: RecordStatus,
) -> Result<Claimed, StoreError> {
    let keys: Vec<&str> = requests.iter().map(|request| request.key.as_str()).collect();
    let fingerprints: Vec<String> = requests
        .iter()
        .map(|request| request.fingerprint.to_string())
        .collect();
    let fences: Vec<Option<i64>> = requests
        .iter()
        .map(|request| request.fencing_token.map(to_i64))
        .collect();
    let leases: Vec<Option<i64>> = requests
        .iter()
        .map(|request| request.lease.map(|lease| to_i64(lease.as_millis() as u64)))
        .collect();
    let claim = client.prepare_cached(&statements.claim).await?;
    let claimed = client
        .query(
            &claim,
            &[&keys, &fingerprints, &fences, &leases, &status.as_str()],
        )
        .await?;
    let mut answers: Vec<Option<Begin>> = vec![None; requests.len()];
    let transaction_id = claimed.first().map(|row| row.get::<_, i64>(2));
    for row in &claimed {
        let key: &str = row.get(0);
        let retry_count: i32 = row.get(1);
        if let Some(index) = keys.iter().position(|k| *k == key) {
            answers[index] = Some(Begin::Started {
                attempt: u32::try_from(retry_count).unwrap_or(0) + 1,
            });
        }
    }
    let unclaimed: Vec<&str> = keys
        .iter()
        .zip(&answers)
        .filter(|(_, answer)| answer.is_none())
        .map(|(key, _)| *key)
        .collect();
    if !unclaimed.is_empty() {
        let inspect = client.prepare_cached(&statements.inspect).await?;
        for row in client.query(&inspect, &[&unclaimed]).await? {
            let key: &str = row.get(0);
            if let Some(index) = keys.iter().position(|k| *k == key) {
                answers[index] = Some(classify(&row, &requests[index])?);
            }
        }
    }
    // A key with neither a claim nor a row was deleted in between (a purge): try again later.
    let answers = answers
        .into_iter()
        .map(|answer| answer.unwrap_or(Begin::InProgress))
        .collect();
    Ok(Claimed {
        answers,
        transaction_id,
    })
}

/// Why a claim did not take the row (a row it could take over again was changed between
/// the claim and this read: the retry sees where it stands).
fn classify(row: &Row, request: &ClaimRequest) -> Result<Begin, StoreError> {
    let found = FoundRecord {
        status: parse_status(row.get(1))?,
        fingerprint: parse_fingerprint(row.get(2))?,
        leased: row.get(3),
        fencing_token: row.get(4),
    };
    Ok(refused_claim(&found, request.fingerprint, request.fencing_token).unwrap_or(Begin::InProgress))
}

pub(crate) fn read_record(row: &Row) -> Result<ConsumptionRecord, StoreError> {
    let retry_count: i32 = row.get(2);
    let created_at: SystemTime = row.get(5);
    let updated_at: SystemTime = row.get(6);
    let fencing_token: Option<i64> = row.get(7);
    Ok(ConsumptionRecord {
        key: BusinessKey::new(row.get::<_, &str>(0)),
        status: parse_status(row.get(1))?,
        attempts: u32::try_from(retry_count).unwrap_or(0) + 1,
        last_error: row.get(3),
        fingerprint: parse_fingerprint(row.get(4))?,
        created_at,
        updated_at,
        fencing_token: fencing_token.and_then(|token| u64::try_from(token).ok()),
    })
}
