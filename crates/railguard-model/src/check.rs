//! Running the checker, and showing what it found in a form a person can follow.
//!
//! Breadth-first search visits states in order of depth, so the first counterexample it finds
//! is a shortest one. With one thread the search is also deterministic: the same trace every
//! run, which is what `docs/protocol.md` quotes. The correct models are explored to the end
//! with every thread available.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model, Path};

use crate::lock::GrantStatus;
use crate::model::{Action, FencingModel, ProtocolState};
use crate::network::Msg;
use crate::proxy::{Entry, Stage};
use crate::worker::Phase;

/// What one run of the checker found.
pub struct Outcome {
    pub model: FencingModel,
    pub unique_states: usize,
    pub max_depth: usize,
    pub elapsed: Duration,
    /// Every property with a discovery: a counterexample for an `always`, an example for a
    /// `sometimes`.
    pub discoveries: BTreeMap<&'static str, Path<ProtocolState, Action>>,
}

/// Explores `model` breadth-first, on `threads` threads; stops early once `stop_at` (a
/// property name) has a discovery, else explores every reachable state.
pub fn run(model: FencingModel, threads: usize, stop_at: Option<&'static str>) -> Outcome {
    let model = model.for_new_run();
    let started = Instant::now();
    let mut builder = model.clone().checker().threads(threads);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf([name].into_iter().collect()));
    }
    let checker = builder.spawn_bfs().join();
    let discoveries: BTreeMap<_, _> = checker.discoveries().into_iter().collect();
    Outcome {
        model,
        unique_states: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        elapsed: started.elapsed(),
        discoveries,
    }
}

impl Outcome {
    /// The `always` properties that have a counterexample.
    pub fn violations(&self) -> Vec<&'static str> {
        self.model
            .properties()
            .iter()
            .filter(|p| p.expectation == stateright::Expectation::Always)
            .map(|p| p.name)
            .filter(|name| self.discoveries.contains_key(name))
            .collect()
    }

    /// The `sometimes` properties never reached.
    pub fn unreached(&self) -> Vec<&'static str> {
        self.model
            .properties()
            .iter()
            .filter(|p| p.expectation == stateright::Expectation::Sometimes)
            .map(|p| p.name)
            .filter(|name| !self.discoveries.contains_key(name))
            .collect()
    }

    /// The trace of `property`'s discovery, rendered, if there is one.
    pub fn trace(&self, property: &str) -> Option<String> {
        self.discoveries
            .get(property)
            .map(|path| render(&self.model, path))
    }

    /// One line: what was checked and how big it was.
    pub fn summary(&self) -> String {
        format!(
            "{} {}: {} unique states, depth {}, {:.1?} ({})",
            self.model.backend,
            self.model
                .variant
                .map_or("as designed".to_string(), |v| format!("variant `{v}`")),
            self.unique_states,
            self.max_depth,
            self.elapsed,
            self.model.bounds
        )
    }
}

/// A path of `model` as numbered steps, each with what it changed that matters.
pub fn render(model: &FencingModel, path: &Path<ProtocolState, Action>) -> String {
    let steps = path.clone().into_vec();
    let mut out = String::new();
    for (i, window) in steps.windows(2).enumerate() {
        let (before, action) = &window[0];
        let (after, _) = &window[1];
        let action = action
            .as_ref()
            .expect("every step but the last has an action");
        let _ = write!(out, "{:>3}. {action}", i + 1);
        let notes = effects(model, action, before, after);
        if !notes.is_empty() {
            let _ = write!(out, "  → {}", notes.join("; "));
        }
        out.push('\n');
    }
    out
}

/// What a step did, found by comparing the states before and after it.
fn effects(
    model: &FencingModel,
    action: &Action,
    before: &ProtocolState,
    after: &ProtocolState,
) -> Vec<String> {
    let mut notes = Vec::new();
    for (g, grant) in after.lock.grants.iter().enumerate() {
        match before.lock.grants.get(g) {
            None => notes.push(format!(
                "grant g{} of account {} to W{}, token {}{}",
                g + 1,
                (b'A' + grant.key) as char,
                grant.worker + 1,
                grant.token,
                if grant.took_over {
                    " (took over an expired lease)"
                } else {
                    ""
                }
            )),
            Some(old) if old.status != grant.status => match grant.status {
                GrantStatus::Released => notes.push(format!("g{} released", g + 1)),
                GrantStatus::Ended => notes.push(format!("g{} ended", g + 1)),
                GrantStatus::Live | GrantStatus::Expired => {}
            },
            Some(_) => {}
        }
    }
    for (w, (old, new)) in before.workers.iter().zip(&after.workers).enumerate() {
        if old.phase == new.phase {
            continue;
        }
        match new.phase {
            Phase::Drawn { token } => notes.push(format!("drew {token}")),
            Phase::Idle if matches!(action, Action::PostgresGoesBack) => {
                notes.push(format!(
                    "W{}'s acquire statement dies with its server",
                    w + 1
                ));
            }
            Phase::Idle if matches!(old.phase, Phase::Drawn { .. }) => {
                notes.push(format!("W{} finds the key held or its draw stale", w + 1));
            }
            Phase::Idle if !matches!(action, Action::Claim { .. } | Action::Complete(_)) => {
                notes.push(format!("W{} stops", w + 1))
            }
            _ => {}
        }
    }
    if let Action::Claim { worker: w, .. } | Action::Complete(w) = action {
        let worker = &after.workers[*w as usize];
        let row = &after.paydb.accounts[worker.account as usize];
        match worker.phase {
            Phase::Claimed { payment, .. } | Phase::Paid { payment, .. } => notes.push(format!(
                "paydb UPDATE with token {} matched: payment {} {:?}",
                row.fence,
                payment + 1,
                row.payments[payment as usize]
            )),
            Phase::Completed { .. } => notes.push(format!(
                "paydb UPDATE with token {} matched: payment done",
                row.fence
            )),
            _ => notes.push(format!(
                "paydb UPDATE matched 0 rows (fence {}): fenced out",
                row.fence
            )),
        }
    }
    for arrival in after.rail.arrivals.iter().skip(before.rail.arrivals.len()) {
        notes.push(format!(
            "RAIL RECORDS account {} payment {} token {} from grant g{}",
            (b'A' + arrival.account) as char,
            arrival.payment + 1,
            arrival.token,
            arrival.grant + 1
        ));
    }
    if let Action::Acquire(w) = action
        && after.lock.grants.len() == before.lock.grants.len()
    {
        notes.push(format!(
            "W{}'s grant WITHDRAWN: its token is not above account {}'s lock_issued {} \
             (etcd went back)",
            w + 1,
            (b'A' + after.workers[*w as usize].account) as char,
            before.epoch.issued[after.workers[*w as usize].account as usize]
        ));
    }
    if matches!(action, Action::PostgresGoesBack) {
        notes.push(format!(
            "sequence at {}, records {:?}{}",
            after.lock.sequence(),
            after.fence.records,
            if after.past.lost_records.is_empty() {
                String::new()
            } else {
                format!(", records LOST {:?}", after.past.lost_records)
            }
        ));
    }
    if matches!(action, Action::EtcdRestored) {
        notes.push(format!("revision back to {}", after.lock.revision()));
    }
    if before.epoch.floor != after.epoch.floor {
        notes.push(format!("FLOOR raised to {}", after.epoch.floor));
    }
    if before.fence.marks != after.fence.marks {
        notes.push(format!("marks {:?}", after.fence.marks));
    }
    if let Action::Start(task) = action
        && let Some(waiting) =
            after.fence.tasks.iter().find(|t| {
                t.stage == Stage::HandingOver && (t.proxy, t.seq) == (task.proxy, task.seq)
            })
        && task.stage != Stage::HandingOver
    {
        if !waiting.awaits.is_empty() {
            notes.push(format!(
                "waits for {} to settle",
                entry_list(&waiting.awaits)
            ));
        }
        if let Some(change) = &after.epoch.changed
            && after
                .fence
                .held(model.rules(), &after.network, Some(change), waiting)
        {
            notes.push(format!(
                "held after the store change: a forward of a token below the floor {} may still \
                 reach the rail",
                change.floor
            ));
        }
    }
    if before.fence.entries != after.fence.entries {
        let rows: Vec<String> = after
            .fence
            .entries
            .iter()
            .enumerate()
            .map(|(a, row)| format!("{} [{}]", (b'A' + a as u8) as char, entry_list(row)))
            .collect();
        notes.push(format!("handover entries {}", rows.join(", ")));
    }
    for msg in sent(before, after) {
        if !matches!(msg, Msg::RailAnswer { .. }) {
            notes.push(format!("sends {msg}"));
        }
    }
    notes
}

/// Handover entries as `P1.1 P2.3`.
fn entry_list(entries: &[Entry]) -> String {
    entries
        .iter()
        .map(|e| format!("P{}.{}", e.proxy + 1, e.seq))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Messages in flight after a step that were not before it.
fn sent<'a>(before: &ProtocolState, after: &'a ProtocolState) -> Vec<&'a Msg> {
    let mut old = before.network.in_flight.clone();
    let mut new = Vec::new();
    for msg in &after.network.in_flight {
        match old.iter().position(|m| m == msg) {
            Some(at) => {
                old.remove(at);
            }
            None => new.push(msg),
        }
    }
    new
}
