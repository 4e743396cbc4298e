use super::layer::RecordLayer;
use super::store::RecordStore;
use crate::envelope::{BusinessKey, Envelope};
use crate::error::StoreError;
use crate::lock::LockLease;
use crate::outcome::Outcome;
use crate::tier::{Enter, Tier, TierDecision};

/// What the record tier holds for one envelope: the attempt it began, which only it may
/// settle. Dropped unsettled, the record stays `PROCESSING` until its lease runs out.
#[derive(Debug)]
pub struct RecordTicket {
    key: BusinessKey,
    attempt: u32,
}

impl<St: RecordStore> TierDecision for RecordLayer<St> {
    type Ticket = RecordTicket;
    const TIER: Tier = Tier::Record;

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<RecordTicket>, StoreError> {
        let (key, fingerprint) = (envelope.key().clone(), envelope.fingerprint());
        let begin = self
            .store
            .begin(&key, fingerprint, self.lease, fencing_token(envelope))
            .await?;
        Ok(
            match begin.into_attempt(&key, fingerprint, self.in_flight_delay) {
                Ok(attempt) => Enter::Proceed(RecordTicket { key, attempt }),
                Err(stop) => Enter::Stop(stop),
            },
        )
    }

    async fn exit(&self, ticket: RecordTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        let RecordTicket { key, attempt } = ticket;
        let settled = if outcome.is_settled() {
            self.store.succeed(&key, attempt).await
        } else {
            self.store.fail(&key, attempt, &outcome.to_string()).await
        };
        // The outcome stands either way. Turning a processed delivery into a retry here
        // would only make the retry wait out the lease and run the handler again.
        match settled {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(%key, attempt, "record was taken over before this attempt settled (lease too short?)")
            }
            Err(error) => {
                tracing::warn!(%key, attempt, %error, "record store failed while settling; the record stays PROCESSING")
            }
        }
        Ok(outcome)
    }
}

/// The fencing token of the lock in front, if any: the record refuses to be taken over by
/// an older lock holder.
pub(crate) fn fencing_token(envelope: &Envelope) -> Option<u64> {
    envelope
        .extensions()
        .get::<LockLease>()
        .map(LockLease::fencing_token)
}
