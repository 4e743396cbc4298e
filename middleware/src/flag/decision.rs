use super::layer::FlagLayer;
use super::store::{Claim, FlagStore};
use crate::envelope::{BusinessKey, Envelope};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::outcome::Outcome;
use crate::tier::{Enter, FailurePolicy, Tier, TierDecision, in_flight, payload_mismatch};
use crate::token::Token;

/// What the flag tier holds for one envelope between claiming its key and settling it.
#[derive(Debug)]
pub struct FlagTicket {
    key: BusinessKey,
    fingerprint: Fingerprint,
    /// The claim's token; `None` when the delivery went on without holding the claim (with
    /// a record behind: the key was certainly new, or in flight elsewhere).
    claim: Option<Token>,
}

impl<St: FlagStore> TierDecision for FlagLayer<St> {
    type Ticket = FlagTicket;
    const TIER: Tier = Tier::Flag;

    fn failure_policy(&self) -> FailurePolicy {
        self.failure_policy
    }

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<FlagTicket>, StoreError> {
        let (key, fingerprint) = (envelope.key().clone(), envelope.fingerprint());
        let unclaimed = |key| {
            Enter::Proceed(FlagTicket {
                key,
                fingerprint,
                claim: None,
            })
        };
        if self.record_behind && envelope.is_certainly_new() {
            return Ok(unclaimed(key));
        }
        let token = Token::random();
        Ok(match self.store.claim(&key, token, self.lease).await? {
            Claim::Won => Enter::Proceed(FlagTicket {
                key,
                fingerprint,
                claim: Some(token),
            }),
            // The record behind serialises the copies; the marker may be a dead consumer's.
            Claim::InFlight if self.record_behind => unclaimed(key),
            Claim::InFlight => Enter::Stop(in_flight(Tier::Flag, &key, self.in_flight_delay)),
            Claim::Done(done) if fingerprint.matches(done) => {
                Enter::Stop(Outcome::Duplicate { tier: Tier::Flag })
            }
            Claim::Done(done) => Enter::Stop(payload_mismatch(&key, done, fingerprint)),
        })
    }

    async fn exit(&self, ticket: FlagTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let FlagTicket {
            key,
            fingerprint,
            claim,
        } = ticket;
        let settled = outcome.is_settled();
        let updated = match (claim, settled) {
            (Some(token), true) => {
                self.store
                    .complete(&key, token, fingerprint, self.retention)
                    .await
            }
            (Some(token), false) => self.store.release(&key, token).await,
            (None, true) => self
                .store
                .mark_done(&key, fingerprint, self.retention)
                .await
                .map(|()| true),
            (None, false) => Ok(true),
        };
        // A failed update here costs speed, never correctness: a marker left in flight
        // expires with its lease, and a missing done marker sends the next duplicate on to
        // the durable tier behind. So the outcome stands.
        match updated {
            Ok(true) => {}
            // With a record behind, a copy that went on without the claim may have marked
            // the key done first: an ordinary race, not a lost lease.
            Ok(false) if self.record_behind => {
                tracing::debug!(%key, settled, "flag claim replaced by another copy's done marker")
            }
            Ok(false) => {
                tracing::warn!(%key, settled, "flag claim was lost before it was settled (lease ran out?)")
            }
            Err(error) => tracing::warn!(%key, settled, %error, "flag store failed while settling the claim"),
        }
        Ok(outcome)
    }
}
