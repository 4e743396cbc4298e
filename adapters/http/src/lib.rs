//! # oncely-http
//!
//! HTTP on oncely's stack: an `Idempotency-Key` layer for any tower HTTP service (axum,
//! hyper, tonic's HTTP), following draft-ietf-httpapi-idempotency-key-header-07, and
//! one-time tokens for form submissions — on the same tiers as oncely's consumers, with the
//! stored response written in the handler's own database transaction.
//!
//! ```text
//! request ─▶ IdempotencyLayer ─▶ flag ─▶ transactional record ─▶ HttpHandler ─▶ your service
//!            key, client, body     (oncely's tiers, as for       lends the tx,   writes in
//!            limit, fingerprint     a consumer)                  stores the      the tx
//!     ◀── handler's response, replay, 409, 422, 503 ◀── Outcome ◀── response ◀──┘
//! ```
//!
//! - [`IdempotencyLayer`]: the layer; its docs map every outcome to its answer.
//! - [`Problem`]: every answer that is not the handler's, as `application/problem+json`.
//! - [`StoredResponse`], [`ResponseStore`]: what is answered again, and where it is kept:
//!   `PgResponses` (feature `postgres`, default) and `MysqlResponses` (feature `mysql`), each
//!   in its record's transaction; [`MemoryResponses`] for tests.
//! - [`TokenIssuer`], [`TokenBook`], [`TokenField`]: the one-time token flow;
//!   `PgTokens` (feature `postgres`) and `MysqlTokens` (feature `mysql`) keep the tokens.
//! - [`HttpHandler`]: the user's service at the bottom of the tiers.
//!
//! Keys are scoped by the client ([`ClientScope`]); a key's first request
//! runs once, whatever the number of copies and however they interleave, as far as the
//! tiers guarantee it for a consumer: with the transactional record, exactly once. Its
//! response — status, the stored headers, body — is what every retry gets until it expires.

mod client;
mod handler;
mod key;
mod layer;
mod problem;
mod response;
mod store;
mod token;

pub use client::ClientScope;
pub use handler::HttpHandler;
pub use key::{DEFAULT_MAX_KEY_LEN, IDEMPOTENCY_KEY, REPLAYED};
pub use layer::{
    DEFAULT_EXPIRY, DEFAULT_MAX_RESPONSE_LEN, DEFAULT_TIMEOUT, Idempotency, IdempotencyLayer, IdempotentBody,
    MAX_SCOPED_KEY_LEN,
};
pub use problem::Problem;
pub use response::{ResponseStore, SaveFailure, StoredResponse};
pub use store::memory::MemoryResponses;
#[cfg(feature = "mysql")]
pub use store::mysql::{MysqlResponses, MysqlTokens};
#[cfg(feature = "postgres")]
pub use store::postgres::{PgResponses, PgTokens};
pub use token::{TOKEN_HEADER, TokenBook, TokenCheck, TokenField, TokenIssuer, fresh_token};
