//! The errors a client can be answered with, as problem details (RFC 9457).

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

/// Where the problem types are documented: this enum's page, one anchor per variant.
const TYPE_BASE: &str = "https://docs.rs/oncely-http/latest/oncely_http/enum.Problem.html#variant.";

/// An answer other than the handler's own response, sent as `application/problem+json`
/// (RFC 9457) with `type`, `title`, `status` and `detail`. The `type` is this page's anchor of
/// the variant, e.g. `…/enum.Problem.html#variant.KeyReused`.
///
/// | variant | status | the client should |
/// |---|---|---|
/// | [`KeyMissing`](Problem::KeyMissing), [`KeyMalformed`](Problem::KeyMalformed), [`BodyUnreadable`](Problem::BodyUnreadable), [`BodyInvalid`](Problem::BodyInvalid) | 400 | fix the request |
/// | [`ClientUnidentified`](Problem::ClientUnidentified) | 401 | authenticate |
/// | [`KeyInFlight`](Problem::KeyInFlight) | 409, `Retry-After` | retry later with the same key |
/// | [`Stale`](Problem::Stale) | 409 | not retry: the entity moved past what the request asks |
/// | [`ResponseGone`](Problem::ResponseGone) | 410 | not retry: the operation was done |
/// | [`TokenExpired`](Problem::TokenExpired) | 410 | fetch a new token |
/// | [`BodyTooLarge`](Problem::BodyTooLarge) | 413 | send less |
/// | [`KeyReused`](Problem::KeyReused) | 422 | use a new key for a new payload |
/// | [`TokenMissing`](Problem::TokenMissing), [`TokenUnknown`](Problem::TokenUnknown) | 400 | fetch a token |
/// | [`HandlerFailed`](Problem::HandlerFailed), [`ResponseTooLarge`](Problem::ResponseTooLarge) | 500 | retry with the same key: nothing was committed |
/// | [`Misconfigured`](Problem::Misconfigured) | 500 | retry later with the same key: nothing ran |
/// | [`StoreUnavailable`](Problem::StoreUnavailable) | 503, `Retry-After` | retry later with the same key (whether it ran is then known) |
///
/// Details never carry a store's or handler's error text (that is logged): they say what
/// happened to the request, not how the server is built.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// The route requires an `Idempotency-Key` and the request has none.
    KeyMissing,
    /// The `Idempotency-Key` is not one valid key: two headers, a list, bad characters, empty
    /// or too long.
    KeyMalformed {
        /// What is wrong with it.
        reason: String,
    },
    /// The route scopes keys by client and could not tell who sent the request.
    ClientUnidentified,
    /// The key's first request is still being processed (draft-07's 409).
    KeyInFlight {
        /// When to try again.
        retry_after: Duration,
    },
    /// The key was used before with another payload: another method, path or body
    /// (draft-07's 422).
    KeyReused,
    /// The key's request was processed, but its response is no longer stored (it expired,
    /// or was purged); the operation is not run again.
    ResponseGone,
    /// The request asks for a state its entity has already moved past.
    Stale {
        /// What the entity's state is.
        current: Option<String>,
        /// What the request asked for.
        target: String,
    },
    /// The request body could not be read (the client went away, a broken encoding).
    BodyUnreadable,
    /// The body lacks what the route fingerprints: not JSON, where the route fingerprints
    /// JSON fields.
    BodyInvalid {
        /// What is wrong with it.
        reason: String,
    },
    /// The request body is larger than the route accepts; it was not read further.
    BodyTooLarge {
        /// The largest body accepted, in bytes.
        max: usize,
    },
    /// The route takes a one-time token and the request carries none.
    TokenMissing,
    /// The token was never issued, or was issued to another client.
    TokenUnknown,
    /// The token expired before it was used.
    TokenExpired,
    /// The handler failed, panicked, timed out, or its transaction did not commit: nothing
    /// was committed, and a retry with the same key runs it again.
    HandlerFailed,
    /// The handler's response is larger than the route stores; its work was rolled back.
    ResponseTooLarge {
        /// The largest stored response body, in bytes.
        max: usize,
    },
    /// The endpoint is configured so that it cannot keep its promise (a stack without the
    /// transactional record, a table never migrated): nothing ran, and nothing will until
    /// the server is fixed. The cause is logged at error level.
    Misconfigured,
    /// A store that must decide is unreachable. Usually nothing ran; when the store went
    /// away during the commit, nobody knows yet: the same key's retry is answered by the
    /// record either way.
    StoreUnavailable {
        /// When to try again.
        retry_after: Duration,
    },
}

impl Problem {
    pub(crate) fn key_malformed(reason: impl Into<String>) -> Self {
        Problem::KeyMalformed {
            reason: reason.into(),
        }
    }

    /// The HTTP status the problem is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Problem::KeyMissing
            | Problem::KeyMalformed { .. }
            | Problem::BodyUnreadable
            | Problem::BodyInvalid { .. }
            | Problem::TokenMissing
            | Problem::TokenUnknown => StatusCode::BAD_REQUEST,
            Problem::ClientUnidentified => StatusCode::UNAUTHORIZED,
            Problem::KeyInFlight { .. } | Problem::Stale { .. } => StatusCode::CONFLICT,
            Problem::ResponseGone | Problem::TokenExpired => StatusCode::GONE,
            Problem::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::HandlerFailed | Problem::ResponseTooLarge { .. } | Problem::Misconfigured => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Problem::StoreUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The variant's name: the anchor of its `type` URI.
    fn name(&self) -> &'static str {
        match self {
            Problem::KeyMissing => "KeyMissing",
            Problem::KeyMalformed { .. } => "KeyMalformed",
            Problem::ClientUnidentified => "ClientUnidentified",
            Problem::KeyInFlight { .. } => "KeyInFlight",
            Problem::KeyReused => "KeyReused",
            Problem::ResponseGone => "ResponseGone",
            Problem::Stale { .. } => "Stale",
            Problem::BodyUnreadable => "BodyUnreadable",
            Problem::BodyInvalid { .. } => "BodyInvalid",
            Problem::BodyTooLarge { .. } => "BodyTooLarge",
            Problem::TokenMissing => "TokenMissing",
            Problem::TokenUnknown => "TokenUnknown",
            Problem::TokenExpired => "TokenExpired",
            Problem::HandlerFailed => "HandlerFailed",
            Problem::ResponseTooLarge { .. } => "ResponseTooLarge",
            Problem::Misconfigured => "Misconfigured",
            Problem::StoreUnavailable { .. } => "StoreUnavailable",
        }
    }

    /// What happened, for the client.
    pub fn detail(&self) -> String {
        match self {
            Problem::KeyMissing => "this endpoint requires an Idempotency-Key header".to_owned(),
            Problem::KeyMalformed { reason } => format!("the Idempotency-Key is not valid: {reason}"),
            Problem::ClientUnidentified => "the request does not say which client sent it".to_owned(),
            Problem::KeyInFlight { .. } => {
                "a request with this key is being processed; retry later with the same key".to_owned()
            }
            Problem::KeyReused => {
                "this key was used with another request (method, path, query or body); use a new key"
                    .to_owned()
            }
            Problem::ResponseGone => {
                "the request with this key was processed; its response is no longer stored".to_owned()
            }
            Problem::Stale { current, target } => format!(
                "{target} cannot be reached from {}",
                current.as_deref().unwrap_or("no state")
            ),
            Problem::BodyUnreadable => "the request body could not be read".to_owned(),
            Problem::BodyInvalid { reason } => format!("the request body cannot be checked: {reason}"),
            Problem::BodyTooLarge { max } => format!("the body is larger than {max} bytes"),
            Problem::TokenMissing => "this endpoint requires a one-time token".to_owned(),
            Problem::TokenUnknown => "the token was not issued to this client".to_owned(),
            Problem::TokenExpired => "the token expired; fetch a new one".to_owned(),
            Problem::HandlerFailed => {
                "the request failed and nothing was committed; retry with the same key".to_owned()
            }
            Problem::ResponseTooLarge { max } => format!(
                "the response is larger than the {max} bytes this endpoint stores; nothing was committed"
            ),
            Problem::Misconfigured => {
                "this endpoint is misconfigured; nothing ran, and nothing will until it is fixed".to_owned()
            }
            Problem::StoreUnavailable { .. } => {
                "a store is unavailable; retry later with the same key, which tells whether it ran".to_owned()
            }
        }
    }

    /// The problem as a response: `application/problem+json`, with `Retry-After` (whole
    /// seconds, at least 1) when the client should come back.
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        let status = self.status();
        let document = serde_json::json!({
            "type": format!("{TYPE_BASE}{}", self.name()),
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": self.detail(),
        });
        let mut response = Response::new(Full::new(Bytes::from(document.to_string())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Problem::KeyInFlight { retry_after } | Problem::StoreUnavailable { retry_after } = self {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after.as_secs().max(1)));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn problems_are_problem_json_with_their_type() {
        let problem = Problem::StoreUnavailable {
            retry_after: Duration::from_millis(300),
        };
        let response = problem.to_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let document: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(document["status"], 503);
        assert!(
            document["type"]
                .as_str()
                .unwrap()
                .ends_with("#variant.StoreUnavailable")
        );
        assert_eq!(Problem::KeyReused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    }
}
