//! The store suites, one module per tier trait.

pub mod flag;
pub mod lock;
pub mod record;
pub mod state;

/// Turns the cases of `suite` into tests, or runs them in turn; see `flag_store_suite!`.
#[doc(hidden)]
#[macro_export]
macro_rules! store_suite {
    ($suite:ident, (run: $store:expr), [$($case:ident),* $(,)?]) => {
        $( $crate::suite::$suite::$case($store).await; )*
    };
    ($suite:ident, ($make:ident), [$($case:ident),* $(,)?]) => {
        mod $suite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    $crate::suite::$suite::$case(super::$make().await).await
                }
            )*
        }
    };
}
