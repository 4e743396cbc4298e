//! What a typed handler can take as arguments.

use std::any::type_name;

use serde::de::DeserializeOwned;

use crate::dead_letter::DeadLetterReason;
use crate::envelope::{BusinessKey, Delivery, Envelope};
use crate::outcome::Outcome;

/// A typed handler argument taken from the envelope, in the spirit of axum's extractors.
///
/// When it cannot be taken, the handler does not run and the delivery gets the outcome
/// returned instead (a body that does not deserialise into [`Json<T>`] is dead-lettered as
/// `bad_body`). Implement it for a type of your own to take it as an argument.
pub trait FromEnvelope: Sized {
    /// The argument for `envelope`, or the outcome the delivery gets instead.
    fn from_envelope(envelope: &Envelope) -> Result<Self, Outcome>;
}

/// The context of a handler made by [`handler`](crate::handler()): no transaction.
#[derive(Debug)]
pub enum Plain {}

/// The context of a handler made by `PgTransactionalLayer::handler` (feature `postgres`): it
/// runs inside the record's transaction, and may take it as an argument.
#[derive(Debug)]
pub enum InTransaction {}

/// A type a handler in `Context` ([`Plain`] or [`InTransaction`]) may take as an argument:
/// every [`FromEnvelope`] type in both, and the transaction (`record::PgTransaction`) only in
/// [`InTransaction`] — so a handler that takes the transaction cannot be built without the
/// transactional record in front of it.
#[diagnostic::on_unimplemented(
    message = "a handler cannot take `{Self}` here",
    note = "a handler takes types that implement `oncely::handler::FromEnvelope` (Json<T>, BusinessKey, Delivery)",
    note = "the transaction (`PgTransaction`) only comes with the transactional record: build the handler with `PgTransactionalLayer::handler(f)`"
)]
pub trait Argument<Context>: Sized {
    /// The argument for `envelope`, or the outcome the delivery gets instead.
    fn take(envelope: &Envelope) -> Result<Self, Outcome>;
}

impl<T: FromEnvelope, Context> Argument<Context> for T {
    fn take(envelope: &Envelope) -> Result<Self, Outcome> {
        T::from_envelope(envelope)
    }
}

/// The body deserialised from JSON into `T`.
///
/// A body that does not deserialise (not JSON, a missing field, a number out of `T`'s range)
/// is dead-lettered with [`DeadLetterReason::BadBody`] and serde's message, without running
/// the handler: the same body fails the same way every time. The body is deserialised
/// straight from its bytes, once per handler call; its size is bounded by the route's
/// [maximum body length](crate::Route::with_max_body_len).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Json<T>(pub T);

impl<T: DeserializeOwned> FromEnvelope for Json<T> {
    fn from_envelope(envelope: &Envelope) -> Result<Self, Outcome> {
        serde_json::from_slice(envelope.delivery().body())
            .map(Json)
            .map_err(|error| {
                let detail = format!("body is not a {}: {error}", type_name::<T>());
                Outcome::dead_letter(DeadLetterReason::BadBody, detail)
            })
    }
}

/// The delivery's business key, as the route read it (with its namespace).
impl FromEnvelope for BusinessKey {
    fn from_envelope(envelope: &Envelope) -> Result<Self, Outcome> {
        Ok(envelope.key().clone())
    }
}

/// The delivery: body, headers, broker key, message id, attempt. A clone; the body is shared,
/// not copied.
impl FromEnvelope for Delivery {
    fn from_envelope(envelope: &Envelope) -> Result<Self, Outcome> {
        Ok(envelope.delivery().clone())
    }
}
