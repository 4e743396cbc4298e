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
    pub(crate) key: BusinessKey,
    pub(crate) fingerprint: Fingerprint,
    /// The claim's token; `None` when the delivery went on without holding the claim (with
    /// a record behind: the key was certainly new, or in flight elsewhere).
    claim: Option<Token>,
}

/// How the flag settles a ticket once the tiers behind answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FlagUpdate {
    /// Turn the claim held by this token into the done marker.
    Complete(Token),
    /// Delete the claim held by this token, so that a retry can run.
    Release(Token),
    /// Mark the key done without a claim: the record behind settled it.
    MarkDone,
    /// Nothing: the delivery held no claim and the key was not settled.
    Nothing,
}

impl FlagTicket {
    /// The update that settles this ticket, by whether the tiers behind settled the key.
    pub(crate) fn update(&self, settled: bool) -> FlagUpdate {
        match (self.claim, settled) {
            (Some(token), true) => FlagUpdate::Complete(token),
            (Some(token), false) => FlagUpdate::Release(token),
            (None, true) => FlagUpdate::MarkDone,
            (None, false) => FlagUpdate::Nothing,
        }
    }
}

impl<St> FlagLayer<St> {
    /// The token to claim `envelope`'s key with; `None` when the delivery goes on without a
    /// claim (a record behind, and a pre-filter found the key certainly new).
    pub(crate) fn claim_token(&self, envelope: &Envelope) -> Option<Token> {
        (!(self.record_behind && envelope.is_certainly_new())).then(Token::random)
    }

    /// What the flag decides for `envelope` when its claim under a token found a claim
    /// (`None`: no claim was made, see [`claim_token`](Self::claim_token)).
    pub(crate) fn decide(&self, envelope: &Envelope, claimed: Option<(Token, Claim)>) -> Enter<FlagTicket> {
        let (key, fingerprint) = (envelope.key().clone(), envelope.fingerprint());
        let proceed = |claim| {
            Enter::Proceed(FlagTicket {
                key,
                fingerprint,
                claim,
            })
        };
        let Some((token, claim)) = claimed else {
            return proceed(None);
        };
        match claim {
            Claim::Won => proceed(Some(token)),
            // The record behind serialises the copies; the marker may be a dead consumer's.
            Claim::InFlight if self.record_behind => proceed(None),
            Claim::InFlight => Enter::Stop(in_flight(Tier::Flag, envelope.key(), self.in_flight_delay)),
            Claim::Done(done) if fingerprint.matches(done) => {
                Enter::Stop(Outcome::Duplicate { tier: Tier::Flag })
            }
            Claim::Done(done) => Enter::Stop(payload_mismatch(envelope.key(), done, fingerprint)),
        }
    }

    /// Whether a claim that finds the key in flight stops the delivery (no record behind).
    #[cfg(feature = "redis")]
    pub(crate) fn in_flight_stops(&self) -> bool {
        !self.record_behind
    }

    /// Logs how `update` of `key` went: a failed update costs speed, never correctness.
    pub(crate) fn report(&self, key: &BusinessKey, update: FlagUpdate, updated: Result<bool, &StoreError>) {
        let settled = matches!(update, FlagUpdate::Complete(_) | FlagUpdate::MarkDone);
        // A marker left in flight expires with its lease, and a missing done marker sends
        // the next duplicate on to the durable tier behind. So the outcome stands.
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
    }
}

impl<St: FlagStore> TierDecision for FlagLayer<St> {
    type Ticket = FlagTicket;
    const TIER: Tier = Tier::Flag;

    fn failure_policy(&self) -> FailurePolicy {
        self.failure_policy
    }

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<FlagTicket>, StoreError> {
        let claimed = match self.claim_token(envelope) {
            Some(token) => Some((token, self.store.claim(envelope.key(), token, self.lease).await?)),
            None => None,
        };
        Ok(self.decide(envelope, claimed))
    }

    async fn exit(&self, ticket: FlagTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let update = ticket.update(outcome.is_settled());
        let FlagTicket { key, fingerprint, .. } = ticket;
        let updated = match update {
            FlagUpdate::Complete(token) => {
                (self.store)
                    .complete(&key, token, fingerprint, self.retention)
                    .await
            }
            FlagUpdate::Release(token) => self.store.release(&key, token).await,
            FlagUpdate::MarkDone => (self.store)
                .mark_done(&key, fingerprint, self.retention)
                .await
                .map(|()| true),
            FlagUpdate::Nothing => Ok(true),
        };
        self.report(&key, update, updated.as_ref().copied());
        Ok(outcome)
    }
}
