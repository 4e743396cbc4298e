//! The pre-filter tier: its two backends, and the stack it fronts on in-memory stores.
#![cfg(all(feature = "prefilter", feature = "memory"))]

mod common;

use std::time::Duration;

use common::{Effects, count, handle_concurrently, order};
use oncely::flag::{FlagLayer, FlagStore, MemoryFlagStore};
use oncely::prefilter::{BitmapPreFilter, BloomPreFilter, PreFilter, PreFilterLayer, Verdict};
use oncely::record::{MemoryRecordStore, RecordLayer};
use oncely::{BusinessKey, ConfigError, Fingerprint, KeyExtractor, Outcome, Route, Tier};
use tower::ServiceBuilder;

/// Pre-filter, flag (skipping its read for certainly new keys) and record, in front of a
/// counting handler.
fn route<F: PreFilter>(
    filter: PreFilterLayer<F>,
    flags: &MemoryFlagStore,
    records: &MemoryRecordStore,
    effects: &Effects,
) -> Route<impl common::Stack> {
    let stack = ServiceBuilder::new()
        .layer(filter)
        .layer(FlagLayer::new(flags.clone(), Duration::from_secs(600)).with_record_behind())
        .layer(RecordLayer::new(records.clone()))
        .service(effects.handler(Duration::ZERO, 0));
    Route::new("orders", KeyExtractor::json_pointer("/orderId"), stack)
}

fn stores() -> (MemoryFlagStore, MemoryRecordStore, Effects) {
    (
        MemoryFlagStore::new(),
        MemoryRecordStore::new(),
        Effects::default(),
    )
}

fn key(text: &str) -> BusinessKey {
    BusinessKey::new(text)
}

#[test]
fn a_bloom_filter_never_calls_a_remembered_key_new() {
    let filter = BloomPreFilter::new(1_000, 0.01).unwrap();
    for n in 0..1_000 {
        filter.remember(&key(&format!("order-{n}")));
    }
    for n in 0..1_000 {
        assert_eq!(filter.check(&key(&format!("order-{n}"))), Verdict::MaybeSeen);
    }
    let new = (1_000..11_000)
        .filter(|n| filter.check(&key(&format!("order-{n}"))) == Verdict::CertainlyNew)
        .count();
    assert!(
        new > 9_700,
        "about 1 % false positives at the expected size: {new} of 10,000 new"
    );
}

#[test]
fn a_bloom_filter_refuses_impossible_sizes() {
    assert!(matches!(
        BloomPreFilter::new(0, 0.01),
        Err(ConfigError::InvalidPreFilter { .. })
    ));
    assert!(matches!(
        BloomPreFilter::new(10, 0.0),
        Err(ConfigError::InvalidPreFilter { .. })
    ));
    assert!(matches!(
        BloomPreFilter::new(10, 1.0),
        Err(ConfigError::InvalidPreFilter { .. })
    ));
}

#[test]
fn the_bitmap_reads_ids_from_the_base_up_and_sends_everything_else_the_full_way() {
    let filter = BitmapPreFilter::new(1_000);
    assert_eq!(filter.check(&key("999")), Verdict::MaybeSeen, "below the base");
    assert_eq!(
        filter.check(&key("1000")),
        Verdict::CertainlyNew,
        "the base itself"
    );
    assert_eq!(filter.check(&key("order-7")), Verdict::MaybeSeen, "not numeric");
    assert_eq!(filter.check(&key("")), Verdict::MaybeSeen);
    assert_eq!(filter.check(&key("-1000")), Verdict::MaybeSeen);
    assert_eq!(
        filter.check(&key("99999999999999999999")),
        Verdict::MaybeSeen,
        "beyond u64"
    );
    assert_eq!(filter.check(&key(&u64::MAX.to_string())), Verdict::CertainlyNew);

    filter.remember(&key("1000"));
    filter.remember(&key("1234:grant_points"));
    filter.remember(&key("999"));
    assert_eq!(filter.check(&key("1000")), Verdict::MaybeSeen);
    assert_eq!(
        filter.check(&key("1234")),
        Verdict::MaybeSeen,
        "namespaced keys share the id"
    );
    assert_eq!(filter.check(&key("1001")), Verdict::CertainlyNew);
    assert_eq!(filter.check(&key("999")), Verdict::MaybeSeen);
}

#[tokio::test]
async fn a_certainly_new_key_skips_the_flags_read_and_is_marked_done_after_success() {
    let (flags, records, effects) = stores();
    let route = route(
        PreFilterLayer::new(BitmapPreFilter::new(0)),
        &flags,
        &records,
        &effects,
    );

    // A done marker of another payload: a delivery that read the flag would be dead-lettered
    // as a payload mismatch.
    let other = Fingerprint::of(b"another payload");
    (flags.mark_done(&key("7"), other, Duration::from_secs(60)).await).unwrap();
    assert_eq!(route.handle(order("7", "sku")).await, Outcome::Processed);
    assert_eq!(
        flags.look(&key("7")).await.unwrap(),
        Some(Fingerprint::of(br#"{"orderId":"7","sku":"sku"}"#)),
        "marked done once the record settled it"
    );
    // Now remembered: the copy goes through the flag, which answers for it.
    assert_eq!(
        route.handle(order("7", "sku")).await,
        Outcome::Duplicate { tier: Tier::Flag }
    );
    assert_eq!(effects.of("7"), 1);
}

#[tokio::test]
async fn a_false_positive_takes_the_full_path_and_is_processed_once() {
    let (flags, records, effects) = stores();
    // A filter far beyond its size answers "maybe seen" for keys it never saw.
    let filter = BloomPreFilter::new(1, 0.5).unwrap();
    for n in 0..64 {
        filter.remember(&key(&format!("seen-{n}")));
    }
    let layer = PreFilterLayer::new(filter);
    let unseen = (0..)
        .map(|n| format!("new-{n}"))
        .find(|candidate| layer.filter().check(&key(candidate)) == Verdict::MaybeSeen)
        .unwrap();
    let route = route(layer, &flags, &records, &effects);
    assert_eq!(route.handle(order(&unseen, "sku")).await, Outcome::Processed);
    assert_eq!(
        route.handle(order(&unseen, "sku")).await,
        Outcome::Duplicate { tier: Tier::Flag }
    );
    assert_eq!(effects.of(&unseen), 1);
}

#[tokio::test]
async fn concurrent_copies_of_a_new_key_both_look_new_and_the_record_tells_them_apart() {
    let (flags, records, effects) = stores();
    let route = route(
        PreFilterLayer::new(BitmapPreFilter::new(0)),
        &flags,
        &records,
        &effects,
    );
    let outcomes = handle_concurrently(&route, (0..8).map(|_| order("42", "sku")).collect()).await;
    assert_eq!(effects.of("42"), 1, "{outcomes:?}");
    assert_eq!(count(&outcomes, |outcome| *outcome == Outcome::Processed), 1);
}

#[tokio::test]
async fn a_filter_lost_in_a_restart_still_applies_each_key_once() {
    let (flags, records, effects) = stores();
    // The second consumer restarted with an empty filter, and Redis was flushed meanwhile:
    // every copy looks certainly new and skips the flag, and the record answers for it.
    for expected in [Outcome::Processed, Outcome::Duplicate { tier: Tier::Record }] {
        flags.clear();
        let filter = PreFilterLayer::new(BloomPreFilter::new(100, 0.01).unwrap());
        let consumer = route(filter, &flags, &records, &effects);
        for n in 0..20 {
            assert_eq!(consumer.handle(order(&format!("o-{n}"), "sku")).await, expected);
        }
    }
    assert_eq!(effects.total(), 20);
}
