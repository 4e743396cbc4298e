use super::layer::StateGuardLayer;
use super::store::StateStore;
use crate::dead_letter::DeadLetterReason;
use crate::envelope::Envelope;
use crate::error::StoreError;
use crate::outcome::{Outcome, RetryReason};
use crate::tier::{Enter, Tier, TierDecision};

/// What the state guard holds for one envelope: the transition it checked, committed after
/// the tiers behind applied the event.
#[derive(Debug)]
pub struct StateTicket {
    entity: String,
    current: Option<String>,
    target: String,
}

impl<St: StateStore> TierDecision for StateGuardLayer<St> {
    type Ticket = StateTicket;
    const TIER: Tier = Tier::StateGuard;

    async fn enter(&self, envelope: &mut Envelope) -> Result<Enter<StateTicket>, StoreError> {
        let read = |extractor: &crate::KeyExtractor, what: &str| {
            extractor
                .extract(envelope.delivery())
                .map(|value| value.to_string())
                .map_err(|error| {
                    Outcome::dead_letter(DeadLetterReason::InvalidKey, format!("{what}: {error}"))
                })
        };
        let (entity, target) = match (
            read(&self.entity, "entity id"),
            read(&self.target, "target state"),
        ) {
            (Ok(entity), Ok(target)) => (entity, target),
            (Err(dead), _) | (_, Err(dead)) => return Ok(Enter::Stop(dead)),
        };
        let current = self.store.current(&entity).await?;
        Ok(match self.machine.allows(current.as_deref(), &target) {
            Ok(true) => Enter::Proceed(StateTicket {
                entity,
                current,
                target,
            }),
            Ok(false) => Enter::Stop(Outcome::Stale { current, target }),
            Err(error) => Enter::Stop(Outcome::dead_letter(
                DeadLetterReason::UnknownState,
                format!("entity {entity}: {error}"),
            )),
        })
    }

    async fn exit(&self, ticket: StateTicket, outcome: Outcome) -> Result<Outcome, StoreError> {
        if !matches!(outcome, Outcome::Processed | Outcome::Duplicate { .. }) {
            return Ok(outcome);
        }
        let StateTicket {
            entity,
            current,
            target,
        } = ticket;
        if self
            .store
            .compare_and_set(&entity, current.as_deref(), &target)
            .await?
        {
            return Ok(outcome);
        }
        Ok(Outcome::retry_later(
            RetryReason::Conflict(Tier::StateGuard),
            format!("entity {entity} changed state while this event was handled"),
            None,
        ))
    }
}
