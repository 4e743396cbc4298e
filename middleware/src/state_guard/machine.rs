use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::error::{ConfigError, InputError};

/// The declared states of an entity and the transitions allowed between them.
///
/// Cheap to clone. Built with [`StateMachine::forward_only`] for a lifecycle whose events
/// may be skipped but never go back, or with [`StateMachine::builder`] for any graph.
#[derive(Clone, Debug)]
pub struct StateMachine(Arc<Graph>);

#[derive(Debug)]
struct Graph {
    index: HashMap<String, usize>,
    initial: HashSet<usize>,
    allowed: HashSet<(usize, usize)>,
}

impl StateMachine {
    /// A lifecycle in order, e.g. `Created → Assigned → Departed → Arrived → PickedUp →
    /// Completed`: every state may move to any *later* one (missed events are skipped), never
    /// to itself or an earlier one, and an entity with no state may start at any state. Out
    /// of order events are then applied only when they move the entity forward; the others
    /// are stale.
    pub fn forward_only<I, S>(states: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let states: Vec<String> = states.into_iter().map(Into::into).collect();
        let mut builder = StateMachine::builder();
        for (position, from) in states.iter().enumerate() {
            builder = builder.initial(from.clone());
            for to in &states[position + 1..] {
                builder = builder.allow(from.clone(), to.clone());
            }
        }
        builder.build()
    }

    /// A builder for an arbitrary transition graph.
    pub fn builder() -> StateMachineBuilder {
        StateMachineBuilder::default()
    }

    /// Whether an entity in `current` (`None`: no state yet) may move to `target`.
    ///
    /// Errors with [`InputError::UnknownState`] when `target`, or a stored `current`, is not a
    /// declared state.
    pub fn allows(&self, current: Option<&str>, target: &str) -> Result<bool, InputError> {
        let position = |state: &str| {
            self.0
                .index
                .get(state)
                .copied()
                .ok_or_else(|| InputError::UnknownState {
                    state: state.to_owned(),
                })
        };
        let to = position(target)?;
        Ok(match current {
            None => self.0.initial.contains(&to),
            Some(current) => self.0.allowed.contains(&(position(current)?, to)),
        })
    }
}

/// Builds a [`StateMachine`] from explicit transitions.
///
/// ```
/// use oncely::state_guard::StateMachine;
///
/// let payment = StateMachine::builder()
///     .initial("UNPAID")
///     .allow("UNPAID", "PAID")
///     .allow("UNPAID", "CANCELLED")
///     .allow("PAID", "REFUNDED")
///     .build()
///     .unwrap();
/// assert!(payment.allows(Some("UNPAID"), "PAID").unwrap());
/// assert!(!payment.allows(Some("PAID"), "UNPAID").unwrap());
/// ```
#[derive(Clone, Debug, Default)]
pub struct StateMachineBuilder {
    states: Vec<String>,
    initial: Vec<String>,
    transitions: Vec<(String, String)>,
}

impl StateMachineBuilder {
    /// Declares a state (states named by `initial` and `allow` are declared already).
    pub fn state(mut self, state: impl Into<String>) -> Self {
        self.states.push(state.into());
        self
    }

    /// Allows an entity with no state to start at `state`.
    pub fn initial(mut self, state: impl Into<String>) -> Self {
        let state = state.into();
        self.states.push(state.clone());
        self.initial.push(state);
        self
    }

    /// Allows the transition `from → to`.
    pub fn allow(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        let (from, to) = (from.into(), to.into());
        self.states.push(from.clone());
        self.states.push(to.clone());
        self.transitions.push((from, to));
        self
    }

    /// The machine; [`ConfigError::InvalidStateMachine`] when it has no states, no initial state,
    /// or an empty state name.
    pub fn build(self) -> Result<StateMachine, ConfigError> {
        let invalid = |reason: &str| ConfigError::InvalidStateMachine {
            reason: reason.to_owned(),
        };
        if self.states.is_empty() {
            return Err(invalid("no states"));
        }
        if self.initial.is_empty() {
            return Err(invalid(
                "no initial state: no entity could ever enter the machine",
            ));
        }
        if self.states.iter().any(String::is_empty) {
            return Err(invalid("empty state name"));
        }
        let mut index = HashMap::new();
        for state in self.states {
            let next = index.len();
            index.entry(state).or_insert(next);
        }
        let initial = self.initial.iter().map(|state| index[state]).collect();
        let allowed = self
            .transitions
            .iter()
            .map(|(from, to)| (index[from], index[to]))
            .collect();
        Ok(StateMachine(Arc::new(Graph {
            index,
            initial,
            allowed,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIFECYCLE: &str = "Created Assigned Departed Arrived PickedUp Completed";

    #[test]
    fn forward_only_allows_later_states_only() {
        let machine = StateMachine::forward_only(LIFECYCLE.split(' ')).unwrap();
        assert!(machine.allows(None, "Departed").unwrap());
        assert!(machine.allows(Some("Created"), "Assigned").unwrap());
        assert!(machine.allows(Some("Assigned"), "Arrived").unwrap());
        assert!(!machine.allows(Some("Arrived"), "Departed").unwrap());
        assert!(!machine.allows(Some("Arrived"), "Arrived").unwrap());
    }

    #[test]
    fn unknown_states_are_errors_not_stale() {
        let machine = StateMachine::forward_only(LIFECYCLE.split(' ')).unwrap();
        assert!(matches!(
            machine.allows(Some("Created"), "Teleported"),
            Err(InputError::UnknownState { .. })
        ));
        assert!(matches!(
            machine.allows(Some("Lost"), "Arrived"),
            Err(InputError::UnknownState { .. })
        ));
    }

    #[test]
    fn invalid_machines_are_config_errors() {
        let no_states: [&str; 0] = [];
        assert!(StateMachine::forward_only(no_states).is_err());
        assert!(matches!(
            StateMachine::builder().allow("a", "b").build(),
            Err(ConfigError::InvalidStateMachine { .. })
        ));
        assert!(StateMachine::forward_only(["a", ""]).is_err());
        assert!(
            StateMachine::forward_only(["only"])
                .unwrap()
                .allows(None, "only")
                .unwrap()
        );
    }
}
