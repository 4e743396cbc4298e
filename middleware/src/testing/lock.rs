//! What every [`LockStore`] must do.

use std::time::Duration;

use crate::Token;
use crate::lock::LockStore;

use super::unique;

const LEASE: Duration = Duration::from_secs(30);

/// Of 64 concurrent acquisitions of one entity, exactly one gets the lock.
pub async fn one_of_many_concurrent_acquisitions_wins<S: LockStore>(store: S) {
    let entity = unique("lock-race");
    let attempts: Vec<_> = (0..64)
        .map(|_| {
            let (store, entity) = (store.clone(), entity.clone());
            tokio::spawn(async move { store.acquire(&entity, Token::random(), LEASE).await.unwrap() })
        })
        .collect();
    let mut winners = 0;
    for attempt in attempts {
        winners += usize::from(attempt.await.unwrap().is_some());
    }
    assert_eq!(winners, 1);
}

/// Of 64 concurrent acquisitions of an entity locked and released before, exactly one gets
/// the lock, with a fencing token above the earlier one.
pub async fn one_of_many_concurrent_acquisitions_of_a_released_entity_wins<S: LockStore>(store: S) {
    let (entity, token) = (unique("lock-rerace"), Token::random());
    let first = store
        .acquire(&entity, token, LEASE)
        .await
        .unwrap()
        .expect("the lock is free");
    assert!(store.release(&entity, token).await.unwrap());
    let attempts: Vec<_> = (0..64)
        .map(|_| {
            let (store, entity) = (store.clone(), entity.clone());
            tokio::spawn(async move { store.acquire(&entity, Token::random(), LEASE).await.unwrap() })
        })
        .collect();
    let mut fences = Vec::new();
    for attempt in attempts {
        fences.extend(attempt.await.unwrap());
    }
    assert_eq!(fences.len(), 1, "{fences:?}");
    assert!(fences[0] > first, "{} after {first}", fences[0]);
}

/// Fencing tokens grow from one acquisition of an entity to the next.
pub async fn fencing_tokens_grow<S: LockStore>(store: S) {
    let entity = unique("lock-fence");
    let mut previous = 0;
    for _ in 0..5 {
        let token = Token::random();
        let fence = store
            .acquire(&entity, token, LEASE)
            .await
            .unwrap()
            .expect("the lock is free");
        assert!(fence > previous, "{fence} after {previous}");
        previous = fence;
        assert!(store.release(&entity, token).await.unwrap());
    }
}

/// Renew and release refuse a token that does not hold the lock.
pub async fn renew_and_release_refuse_a_wrong_token<S: LockStore>(store: S) {
    let (entity, token) = (unique("lock-token"), Token::random());
    assert!(store.acquire(&entity, token, LEASE).await.unwrap().is_some());
    let stranger = Token::random();
    assert!(!store.renew(&entity, stranger, LEASE).await.unwrap());
    assert!(!store.release(&entity, stranger).await.unwrap());
    assert!(
        store
            .acquire(&entity, Token::random(), LEASE)
            .await
            .unwrap()
            .is_none()
    );
    assert!(store.release(&entity, token).await.unwrap());
}

/// A renewed lock outlives its first lease; an unrenewed one expires and frees the entity.
pub async fn renewal_extends_the_lease_and_expiry_frees_it<S: LockStore>(store: S) {
    let (entity, token) = (unique("lock-lease"), Token::random());
    let lease = Duration::from_millis(200);
    assert!(store.acquire(&entity, token, lease).await.unwrap().is_some());
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(store.renew(&entity, token, lease).await.unwrap());
    }
    assert!(
        store
            .acquire(&entity, Token::random(), lease)
            .await
            .unwrap()
            .is_none()
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(!store.renew(&entity, token, lease).await.unwrap());
    assert!(
        store
            .acquire(&entity, Token::random(), lease)
            .await
            .unwrap()
            .is_some()
    );
}
