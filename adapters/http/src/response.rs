//! Stored responses: what a completed key answers again, and where it is kept.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE, HeaderName};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use oncely::{BusinessKey, ConfigError, Envelope, StoreError};

use crate::key::REPLAYED;

/// The response a key's first request got, as stored to answer its retries: the status,
/// the headers the route names ([`IdempotencyLayer::with_stored_headers`](crate::IdempotencyLayer::with_stored_headers))
/// and the body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status.
    pub status: StatusCode,
    /// The stored headers, in the order the handler set them.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body.
    pub body: Bytes,
}

impl StoredResponse {
    /// The part of a response that is stored: `status`, its `Content-Type` and
    /// `Content-Encoding` (the body means nothing without them) and those of `headers` named
    /// in `stored`, and `body`.
    pub(crate) fn keep(status: StatusCode, headers: &HeaderMap, stored: &[HeaderName], body: Bytes) -> Self {
        let always = [CONTENT_TYPE, CONTENT_ENCODING];
        let named = stored.iter().filter(|name| !always.contains(name));
        let headers = always
            .iter()
            .chain(named)
            .flat_map(|name| {
                headers
                    .get_all(name)
                    .iter()
                    .map(|value| (name.clone(), value.clone()))
            })
            .collect();
        StoredResponse {
            status,
            headers,
            body,
        }
    }

    /// The headers as stored in a database: one `name: value\r\n` line each. Header values
    /// can hold neither CR nor LF, and names no colon, so the lines read back unambiguously.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut lines = Vec::new();
        for (name, value) in &self.headers {
            lines.extend_from_slice(name.as_str().as_bytes());
            lines.extend_from_slice(b": ");
            lines.extend_from_slice(value.as_bytes());
            lines.extend_from_slice(b"\r\n");
        }
        lines
    }

    /// A stored response read back: `status`, headers as [`encode_headers`](StoredResponse::encode_headers)
    /// wrote them, and `body`. [`StoreError`] when they are not what oncely wrote.
    pub fn decode(status: i32, headers: &[u8], body: Bytes) -> Result<Self, StoreError> {
        let status = u16::try_from(status)
            .ok()
            .and_then(|status| StatusCode::from_u16(status).ok())
            .ok_or_else(|| StoreError::malformed(format!("stored status {status}")))?;
        let mut decoded = Vec::new();
        for line in headers.split(|&byte| byte == b'\n') {
            let Some(line) = line.strip_suffix(b"\r") else {
                continue;
            };
            let separator = line.windows(2).position(|pair| pair == b": ");
            let header = separator.and_then(|at| {
                let name = HeaderName::from_bytes(&line[..at]).ok()?;
                Some((name, HeaderValue::from_bytes(&line[at + 2..]).ok()?))
            });
            decoded.push(header.ok_or_else(|| StoreError::malformed("a stored header line"))?);
        }
        Ok(StoredResponse {
            status,
            headers: decoded,
            body,
        })
    }

    /// The stored response as answered again, marked with `Idempotent-Replayed: true`.
    pub(crate) fn replay(self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(self.body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

/// Why a response was not stored; either way nothing is committed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SaveFailure {
    /// The record's transaction was already aborted by a statement of the handler that
    /// failed, and that the handler ignored before it answered: the handler's failure, which
    /// the client is answered as such ([`Problem::HandlerFailed`](crate::Problem::HandlerFailed)).
    /// For stores that write as they save; the bundled ones do not return it (PostgreSQL's
    /// writes at the commit, which tells the same failure apart itself).
    #[error("a statement of the handler failed and aborted its transaction: {0}")]
    HandlerAborted(StoreError),
    /// The store failed or could not be reached
    /// ([`Problem::StoreUnavailable`](crate::Problem::StoreUnavailable)).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The route is configured so that no response can be stored: the tiers lend no
    /// record transaction, or the table was never migrated. Logged at error level; the
    /// client is answered [`Problem::Misconfigured`](crate::Problem::Misconfigured).
    #[error(transparent)]
    Misconfigured(#[from] ConfigError),
}

/// Where a route keeps its stored responses.
///
/// A store whose writes belong in the record tier's transaction (PostgreSQL's
/// [`PgResponses`](crate::PgResponses)) finds that transaction in the envelope's extensions,
/// and [`lend`](ResponseStore::lend)s it to the handler, so that the business write, the
/// stored response and the record commit together or not at all.
pub trait ResponseStore: Clone + Send + Sync + 'static {
    /// Checks, before the handler runs, that a response to `envelope` can be stored: that
    /// the stack lends what [`save`](ResponseStore::save) needs (the record's transaction)
    /// and that the store's table exists. [`SaveFailure::Misconfigured`] keeps the handler
    /// from running at all — a handler whose response could not be stored would roll back
    /// and run again on every retry. Stores that need nothing answer `Ok` (the default).
    fn ready(&self, envelope: &Envelope) -> impl Future<Output = Result<(), SaveFailure>> + Send {
        let _ = envelope;
        std::future::ready(Ok(()))
    }

    /// Puts what the handler needs from the stack into the request's extensions (the
    /// record's open transaction), before the handler runs.
    fn lend(&self, envelope: &Envelope, extensions: &mut http::Extensions);

    /// Stops what the handler still runs in the stack's transaction, after the layer's
    /// timeout cut the handler off (PostgreSQL: cancels its statement), so that the rollback
    /// does not wait behind it.
    fn interrupt(&self, envelope: &Envelope) -> impl Future<Output = ()> + Send;

    /// Stores `response` as the answer to `envelope`'s key, kept for `expiry` — or hands it
    /// to the record's transaction, to be written as that commits (PostgreSQL's
    /// [`PgResponses`](crate::PgResponses)): either way it exists exactly when the key's
    /// record committed.
    fn save(
        &self,
        envelope: &Envelope,
        response: &StoredResponse,
        expiry: Duration,
    ) -> impl Future<Output = Result<(), SaveFailure>> + Send;

    /// The stored answer to `key`, if it is still kept.
    fn load(
        &self,
        key: &BusinessKey,
    ) -> impl Future<Output = Result<Option<StoredResponse>, StoreError>> + Send;
}

#[cfg(test)]
mod tests {
    use http::header::LOCATION;

    use super::*;

    #[test]
    fn stored_headers_read_back_as_written() {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.append(LOCATION, HeaderValue::from_static("/orders/1"));
        headers.insert("x-not-stored", HeaderValue::from_static("secret"));
        let stored = StoredResponse::keep(
            StatusCode::CREATED,
            &headers,
            &[CONTENT_TYPE, LOCATION],
            Bytes::from_static(b"{}"),
        );
        assert_eq!(stored.headers.len(), 2);
        let read = StoredResponse::decode(201, &stored.encode_headers(), stored.body.clone()).unwrap();
        assert_eq!(read, stored);
        assert!(StoredResponse::decode(1000, b"", Bytes::new()).is_err());
        assert!(StoredResponse::decode(200, b"no separator\r\n", Bytes::new()).is_err());
    }
}
