//! `postgres`: three-step record claims, single-row next to coalesced, on `DATABASE_URL` in a
//! schema of the bench's own, dropped afterwards.

use std::time::Duration;

use integration_tests::postgres::{ScratchSchema, pool};
use oncely::record::{PgRecordStore, RecordStore};
use oncely::{BusinessKey, Fingerprint};

use crate::measure::{Op, compare_at_each_level, op};
use crate::report::{Plot, Report, Row, Section, Target};

/// How the record store sends its claims.
#[derive(Clone, Copy)]
enum Claims {
    /// The baseline: each claim its own statement.
    SingleRow,
    /// Concurrent claims coalesced into batches.
    Coalesced,
}

impl Claims {
    fn name(self) -> &'static str {
        match self {
            Claims::SingleRow => "single-row claim",
            Claims::Coalesced => "record claim, coalesced (≤ 64 rows, ≤ 4 batches on the wire)",
        }
    }

    /// A claim of a new key through `store`, configured for this way of sending.
    fn op(self, store: &PgRecordStore) -> Op {
        let store = match self {
            Claims::SingleRow => store.clone(),
            Claims::Coalesced => store.clone().with_coalescing(64, 4),
        };
        op(store, |store, i| async move {
            store
                .begin(
                    &BusinessKey::new(i.to_string()),
                    Fingerprint::of(b"bench"),
                    Duration::from_secs(60),
                    None,
                )
                .await
                .expect("claim");
        })
    }
}

/// Measures coalesced claims against single-row claims at each in-flight level, on a pool
/// of 16, and adds the table and the coalescing's target to `report`.
pub(crate) async fn run(report: &mut Report) {
    let pool = pool(16);
    let schema = ScratchSchema::new(&pool).await;
    let store = PgRecordStore::new(pool.clone(), schema.records());
    // Keys never repeat, so nothing needs resetting between measurements.
    let nothing = op((), |(), _| async {});
    let measured = [(Claims::Coalesced.name(), Claims::Coalesced.op(&store))];
    let rows = compare_at_each_level(&nothing, &Claims::SingleRow.op(&store), &measured).await;
    report.add_target(Target {
        what: "PostgreSQL coalesced claims at 64 in flight",
        ratio: Row::last_ratio(&rows, Claims::Coalesced.name()),
        baseline: "single-row claims",
        at_least: 10.0,
    });
    report.add(Section {
        title: "PostgreSQL record tier (three-step claims, pool of 16)".into(),
        baseline_name: Claims::SingleRow.name(),
        unit: None,
        rows,
        note: None,
        plot: Plot::Curves("PostgreSQL: "),
    });
}
