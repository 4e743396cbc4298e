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
    /// The claim's token; `None` when the delivery went on without a claim (a flag with a
    /// record behind claims nothing).
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

/// What the flag asks its store for one envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FlagAsk {
    /// Nothing: a record behind, and a pre-filter found the key certainly new.
    Skip,
    /// Whether the key is done, claiming nothing: a record behind serialises the copies.
    Look,
    /// A claim of the key under this token: the flag is the only tier holding copies back.
    Claim(Token),
}

impl FlagAsk {
    /// What the flag found, from the marker its store had (`None`: no marker; a claim that
    /// won found none).
    pub(crate) fn found(self, marker: Option<Claim>) -> Found {
        match (self, marker) {
            (FlagAsk::Skip, _) => Found::Nothing,
            (_, Some(Claim::Done(fingerprint))) => Found::Done(fingerprint),
            // A flag that claims nothing goes on past another copy's claim.
            (FlagAsk::Look, Some(Claim::InFlight | Claim::Won) | None) => Found::Nothing,
            (FlagAsk::Claim(token), None | Some(Claim::Won)) => Found::Claimed(token),
            (FlagAsk::Claim(_), Some(Claim::InFlight)) => Found::InFlight,
        }
    }
}

/// What the flag found for one envelope, as it decides on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// Nothing that stops the delivery, and no claim held.
    Nothing,
    /// The claim under this token won.
    Claimed(Token),
    /// Another claim of the key is in flight.
    InFlight,
    /// The key is done with this fingerprint.
    Done(Fingerprint),
}

impl<St> FlagLayer<St> {
    /// What to ask the store for `envelope`'s key: with a record behind, a look (nothing,
    /// when a pre-filter found the key certainly new); alone, a claim under a new token.
    pub(crate) fn ask(&self, envelope: &Envelope) -> FlagAsk {
        match (self.record_behind, envelope.is_certainly_new()) {
            (true, true) => FlagAsk::Skip,
            (true, false) => FlagAsk::Look,
            (false, _) => FlagAsk::Claim(Token::random()),
        }
    }

    /// What the flag decides for `envelope` on what it `found`.
    pub(crate) fn decide(&self, envelope: &Envelope, found: Found) -> Enter<FlagTicket> {
        let (key, fingerprint) = (envelope.key().clone(), envelope.fingerprint());
        let proceed = |claim| {
            Enter::Proceed(FlagTicket {
                key,
                fingerprint,
                claim,
            })
        };
        match found {
            Found::Nothing => proceed(None),
            Found::Claimed(token) => proceed(Some(token)),
            Found::InFlight => Enter::Stop(in_flight(Tier::Flag, envelope.key(), self.in_flight_delay)),
            Found::Done(done) if fingerprint.matches(done) => {
                Enter::Stop(Outcome::Duplicate { tier: Tier::Flag })
            }
            Found::Done(done) => Enter::Stop(payload_mismatch(envelope.key(), done, fingerprint)),
        }
    }

    /// Logs how `update` of `key` went: a failed update costs speed, never correctness.
    pub(crate) fn report(&self, key: &BusinessKey, update: FlagUpdate, updated: Result<bool, &StoreError>) {
        let settled = matches!(update, FlagUpdate::Complete(_) | FlagUpdate::MarkDone);
        // A marker left in flight expires with its lease, and a missing done marker sends
        // the next duplicate on to the durable tier behind. So the outcome stands.
        match updated {
            Ok(true) => {}
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
        let ask = self.ask(envelope);
        let marker = match ask {
            FlagAsk::Skip => None,
            FlagAsk::Look => self.store.look(envelope.key()).await?.map(Claim::Done),
            FlagAsk::Claim(token) => Some(self.store.claim(envelope.key(), token, self.lease).await?),
        };
        Ok(self.decide(envelope, ask.found(marker)))
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
