//! What every [`StateStore`] must do.

use crate::state_guard::StateStore;

use super::unique;

/// An entity starts with no state and moves only by compare-and-set from what it holds.
pub async fn compare_and_set_moves_only_from_the_expected_state<S: StateStore>(store: S) {
    let entity = unique("state-cas");
    assert_eq!(store.current(&entity).await.unwrap(), None);
    assert!(
        !store
            .compare_and_set(&entity, Some("Created"), "Assigned")
            .await
            .unwrap()
    );
    assert!(store.compare_and_set(&entity, None, "Created").await.unwrap());
    assert!(!store.compare_and_set(&entity, None, "Created").await.unwrap());
    assert!(
        store
            .compare_and_set(&entity, Some("Created"), "Assigned")
            .await
            .unwrap()
    );
    assert_eq!(store.current(&entity).await.unwrap().as_deref(), Some("Assigned"));
}

/// Of 32 concurrent compare-and-sets from one state, exactly one applies.
pub async fn one_of_many_concurrent_transitions_applies<S: StateStore>(store: S) {
    let entity = unique("state-race");
    assert!(store.compare_and_set(&entity, None, "Created").await.unwrap());
    let moves: Vec<_> = (0..32)
        .map(|i| {
            let (store, entity) = (store.clone(), entity.clone());
            let next = format!("S{i}");
            tokio::spawn(async move {
                store
                    .compare_and_set(&entity, Some("Created"), &next)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut applied = 0;
    for applied_here in moves {
        applied += usize::from(applied_here.await.unwrap());
    }
    assert_eq!(applied, 1);
}
