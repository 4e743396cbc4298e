//! The store suites: what every backend of a tier's store trait must do, as tests you run
//! against your own backend (cargo feature `testing`). oncely's own backends pass them
//! against real servers in its integration tests. The [`adapter`] suite is the same for
//! broker adapters: every adapter runs it against its real broker.
//!
//! Each suite is a set of async functions generic over the store, and a macro that turns
//! them into one `#[tokio::test]` per case for your backend:
//!
//! ```ignore
//! // In your crate's tests, with tokio's `macros` and `rt-multi-thread` features.
//! async fn store() -> MyFlagStore {
//!     MyFlagStore::connect("redis://127.0.0.1:6379").await
//! }
//! oncely::store_suite!(flag, store);
//! ```
//!
//! `store_suite!(flag, run: STORE)` instead runs every case in turn inside one async test,
//! each with a fresh `STORE` expression: for a backend whose server the test itself starts
//! and stops. The suites are `flag`, `lock`, `reconcile`, `record`, `retention` and `state`, one module
//! each here;
//! see [`store_suite!`](crate::store_suite).
//!
//! Cases use keys with a random suffix, so they run in parallel against one shared server
//! and can be rerun without cleaning up. Some wait for leases of a second or two to run
//! out, in real time: a backend whose expiry follows another clock fails them. A failed
//! case panics with what the backend answered.

pub mod adapter;
pub mod flag;
pub mod lock;
pub mod reconcile;
pub mod record;
pub mod retention;
pub mod state;

/// A key unique to this run: `name` plus a random suffix.
pub fn unique(name: &str) -> String {
    format!("{name}-{}", crate::Token::random())
}

/// Runs one store suite against a backend: `flag`, `lock`, `reconcile`, `record`,
/// `retention` or `state`, for the store traits of the flag, lock, record and state guard
/// tiers, the record's [`Reconciler`](crate::record::Reconciler) and its
/// [`Retention`](crate::record::Retention).
///
/// `store_suite!(flag, make)` generates one `#[tokio::test]` per case, in a module `flag`,
/// each with the store the async function `make` returns. Inside an async test,
/// `store_suite!(flag, run: STORE)` runs every case in turn, each with a fresh `STORE`
/// expression: for a backend whose server the test itself starts and stops. See the
/// [module docs](crate::testing).
#[macro_export]
macro_rules! store_suite {
    (flag, $($how:tt)*) => {
        $crate::__store_suite!(flag, ($($how)*), [one_of_many_concurrent_claims_wins, a_completed_claim_is_done_with_its_fingerprint, a_key_marked_done_without_a_claim_is_done, a_look_sees_only_done_and_takes_nothing, a_released_claim_can_be_claimed_again, complete_and_release_refuse_a_wrong_token, an_expired_lease_lets_a_new_claim_in, a_done_marker_expires_with_its_retention]);
    };
    (lock, $($how:tt)*) => {
        $crate::__store_suite!(lock, ($($how)*), [one_of_many_concurrent_acquisitions_wins, one_of_many_concurrent_acquisitions_of_a_released_entity_wins, fencing_tokens_grow, renew_and_release_refuse_a_wrong_token, renewal_extends_the_lease_and_expiry_frees_it]);
    };
    (record, $($how:tt)*) => {
        $crate::__store_suite!(record, ($($how)*), [one_of_many_concurrent_begins_starts, one_of_many_concurrent_takeovers_starts, a_succeeded_record_is_done, a_failed_record_is_taken_over, another_payload_is_a_conflict, an_unchecked_fingerprint_is_never_a_conflict, a_processing_record_is_taken_over_after_its_lease, a_stale_fencing_token_cannot_take_over]);
    };
    (reconcile, $($how:tt)*) => {
        $crate::__store_suite!(reconcile, ($($how)*), [stuck_records_are_settled_from_the_effect_check, a_record_taken_over_during_the_check_is_left_alone]);
    };
    (retention, $($how:tt)*) => {
        $crate::__store_suite!(retention, ($($how)*), [the_purge_deletes_only_success_records_past_the_retention, one_runner_purges_at_a_time]);
    };
    (state, $($how:tt)*) => {
        $crate::__store_suite!(state, ($($how)*), [compare_and_set_moves_only_from_the_expected_state, one_of_many_concurrent_transitions_applies]);
    };
}

/// Turns the cases of one suite into tests, or runs them in turn; see [`store_suite!`].
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
