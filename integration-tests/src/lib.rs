//! oncely's integration tests: the store suites that every backend of a tier's trait must
//! pass, and (in `tests/`) the runs against real services.
//!
//! Each suite is a set of async functions generic over the store, plus a macro that turns
//! them into one `#[tokio::test]` per case for a backend:
//!
//! ```text
//! async fn store() -> MemoryFlagStore { MemoryFlagStore::new() }
//! integration_tests::flag_store_suite!(store);
//! ```
//!
//! Cases use keys with a random suffix, so they run in parallel against one shared server
//! and can be rerun without cleaning up.

pub mod suite;

/// A key unique to this test run: `name` plus a random suffix.
pub fn unique(name: &str) -> String {
    format!("{name}-{}", oncely::Token::random())
}
