//! The plumbing of each store kind, shared by that kind's backends of every tier: nothing
//! here is imported by users (what they need is re-exported where they look for it).

#[cfg(feature = "memory")]
pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
