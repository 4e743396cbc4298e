//! What every record store a [`Retention`] purges ([`RetentionStore`]) must do. Each case
//! needs a record table of its own: the purge deletes every old `SUCCESS` row in it.

use std::fmt;
use std::time::Duration;

use crate::record::{RecordStore, Retention, RetentionPass, RetentionRunner, RetentionStore};
use crate::{BusinessKey, Fingerprint};

use super::unique;

/// The purge deletes `SUCCESS` records past the retention, and nothing else; a batch
/// smaller than the rows to purge is followed by more until all are gone.
pub async fn the_purge_deletes_only_success_records_past_the_retention<S>(store: S)
where
    S: RecordStore + RetentionStore + fmt::Debug,
{
    let fingerprint = Fingerprint::of(b"x");
    let lease = Duration::from_secs(60);
    let done: Vec<_> = (0..5).map(|_| BusinessKey::new(unique("done"))).collect();
    let (failed, running) = (
        BusinessKey::new(unique("failed")),
        BusinessKey::new(unique("running")),
    );
    for key in done.iter().chain([&failed, &running]) {
        store.begin(key, fingerprint, lease, None).await.unwrap();
    }
    for key in &done {
        assert!(store.succeed(key, 1).await.unwrap());
    }
    assert!(store.fail(&failed, 1, "boom").await.unwrap());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut batches_seen = Vec::new();
    let purging = Retention::new(store.clone(), Duration::from_millis(10)).with_batch_rows(2);
    let pass = purging
        .run_once_with_progress(|rows| batches_seen.push(rows))
        .await
        .unwrap();
    assert!(
        matches!(
            pass,
            RetentionPass::Purged {
                rows: 5,
                batches: 3,
                ..
            }
        ),
        "{pass:?}"
    );
    assert_eq!(batches_seen, [2, 2, 1]);
    for key in &done {
        assert_eq!(store.get(key).await.unwrap(), None);
    }
    assert!(store.get(&failed).await.unwrap().is_some());
    assert!(store.get(&running).await.unwrap().is_some());
    // Within the retention, nothing goes.
    store.begin(&done[0], fingerprint, lease, None).await.unwrap();
    assert!(store.succeed(&done[0], 1).await.unwrap());
    let keeping = Retention::new(store.clone(), Duration::from_secs(3600));
    assert!(matches!(
        keeping.run_once().await.unwrap(),
        RetentionPass::Purged { rows: 0, .. }
    ));
    assert!(store.get(&done[0]).await.unwrap().is_some());
}

/// While one runner holds the store's purge lease, another's pass is `Busy` and deletes
/// nothing; once it steps down, the next pass purges. Two passes started at once delete
/// every old row once between them, one after the other or one of them `Busy`.
pub async fn one_runner_purges_at_a_time<S>(store: S)
where
    S: RecordStore + RetentionStore + fmt::Debug,
{
    let fingerprint = Fingerprint::of(b"x");
    let keys: Vec<_> = (0..200).map(|_| BusinessKey::new(unique("done"))).collect();
    for key in &keys {
        store
            .begin(key, fingerprint, Duration::from_secs(60), None)
            .await
            .unwrap();
        assert!(store.succeed(key, 1).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let retention = || Retention::new(store.clone(), Duration::from_millis(10)).with_batch_rows(20);

    let held = store.lead().await.unwrap().expect("no one else holds the lease");
    assert_eq!(retention().run_once().await.unwrap(), RetentionPass::Busy);
    assert!(
        store.get(&keys[0]).await.unwrap().is_some(),
        "a busy pass deleted"
    );
    held.step_down().await.unwrap();

    // Each pass notes its batches as they complete: passes that overlapped would
    // interleave them (both delete a disjoint part of the table, so the counts alone would
    // not tell).
    let batches_by_pass = std::sync::Mutex::new(Vec::new());
    let note = |pass: char| {
        let batches_by_pass = &batches_by_pass;
        move |rows| batches_by_pass.lock().expect("never poisoned").push((pass, rows))
    };
    let (first, second) = (retention(), retention());
    let (a, b) = tokio::join!(
        first.run_once_with_progress(note('a')),
        second.run_once_with_progress(note('b'))
    );
    let purged = |pass: RetentionPass| match pass {
        RetentionPass::Purged { rows, .. } => rows,
        RetentionPass::Busy => 0,
    };
    assert_eq!(purged(a.unwrap()) + purged(b.unwrap()), 200);
    // One pass's batches, then perhaps the other's, finding nothing left: a pass that ran
    // beside the first would interleave its batches, or (blocked on the first's rows, then
    // finding them gone) end with one empty batch, possibly before the first's.
    let batches_by_pass = batches_by_pass.into_inner().expect("never poisoned");
    let handovers = batches_by_pass
        .windows(2)
        .filter(|pair| pair[0].0 != pair[1].0)
        .count();
    let first_pass = batches_by_pass.first().map(|(pass, _)| *pass);
    let purged_by_first: u64 = batches_by_pass
        .iter()
        .filter(|(pass, _)| Some(*pass) == first_pass)
        .map(|(_, rows)| rows)
        .sum();
    assert!(
        handovers <= 1 && purged_by_first == 200,
        "two passes purged at once: batches (pass, rows) in the order {batches_by_pass:?}"
    );
    for key in &keys {
        assert_eq!(store.get(key).await.unwrap(), None);
    }
}
