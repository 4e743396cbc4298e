//! What every [`FlagStore`] must do.

use std::time::Duration;

use crate::flag::{Claim, FlagStore};
use crate::{BusinessKey, Fingerprint, Token};

use super::unique;

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(60);

fn key(name: &str) -> BusinessKey {
    BusinessKey::new(unique(name))
}

/// Of 64 concurrent claims of one key, exactly one wins and the rest see it in flight.
pub async fn one_of_many_concurrent_claims_wins<S: FlagStore>(store: S) {
    let key = key("flag-race");
    let claims: Vec<_> = (0..64)
        .map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move { store.claim(&key, Token::random(), LEASE).await.unwrap() })
        })
        .collect();
    let mut won = 0;
    for claim in claims {
        match claim.await.unwrap() {
            Claim::Won => won += 1,
            Claim::InFlight => {}
            Claim::Done(_) => panic!("nothing completed the key"),
        }
    }
    assert_eq!(won, 1);
}

/// Completing turns the claim into "done" with the payload's fingerprint.
pub async fn a_completed_claim_is_done_with_its_fingerprint<S: FlagStore>(store: S) {
    let (key, token, fingerprint) = (key("flag-done"), Token::random(), Fingerprint::of(b"payload"));
    assert_eq!(store.claim(&key, token, LEASE).await.unwrap(), Claim::Won);
    assert!(store.complete(&key, token, fingerprint, RETENTION).await.unwrap());
    assert_eq!(
        store.claim(&key, Token::random(), LEASE).await.unwrap(),
        Claim::Done(fingerprint)
    );
}

/// A key marked done without a claim answers claims as done, even over an in-flight marker.
pub async fn a_key_marked_done_without_a_claim_is_done<S: FlagStore>(store: S) {
    let (marked, other) = (key("flag-mark-done"), key("flag-mark-done-over-claim"));
    let (fingerprint, token) = (Fingerprint::of(b"payload"), Token::random());
    store.mark_done(&marked, fingerprint, RETENTION).await.unwrap();
    assert_eq!(
        store.claim(&marked, Token::random(), LEASE).await.unwrap(),
        Claim::Done(fingerprint)
    );

    assert_eq!(store.claim(&other, token, LEASE).await.unwrap(), Claim::Won);
    store.mark_done(&other, fingerprint, RETENTION).await.unwrap();
    assert_eq!(
        store.claim(&other, Token::random(), LEASE).await.unwrap(),
        Claim::Done(fingerprint)
    );
}

/// A look answers only a done marker, and changes nothing: a key without a marker or in
/// flight answers `None`, and can still be claimed, or completed by its claim's holder.
pub async fn a_look_sees_only_done_and_takes_nothing<S: FlagStore>(store: S) {
    let (key, token, fingerprint) = (key("flag-look"), Token::random(), Fingerprint::of(b"payload"));
    assert_eq!(store.look(&key).await.unwrap(), None);
    assert_eq!(
        store.claim(&key, token, LEASE).await.unwrap(),
        Claim::Won,
        "a look claims nothing"
    );
    assert_eq!(store.look(&key).await.unwrap(), None, "in flight is not done");
    assert!(store.complete(&key, token, fingerprint, RETENTION).await.unwrap());
    assert_eq!(store.look(&key).await.unwrap(), Some(fingerprint));
    store
        .mark_done(&key, Fingerprint::of(b"other"), RETENTION)
        .await
        .unwrap();
    assert_eq!(store.look(&key).await.unwrap(), Some(Fingerprint::of(b"other")));
}

/// A released claim lets the next claim win.
pub async fn a_released_claim_can_be_claimed_again<S: FlagStore>(store: S) {
    let (key, token) = (key("flag-release"), Token::random());
    assert_eq!(store.claim(&key, token, LEASE).await.unwrap(), Claim::Won);
    assert!(store.release(&key, token).await.unwrap());
    assert_eq!(
        store.claim(&key, Token::random(), LEASE).await.unwrap(),
        Claim::Won
    );
}

/// Complete and release refuse a token that does not hold the claim, and change nothing.
pub async fn complete_and_release_refuse_a_wrong_token<S: FlagStore>(store: S) {
    let (key, token) = (key("flag-token"), Token::random());
    assert_eq!(store.claim(&key, token, LEASE).await.unwrap(), Claim::Won);
    let stranger = Token::random();
    assert!(
        !store
            .complete(&key, stranger, Fingerprint::of(b"x"), RETENTION)
            .await
            .unwrap()
    );
    assert!(!store.release(&key, stranger).await.unwrap());
    assert_eq!(
        store.claim(&key, Token::random(), LEASE).await.unwrap(),
        Claim::InFlight
    );
    assert!(store.release(&key, token).await.unwrap());
}

/// An in-flight claim expires with its lease; its holder can then no longer complete it.
pub async fn an_expired_lease_lets_a_new_claim_in<S: FlagStore>(store: S) {
    let (key, stale) = (key("flag-lease"), Token::random());
    assert_eq!(
        store
            .claim(&key, stale, Duration::from_millis(100))
            .await
            .unwrap(),
        Claim::Won
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    let fresh = Token::random();
    assert_eq!(store.claim(&key, fresh, LEASE).await.unwrap(), Claim::Won);
    assert!(
        !store
            .complete(&key, stale, Fingerprint::of(b"x"), RETENTION)
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&key, fresh, Fingerprint::of(b"x"), RETENTION)
            .await
            .unwrap()
    );
}

/// A done marker expires with its retention.
pub async fn a_done_marker_expires_with_its_retention<S: FlagStore>(store: S) {
    let (key, token) = (key("flag-retention"), Token::random());
    assert_eq!(store.claim(&key, token, LEASE).await.unwrap(), Claim::Won);
    assert!(
        store
            .complete(&key, token, Fingerprint::of(b"x"), Duration::from_millis(100))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        store.claim(&key, Token::random(), LEASE).await.unwrap(),
        Claim::Won
    );
}
