//! The flag and the lock as one tier on one Redis: each step of the two that can share a
//! round trip does, so a delivery makes two round trips to Redis instead of four.
//!
//! [`FlagLockLayer`] takes the [flag](crate::flag) and [lock](crate::lock) layers a stack
//! would put one behind the other (the flag in front) and decides exactly what they would
//! decide:
//!
//! | the two tiers, one after the other | the joint tier |
//! |---|---|
//! | flag claim (with a record behind: look), then lock acquire | one script: the claim or look; where the flag lets the delivery on, the acquire; where the lock is busy, no claim is left |
//! | lock release, then the flag's complete, release or done marker | one script: the release; the flag's update as the lock's answer makes the outcome (a lost lock is a retry: the claim is released) |
//!
//! Outcomes are the two tiers' own (`Duplicate { tier: Flag }`, `InFlight(Flag)`,
//! `LockBusy`, `LeaseLost`, the lock's dead letter for a delivery without an entity), and
//! so are the flag's marker and the lock's keys in Redis: the store suites of both tiers
//! and `inspect` read them as before. What changes:
//!
//! - **one store failure for both**: a script that fails fails both steps, so the joint
//!   tier fails closed if either layer does (the lock does by default), and names
//!   [`Tier::FlagLock`](crate::Tier::FlagLock) in the
//!   [`StoreUnavailable`](crate::RetryReason::StoreUnavailable) retry. A flag marker oncely
//!   did not write is the flag's own store failure, under the flag's policy, as before
//!   (where the delivery goes on and is settled, the joint tier writes the done marker over
//!   it; the flag layer leaves it);
//! - a failed release script loses the flag's update with the lock's release: the claim
//!   stays in flight until its lease ends, where the two layers might have settled it (with
//!   a record behind there is no claim, and the key is not marked done: its copies go on to
//!   the record);
//! - metrics and logs name the tier `flag_lock`;
//! - a lock found busy never leaves a claim behind, even for an instant: the two tiers claim,
//!   then release.
//!
//! With [`FlagLockLayer::with_coalescing`], the deliveries in flight at the same moment
//! share each script call: every delivery's claim and acquire joins the next call, which
//! leaves at once when fewer than the configured number of calls are on the wire (a lone
//! delivery never waits for a timer), and so do the releases. Redis runs a call's
//! deliveries one after the other, each under `pcall`, so each decides as it would alone:
//! two copies of one key in one call decide as one after the other, and one delivery's
//! error answers that delivery only (deliveries before it in the call keep what they did).
//!
//! Both stores must be on one Redis: the scripts run on the flag store's connection, and
//! the lock's watchdog renews on the lock store's. On Redis Cluster the flag's key (hash
//! tag: the business key) and the lock's (the entity) are in different slots, where Redis
//! refuses a script: the tier asks once, before its first delivery, whether Redis takes a
//! script over two slots, and where it does not it runs the flag and the lock one after the
//! other, exactly as two layers, at four round trips.

mod decision;
mod layer;

pub use layer::FlagLockLayer;
