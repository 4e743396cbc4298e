//! What every record store a [`Reconciler`] repairs ([`StuckRecords`]) must do.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::record::{Begin, ReconcileReport, Reconciler, RecordStatus, RecordStore, StuckRecords};
use crate::{BoxError, BusinessKey, Fingerprint};

use super::unique;

/// Two attempts crashed mid-handler (past their short lease), a third still runs: one pass
/// marks the one whose effect the check finds `SUCCESS`, releases the other as `FAILURE`
/// (its redelivery takes it over), and neither checks nor touches the running one.
pub async fn stuck_records_are_settled_from_the_effect_check<S>(store: S)
where
    S: RecordStore + StuckRecords + fmt::Debug,
{
    let (applied, missing, running) = (
        BusinessKey::new(unique("applied")),
        BusinessKey::new(unique("missing")),
        BusinessKey::new(unique("running")),
    );
    let fingerprint = Fingerprint::of(b"x");
    for (key, lease) in [
        (&applied, Duration::from_millis(50)),
        (&missing, Duration::from_millis(50)),
        (&running, Duration::from_secs(60)),
    ] {
        let begun = store.begin(key, fingerprint, lease, None).await.unwrap();
        assert_eq!(begun, Begin::Started { attempt: 1 }, "{key}");
    }
    tokio::time::sleep(Duration::from_millis(150)).await;

    let checked = Arc::new(AtomicUsize::new(0));
    let check = {
        let (checked, applied) = (checked.clone(), applied.clone());
        move |key: BusinessKey| {
            checked.fetch_add(1, Ordering::SeqCst);
            let found = key == applied;
            async move { Ok::<bool, BoxError>(found) }
        }
    };
    let report = Reconciler::new(store.clone(), check).run_once().await.unwrap();
    let expected = ReconcileReport {
        examined: 2,
        marked_success: 1,
        released: 1,
        ..ReconcileReport::default()
    };
    assert_eq!(report, expected);
    assert_eq!(
        checked.load(Ordering::SeqCst),
        2,
        "the record within its lease is not checked"
    );
    let status = async |key: &BusinessKey| store.get(key).await.unwrap().expect("a record").status;
    assert_eq!(status(&applied).await, RecordStatus::Success);
    assert_eq!(status(&missing).await, RecordStatus::Failure);
    assert_eq!(status(&running).await, RecordStatus::Processing);
    let redelivered = store
        .begin(&missing, fingerprint, Duration::from_secs(60), None)
        .await;
    assert_eq!(redelivered.unwrap(), Begin::Started { attempt: 2 });
}

/// A stuck attempt taken over by a delivery while the check ran is left to that delivery.
pub async fn a_record_taken_over_during_the_check_is_left_alone<S>(store: S)
where
    S: RecordStore + StuckRecords + fmt::Debug,
{
    let (key, fingerprint) = (BusinessKey::new(unique("taken")), Fingerprint::of(b"x"));
    let short = Duration::from_millis(50);
    assert_eq!(
        store.begin(&key, fingerprint, short, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    let check = {
        let (store, key) = (store.clone(), key.clone());
        move |_: BusinessKey| {
            let (store, key) = (store.clone(), key.clone());
            async move {
                // The redelivery takes the row over while the check looks.
                let begun = store
                    .begin(&key, fingerprint, Duration::from_secs(60), None)
                    .await;
                assert_eq!(begun.unwrap(), Begin::Started { attempt: 2 });
                Ok::<bool, BoxError>(false)
            }
        }
    };
    let report = Reconciler::new(store.clone(), check).run_once().await.unwrap();
    assert_eq!(report.changed_meanwhile, 1, "{report}");
    let record = store.get(&key).await.unwrap().expect("a record");
    assert_eq!((record.status, record.attempts), (RecordStatus::Processing, 2));
}
