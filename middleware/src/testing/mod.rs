//! The store suites: what every backend of a tier's store trait must do, as tests you run
//! against your own backend (cargo feature `testing`). oncely's own backends pass them
//! against real servers in its integration tests.
//!
//! Each suite is a set of async functions generic over the store, and a macro that turns
//! them into one `#[tokio::test]` per case for your backend:
//!
//! ```ignore
//! // In your crate's tests, with tokio's `macros` and `rt-multi-thread` features.
//! async fn store() -> MyFlagStore {
//!     MyFlagStore::connect("redis://127.0.0.1:6379").await
//! }
//! oncely::flag_store_suite!(store);
//! ```
//!
//! `flag_store_suite!(run: STORE)` instead runs every case in turn inside one async test,
//! each with a fresh `STORE` expression: for a backend whose server the test itself starts
//! and stops. The macros are [`flag_store_suite!`](crate::flag_store_suite),
//! [`lock_store_suite!`](crate::lock_store_suite),
//! [`record_store_suite!`](crate::record_store_suite) and
//! [`state_store_suite!`](crate::state_store_suite).
//!
//! Cases use keys with a random suffix, so they run in parallel against one shared server
//! and can be rerun without cleaning up. Some wait for leases of a second or two to run
//! out, in real time: a backend whose expiry follows another clock fails them. A failed
//! case panics with what the backend answered.

pub mod flag;
pub mod lock;
pub mod record;
pub mod state;

/// A key unique to this run: `name` plus a random suffix.
pub fn unique(name: &str) -> String {
    format!("{name}-{}", crate::Token::random())
}

/// Turns the cases of `suite` into tests, or runs them in turn; see the
/// [module docs](crate::testing).
#[doc(hidden)]
#[macro_export]
macro_rules! __store_suite {
    ($suite:ident, (run: $store:expr), [$($case:ident),* $(,)?]) => {
        $( $crate::testing::$suite::$case($store).await; )*
    };
    ($suite:ident, ($make:ident), [$($case:ident),* $(,)?]) => {
        mod $suite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    $crate::testing::$suite::$case(super::$make().await).await
                }
            )*
        }
    };
}
