//! The pre-filter tier: a local memory of settled keys that answers "certainly new" without
//! a round trip.
//!
//! Most messages are not duplicates. A [`BloomPreFilter`] (or, for numeric ids, an exact
//! [`BitmapPreFilter`]) in front of the stack says of each key either
//! [`Verdict::CertainlyNew`] — it was never settled here — or [`Verdict::MaybeSeen`]. A
//! certainly new envelope is marked ([`Envelope::is_certainly_new`](crate::Envelope::is_certainly_new)),
//! and the tiers behind that support it skip their lookups: a [flag](crate::flag) configured with
//! [`with_record_behind`](crate::flag::FlagLayer::with_record_behind)
//! skips its Redis read and only marks the key done afterwards. The durable tier's atomic
//! claim (the [record](crate::record)) always runs: it stays the final word, so two copies
//! of a new key that both look certainly new are still told apart there. "Maybe seen" goes
//! through every tier.
//!
//! The filter remembers a key only after the tiers behind it settled it (processed, a
//! duplicate or stale): the durable tier first, then the filter. Losing the filter — a
//! restart, a rebalance that sends keys elsewhere — therefore only costs speed: keys look
//! new again and take the full path to the durable tier, which answers for them.
//!
//! Limits: the filter is local to one process. It pays off when the same key keeps reaching
//! the same consumer (one partition or queue per key range); a copy that reaches another
//! consumer looks new there and goes to the durable tier. A Bloom filter's false positives
//! ("maybe seen" for a new key) send that key through the full path, never skip it. A
//! filter filled beyond its expected item count has more false positives, not wrong
//! answers. Both backends start empty; with the `postgres` feature,
//! `rebuild_from_records` fills one on start from the record table's recent successes, and
//! with the `mysql` feature `rebuild_from_mysql_records` from MySQL/MariaDB's.

mod bitmap;
mod bloom;
mod layer;
mod store;

#[cfg(feature = "mysql")]
pub use crate::store::mysql::prefilter::rebuild_from_mysql_records;
#[cfg(feature = "postgres")]
pub use crate::store::postgres::prefilter::rebuild_from_records;
pub use bitmap::BitmapPreFilter;
pub use bloom::BloomPreFilter;
pub use layer::PreFilterLayer;
pub use store::{PreFilter, Verdict};
