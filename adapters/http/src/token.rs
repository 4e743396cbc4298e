//! One-time tokens for form submissions: issued to a client, let through once.

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use oncely::{BoxFuture, StoreError};
use tower_service::Service;

use crate::client::ClientScope;
use crate::problem::Problem;

/// The header a one-time token is read from unless configured otherwise.
pub const TOKEN_HEADER: HeaderName = HeaderName::from_static("oncely-token");

/// What a [`TokenBook`] knows of a token presented by a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenCheck {
    /// Issued to this client and not expired: its submit may run (once).
    Valid,
    /// Issued to this client, expired: a submit that already ran is answered again, a new
    /// one is refused ([`Problem::TokenExpired`]).
    Expired,
    /// Never issued, or issued to another client: refused alike
    /// ([`Problem::TokenUnknown`]), so that a client learns nothing of others' tokens.
    Unknown,
}

impl TokenCheck {
    /// What a book answers for a token it found: issued to the client presenting it
    /// (`own`), not yet expired (`live`). Another client's token is unknown to this one.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) fn of(own: bool, live: bool) -> Self {
        match (own, live) {
            (false, _) => TokenCheck::Unknown,
            (true, false) => TokenCheck::Expired,
            (true, true) => TokenCheck::Valid,
        }
    }
}

/// Where one-time tokens are issued and checked.
///
/// Keep a token's time to live no longer than the route's response expiry
/// ([`IdempotencyLayer::with_expiry`](crate::IdempotencyLayer::with_expiry)): once a used
/// token's response and record are purged, a token still valid would run again.
///
/// A token's life is UNUSED → CREATING → COMPLETED. The book holds the UNUSED part (the
/// token, its client, its expiry); the route's tiers hold the rest under the token as key,
/// exactly as for an `Idempotency-Key`: CREATING is the key's claim (the record's row in
/// the open transaction), COMPLETED its committed record with the stored response. So the move is atomic where the record's claim is.
pub trait TokenBook: Send + Sync + 'static {
    /// Issues a fresh, unguessable token to `client`, valid for `ttl`.
    fn issue(&self, client: String, ttl: Duration) -> BoxFuture<Result<String, StoreError>>;

    /// What the book knows of `token` presented by `client`.
    fn check(&self, token: String, client: String) -> BoxFuture<Result<TokenCheck, StoreError>>;
}

/// A fresh token: 244 bits from the operating system's random source (two UUID v4s), as 64
/// hex digits.
pub fn fresh_token() -> String {
    let (high, low) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    format!("{}{}", high.simple(), low.simple())
}

/// Where a submit carries its token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenField {
    /// A request header, e.g. [`TOKEN_HEADER`].
    Header(HeaderName),
    /// A field of an `application/x-www-form-urlencoded` body: an HTML form's hidden input.
    Form(String),
}

impl TokenField {
    /// The token `headers` and `body` carry, if any.
    pub(crate) fn read(&self, headers: &HeaderMap, body: &Bytes) -> Result<String, Problem> {
        let token = match self {
            TokenField::Header(name) => {
                let mut values = headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (Some(value), None) => value.to_str().ok().map(str::to_owned),
                    (None, _) => None,
                    (Some(_), Some(_)) => {
                        return Err(Problem::key_malformed(format!("more than one `{name}` header")));
                    }
                }
            }
            TokenField::Form(name) => {
                let is_form = headers
                    .get(CONTENT_TYPE)
                    .and_then(|value| value.to_str().ok())
                    .is_some_and(|value| value.starts_with("application/x-www-form-urlencoded"));
                is_form
                    .then(|| form_urlencoded::parse(body).find(|(field, _)| field == name))
                    .flatten()
                    .map(|(_, value)| value.into_owned())
            }
        };
        token
            .filter(|token| !token.is_empty())
            .ok_or(Problem::TokenMissing)
    }
}

/// The endpoint that issues one-time tokens: every request gets a fresh token bound to its
/// client, as `{"token": "…", "expiresInSeconds": N}` with `Cache-Control: no-store`. Mount
/// it where the form's page fetches it (axum: `Router::route_service("/tokens", issuer)`).
///
/// A request whose client the identity cannot tell is answered
/// [`Problem::ClientUnidentified`]; a book that fails, [`Problem::StoreUnavailable`].
#[derive(Clone)]
pub struct TokenIssuer {
    book: Arc<dyn TokenBook>,
    ttl: Duration,
    client: ClientScope,
}

impl fmt::Debug for TokenIssuer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenIssuer")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl TokenIssuer {
    /// Issues tokens from `book`, each valid for `ttl`, bound to the client `clients` reads:
    /// the same scope as the route that takes them. With [`ClientScope::shared`] a token is
    /// anyone's who holds it.
    pub fn new(book: impl TokenBook, ttl: Duration, clients: ClientScope) -> Self {
        TokenIssuer {
            book: Arc::new(book),
            ttl,
            client: clients,
        }
    }

    async fn issue(self, parts: http::request::Parts) -> Response<Full<Bytes>> {
        let client = match self.client.of(&parts) {
            Ok(client) => client,
            Err(problem) => return problem.to_response(),
        };
        let token = match self.book.issue(client, self.ttl).await {
            Ok(token) => token,
            Err(error) => {
                tracing::warn!(%error, "could not issue a one-time token");
                let retry_after = Duration::from_secs(1);
                return Problem::StoreUnavailable { retry_after }.to_response();
            }
        };
        let document = serde_json::json!({ "token": token, "expiresInSeconds": self.ttl.as_secs() });
        let mut response = Response::new(Full::new(Bytes::from(document.to_string())));
        *response.status_mut() = StatusCode::CREATED;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    }
}

impl<B: Send + 'static> Service<Request<B>> for TokenIssuer {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let issuer = self.clone();
        let (parts, _) = request.into_parts();
        Box::pin(async move { Ok(issuer.issue(parts).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_from_their_field() {
        let mut headers = HeaderMap::new();
        let header = TokenField::Header(TOKEN_HEADER);
        assert_eq!(header.read(&headers, &Bytes::new()), Err(Problem::TokenMissing));
        headers.insert(TOKEN_HEADER, HeaderValue::from_static("t-1"));
        assert_eq!(header.read(&headers, &Bytes::new()).unwrap(), "t-1");

        let form = TokenField::Form("_token".to_owned());
        let body = Bytes::from_static(b"amount=5&_token=t%2D2");
        assert_eq!(
            form.read(&headers, &body),
            Err(Problem::TokenMissing),
            "not a form"
        );
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        assert_eq!(form.read(&headers, &body).unwrap(), "t-2");
        assert_ne!(fresh_token(), fresh_token());
        assert_eq!(fresh_token().len(), 64);
    }
}

/// Properties over inputs no one wrote by hand (`PROPTEST_CASES`, 256 unless set).
#[cfg(test)]
mod properties {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any submitted form body is a token or its absence, never a panic; a token put in a
        /// form as browsers encode it reads back as itself.
        #[test]
        fn prop_a_form_body_gives_its_token_or_none(
            body in vec(any::<u8>(), 0..300),
            token in "\\PC{1,80}",
        ) {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/x-www-form-urlencoded"));
            let field = TokenField::Form("_token".to_owned());
            let _ = field.read(&headers, &Bytes::from(body));
            let encoded: String = form_urlencoded::Serializer::new(String::new())
                .append_pair("amount", "5")
                .append_pair("_token", &token)
                .finish();
            prop_assert_eq!(field.read(&headers, &Bytes::from(encoded)), Ok(token));
        }

        /// A fresh token is 64 lowercase hex digits, every time.
        #[test]
        fn prop_fresh_tokens_are_64_hex_digits(_round in 0..4u8) {
            let token = fresh_token();
            prop_assert_eq!(token.len(), 64);
            prop_assert!(token.bytes().all(|byte| byte.is_ascii_hexdigit() && !byte.is_ascii_uppercase()));
        }
    }
}
