//! The flag tier: a fast, expiring "in flight / done" marker per business key.
//!
//! A delivery first *claims* its key: one atomic step that succeeds only if the key has no
//! marker. The claim holds a random [`Token`](crate::Token) and a lease. Then:
//!
//! | the key's marker | outcome |
//! |---|---|
//! | none | claimed: the tiers behind run |
//! | in flight (another claim's lease is running) | [`RetryLater`](crate::Outcome::RetryLater), never an ack |
//! | done, same payload | [`Duplicate`](crate::Outcome::Duplicate) from [`Tier::Flag`](crate::Tier::Flag) |
//! | done, other payload | [`DeadLetter`](crate::Outcome::DeadLetter): key reused with another payload |
//!
//! "Same payload" is as the route's [`FingerprintPolicy`](crate::FingerprintPolicy) says
//! (whole body unless configured).
//!
//! When the tiers behind settle the key (processed, duplicate or stale) the claim becomes
//! *done*, kept for the retention TTL. Any other answer *releases* the claim so a retry can
//! run. Only the claim's own token may complete or release it, so a holder whose lease ran
//! out cannot clear the marker of the delivery that took over.
//!
//! # What it guarantees alone, and what it relies on
//! Alone, the flag removes duplicates that arrive while the marker lives, cheaply. It is
//! not durable: a marker can be lost (store flushed or restarted, retention expired), and a
//! lease can run out while a slow handler still works, letting a second delivery in. Keep a
//! durable tier — the [`record`](crate::record) — behind it when an effect must never repeat;
//! then a lost marker only costs a trip to the record. That is also why the flag fails open
//! by default when its store is down.
//!
//! # With a record behind
//! Declared with [`FlagLayer::with_record_behind`], the flag claims nothing: the record's
//! claim is the atomic one. A delivery *looks* at its key's marker (one read): done answers
//! as above, anything else lets it on to the record, and once the tiers behind settled the
//! key it is marked done (one write). No in-flight marker is written, so none is left for
//! a crashed consumer's redeliveries to wait out.

mod decision;
mod layer;
mod store;

#[cfg(feature = "memory")]
pub use crate::store::memory::flag::MemoryFlagStore;
#[cfg(feature = "redis")]
pub use crate::store::redis::flag::{FlagState, FlagView, RedisFlagStore};
pub use decision::FlagTicket;
#[cfg(feature = "redis")]
pub(crate) use decision::{FlagAsk, FlagUpdate, Found};
pub use layer::FlagLayer;
pub use store::{Claim, FlagStore};
