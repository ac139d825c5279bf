//! Running the checker: breadth-first over every state within the bounds, so a
//! counterexample found is a shortest one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use std::collections::BTreeSet;

use stateright::{Checker, HasDiscoveries, Model};

use crate::model::{Action, LeaseModel};
use crate::state::State;

/// What one search found.
#[derive(Debug)]
pub struct Outcome {
    /// Distinct states explored.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// The longest path explored, in events.
    pub max_depth: usize,
    pub elapsed: Duration,
    /// Per property with a discovery: the path to it (a counterexample for a safety
    /// property, an example for a reachability one).
    pub discoveries: BTreeMap<&'static str, Vec<(State, Option<Action>)>>,
}

impl Outcome {
    /// The search's figures: the bounds, states explored, depth, time, and each property's
    /// result.
    pub fn report(&self, m: &LeaseModel, scenario: &str) -> String {
        let mut out = format!(
            "{scenario}{}\n  bounds: {}\n  explored {} states ({} generated), depth {}, in {:.1} s\n",
            m.mutant.map_or(String::new(), |g| format!(", {g:?} off")),
            m.bounds,
            self.unique_states,
            self.states,
            self.max_depth,
            self.elapsed.as_secs_f64()
        );
        for p in m.properties() {
            let found = self.discoveries.contains_key(p.name);
            let verdict = match (p.expectation.discovery_is_failure(), found) {
                (true, false) => format!("holds in all {} states", self.unique_states),
                (true, true) => "BROKEN".to_string(),
                (false, true) => "reached".to_string(),
                (false, false) => "not reached".to_string(),
            };
            out.push_str(&format!("  {}: {verdict}\n", p.name));
        }
        out
    }

    /// The safety and liveness properties that failed.
    pub fn failures(&self, m: &LeaseModel) -> Vec<&'static str> {
        m.properties()
            .iter()
            .filter(|p| p.expectation.discovery_is_failure())
            .map(|p| p.name)
            .filter(|name| self.discoveries.contains_key(name))
            .collect()
    }
}

/// Searches every state of `m` within its bounds; with `stop_at`, only until that property
/// fails (the mutants' searches).
pub fn search(m: &LeaseModel, stop_at: Option<&'static str>) -> Outcome {
    let started = Instant::now();
    let mut builder = m.clone().checker();
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    let checker = builder.spawn_bfs().join();
    let discoveries = checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| (name, path.into_vec()))
        .collect();
    Outcome {
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed: started.elapsed(),
        discoveries,
    }
}

/// Replays `actions` from the initial state: the states after each, or `None` if one is not
/// enabled where it comes.
pub fn replay(m: &LeaseModel, actions: &[Action]) -> Option<Vec<State>> {
    let mut states = m.init_states();
    for &a in actions {
        let next = m.next_state(states.last()?, a)?;
        states.push(next);
    }
    Some(states)
}

/// A short counterexample to the safety property `name` from a discovered one: cut at the
/// first state that breaks it, then events dropped one at a time (and a duplicate turned into
/// a plain delivery) for as long as the rest still replays and still breaks it. (Stateright
/// keeps the last discovery its search block made, not the shortest.)
pub fn shrink(m: &LeaseModel, name: &'static str, path: &[(State, Option<Action>)]) -> Vec<Action> {
    let property = m.property(name);
    let holds = |s: &State| (property.condition)(m, s);
    let first_break = |actions: &[Action]| -> Option<usize> {
        replay(m, actions)?.iter().position(|s| !holds(s))
    };
    let mut actions: Vec<Action> = path.iter().filter_map(|(_, a)| *a).collect();
    let cut = first_break(&actions).expect("the discovery breaks the property");
    actions.truncate(cut);
    let mut i = 0;
    while i < actions.len() {
        let mut fewer = actions.clone();
        fewer.remove(i);
        let mut plainer = actions.clone();
        if let Action::Duplicate(m) = plainer[i] {
            plainer[i] = Action::Deliver(m);
        }
        let simpler = [fewer, plainer]
            .into_iter()
            .filter(|candidate| *candidate != actions)
            .find_map(|mut candidate| {
                let at = first_break(&candidate)?;
                candidate.truncate(at);
                Some(candidate)
            });
        match simpler {
            Some(candidate) => {
                actions = candidate;
                i = 0;
            }
            None => i += 1,
        }
    }
    actions
}
