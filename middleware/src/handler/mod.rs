//! The user's handler: the innermost service of a stack, and how its errors become outcomes.
//!
//! Two ways to write one:
//! - **typed** ([`handler`], and `PgTransactionalLayer::handler` (feature `postgres`) for a
//!   handler that writes in the record's transaction): an `async fn` whose arguments are
//!   taken from the envelope ([`FromEnvelope`]): the deserialised body ([`Json`]), the
//!   business key ([`BusinessKey`](crate::BusinessKey)), the delivery
//!   ([`Delivery`](crate::Delivery)), and the transaction (`record::PgTransaction`). A body
//!   that does not deserialise is dead-lettered as `bad_body` before the function runs.
//! - **untyped** ([`handler_fn`]): an `async fn(Envelope)` that reads what it needs itself.
//!
//! Either returns `Result<(), E>`: `Ok` is [`Outcome::Processed`](crate::Outcome::Processed);
//! an error becomes a [`HandlerError`], transient (retried) or permanent (dead-lettered) by
//! what it is ([`Classify`]).
//!
//! ```
//! use oncely::{BusinessKey, HandlerError, Json, handler};
//!
//! #[derive(serde::Deserialize)]
//! struct RedPacket {
//!     user: String,
//!     cents: i64,
//! }
//!
//! async fn credit(key: BusinessKey, Json(packet): Json<RedPacket>) -> Result<(), HandlerError> {
//!     let amount = u32::try_from(packet.cents)?; // negative: permanent, dead-lettered
//!     println!("{key}: credit {amount} cents to {}", packet.user);
//!     Ok(())
//! }
//!
//! let service = handler(credit);
//! # let _ = service;
//! ```

mod error;
mod extract;
mod typed;
mod untyped;

use error::outcome_of;
pub use error::{Classify, ErrorClass, HandlerError, ResultExt};
pub use extract::{Argument, FromEnvelope, InTransaction, Json, Plain};
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use typed::typed;
pub use typed::{Handler, TypedHandler, handler};
pub use untyped::{HandlerFn, handler_fn};
