//! What every [`RecordStore`] must do.

use std::time::Duration;

use crate::record::{Begin, RecordStatus, RecordStore};
use crate::{BusinessKey, Fingerprint};

use super::unique;

const LEASE: Duration = Duration::from_secs(30);

fn key(name: &str) -> BusinessKey {
    BusinessKey::new(unique(name))
}

/// Of 32 concurrent begins of a new key, exactly one starts attempt 1.
pub async fn one_of_many_concurrent_begins_starts<S: RecordStore>(store: S) {
    let (key, fingerprint) = (key("record-race"), Fingerprint::of(b"x"));
    let begins: Vec<_> = (0..32)
        .map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move { store.begin(&key, fingerprint, LEASE, None).await.unwrap() })
        })
        .collect();
    let mut started = 0;
    for begin in begins {
        match begin.await.unwrap() {
            Begin::Started { attempt } => {
                assert_eq!(attempt, 1);
                started += 1;
            }
            Begin::InProgress => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(started, 1);
}

/// Of 32 concurrent begins of a failed key, exactly one takes it over, as attempt 2.
pub async fn one_of_many_concurrent_takeovers_starts<S: RecordStore>(store: S) {
    let (key, fingerprint) = (key("record-takeover-race"), Fingerprint::of(b"x"));
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert!(store.fail(&key, 1, "database busy").await.unwrap());
    let begins: Vec<_> = (0..32)
        .map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move { store.begin(&key, fingerprint, LEASE, None).await.unwrap() })
        })
        .collect();
    let mut started = Vec::new();
    for begin in begins {
        match begin.await.unwrap() {
            Begin::Started { attempt } => started.push(attempt),
            Begin::InProgress => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(started, [2], "one takeover, as attempt 2");
}

/// A record goes PROCESSING → SUCCESS, is then done, and reads back with its fields.
pub async fn a_succeeded_record_is_done<S: RecordStore>(store: S) {
    let (key, fingerprint) = (key("record-success"), Fingerprint::of(b"x"));
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    let record = store.get(&key).await.unwrap().expect("the record exists");
    assert_eq!(
        (record.status, record.attempts, record.fingerprint),
        (RecordStatus::Processing, 1, fingerprint)
    );
    assert!(store.succeed(&key, 1).await.unwrap());
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, None).await.unwrap(),
        Begin::Done
    );
    let record = store.get(&key).await.unwrap().expect("the record exists");
    assert_eq!(record.status, RecordStatus::Success);
    assert!(record.updated_at >= record.created_at);
}

/// A failure is recorded with its text, and the next begin takes the key over.
pub async fn a_failed_record_is_taken_over<S: RecordStore>(store: S) {
    let (key, fingerprint) = (key("record-failure"), Fingerprint::of(b"x"));
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert!(store.fail(&key, 1, "database busy").await.unwrap());
    let record = store.get(&key).await.unwrap().expect("the record exists");
    assert_eq!(record.status, RecordStatus::Failure);
    assert_eq!(record.last_error.as_deref(), Some("database busy"));
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, None).await.unwrap(),
        Begin::Started { attempt: 2 }
    );
    assert!(
        !store.succeed(&key, 1).await.unwrap(),
        "attempt 1 no longer owns the record"
    );
    assert!(store.succeed(&key, 2).await.unwrap());
}

/// The same key with another payload is a conflict, whatever the record's status.
pub async fn another_payload_is_a_conflict<S: RecordStore>(store: S) {
    let (key, first, second) = (
        key("record-conflict"),
        Fingerprint::of(b"a"),
        Fingerprint::of(b"b"),
    );
    assert_eq!(
        store.begin(&key, first, LEASE, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert_eq!(
        store.begin(&key, second, LEASE, None).await.unwrap(),
        Begin::Conflict { recorded: first }
    );
    assert!(store.succeed(&key, 1).await.unwrap());
    assert_eq!(
        store.begin(&key, second, LEASE, None).await.unwrap(),
        Begin::Conflict { recorded: first }
    );
}

/// An unchecked fingerprint (a route whose fingerprint policy is off) is never a conflict:
/// not against a record written with a real fingerprint, nor the other way round.
pub async fn an_unchecked_fingerprint_is_never_a_conflict<S: RecordStore>(store: S) {
    let (checked, unchecked) = (key("record-checked"), key("record-unchecked"));
    let payload = Fingerprint::of(b"a");
    assert_eq!(
        store.begin(&checked, payload, LEASE, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert!(store.fail(&checked, 1, "failed").await.unwrap());
    assert_eq!(
        store
            .begin(&checked, Fingerprint::UNCHECKED, LEASE, None)
            .await
            .unwrap(),
        Begin::Started { attempt: 2 },
        "a failed record is taken over whatever its fingerprint"
    );
    assert!(store.succeed(&checked, 2).await.unwrap());
    assert_eq!(
        store
            .begin(&checked, Fingerprint::UNCHECKED, LEASE, None)
            .await
            .unwrap(),
        Begin::Done
    );

    assert_eq!(
        store
            .begin(&unchecked, Fingerprint::UNCHECKED, LEASE, None)
            .await
            .unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert!(store.succeed(&unchecked, 1).await.unwrap());
    assert_eq!(
        store.begin(&unchecked, payload, LEASE, None).await.unwrap(),
        Begin::Done
    );
}

/// A PROCESSING record blocks others within its lease and is taken over after it.
pub async fn a_processing_record_is_taken_over_after_its_lease<S: RecordStore>(store: S) {
    let (key, fingerprint) = (key("record-lease"), Fingerprint::of(b"x"));
    let lease = Duration::from_millis(150);
    assert_eq!(
        store.begin(&key, fingerprint, lease, None).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert_eq!(
        store.begin(&key, fingerprint, lease, None).await.unwrap(),
        Begin::InProgress
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        store.begin(&key, fingerprint, lease, None).await.unwrap(),
        Begin::Started { attempt: 2 }
    );
    assert!(!store.fail(&key, 1, "late").await.unwrap());
}

/// A takeover under an older fencing token than the record's is refused; a newer one wins.
pub async fn a_stale_fencing_token_cannot_take_over<S: RecordStore>(store: S) {
    let (key, fingerprint) = (key("record-fence"), Fingerprint::of(b"x"));
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, Some(5)).await.unwrap(),
        Begin::Started { attempt: 1 }
    );
    assert!(store.fail(&key, 1, "lease lost").await.unwrap());
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, Some(4)).await.unwrap(),
        Begin::Fenced
    );
    assert_eq!(
        store.begin(&key, fingerprint, LEASE, Some(6)).await.unwrap(),
        Begin::Started { attempt: 2 }
    );
    let record = store.get(&key).await.unwrap().expect("the record exists");
    assert_eq!(record.fencing_token, Some(6));
}
