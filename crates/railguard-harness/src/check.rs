//! The checker: the invariants, judged from what the stores themselves recorded.
//!
//! It trusts no component under test. Its inputs are the workers' history (what each worker
//! did, under which of its own grants), the rail simulator's ledger (what reached the rail, in
//! arrival order), and paydb's write log (every UPDATE of an account row, in the order the row
//! lock serialised them, written by a trigger). It never asks railguard anything.
//!
//! - **INV-02**: no payment id appears twice in the rail's ledger.
//! - **INV-04**: per key, grant tokens are distinct and follow real time: a grant whose acquire
//!   returned before another's was sent has the smaller token.
//! - **INV-05**: per account, in the rail's arrival order, no request of a grant arrives after a
//!   request of a newer grant of that key; the same in paydb's write order. A request is judged
//!   by the grant that sent it (the worker's own token), not by the token it presented — which
//!   is how the `reread` control's bug is seen.
//! - **INV-06**: per key, a grant is not made while the previous grant is still unexpired and
//!   unreleased in the lock service's own words: its `granted_at` falls before the previous
//!   grant's reported `expires_at` and before that grant's release was even sent. The reported
//!   expiry is the grant's first (renewals only extend it), so this check can miss an overlap
//!   but never invents one.
//!
//! Payments never completed are reported as liveness, not as violations: a payment left in
//! doubt by a fault is safe and stuck until an operator resolves it.

use std::collections::{BTreeMap, HashMap};

use railguard::railsim::LedgerEntry;
use serde::{Deserialize, Serialize};

use crate::history::{Event, Op, Phase, parse_submit_path};

/// One UPDATE of a paydb account row, as the trigger logged it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountWrite {
    pub seq: i64,
    pub account: String,
    /// The token the UPDATE presented (the row's new fence).
    pub fence: i64,
    /// The writer's own grant token, as the worker declared it.
    pub grant_token: Option<i64>,
    pub attempt: Option<String>,
}

/// A payment row at the end of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRow {
    pub id: String,
    pub account: String,
    pub state: String,
    pub attempts: i32,
}

/// A fault the coordinator injected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRecord {
    pub kind: String,
    pub target: String,
    pub start_us: i64,
    pub end_us: i64,
}

/// Everything a check reads.
#[derive(Debug, Default)]
pub struct Inputs {
    pub history: Vec<Event>,
    pub ledger: Vec<LedgerEntry>,
    pub account_writes: Vec<AccountWrite>,
    pub payments: Vec<PaymentRow>,
    pub faults: Vec<FaultRecord>,
    /// `lock_fenced_out_total` summed over the proxies, when their metrics were saved.
    pub fenced_out_metric: Option<f64>,
    /// The payments railguard holds in doubt at the end of the run, when they were counted.
    pub in_doubt_at_end: Option<InDoubtAtEnd>,
    /// History lines that could not be read (a worker killed while writing one).
    pub torn_lines: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Invariant {
    #[serde(rename = "INV-02")]
    Inv02,
    #[serde(rename = "INV-04")]
    Inv04,
    #[serde(rename = "INV-05")]
    Inv05,
    #[serde(rename = "INV-06")]
    Inv06,
}

impl Invariant {
    pub fn name(self) -> &'static str {
        match self {
            Invariant::Inv02 => "INV-02",
            Invariant::Inv04 => "INV-04",
            Invariant::Inv05 => "INV-05",
            Invariant::Inv06 => "INV-06",
        }
    }

    pub const ALL: [Invariant; 4] = [
        Invariant::Inv02,
        Invariant::Inv04,
        Invariant::Inv05,
        Invariant::Inv06,
    ];
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    pub invariant: Invariant,
    pub message: String,
    /// The offending entries, as they appear in their files.
    pub evidence: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub payments: usize,
    pub completed: usize,
    pub never_completed: usize,
    pub submits: usize,
    pub submits_ok: usize,
    pub fenced_out: usize,
    pub in_doubt: usize,
    /// Submits answered `409 in_doubt`: each waits for the rail's lookup or an operator.
    #[serde(default)]
    pub in_doubt_answers: usize,
    /// Payments left `submitting` at the end whose last submit was answered `409 in_doubt`:
    /// left in doubt, for an operator.
    #[serde(default)]
    pub left_in_doubt: usize,
    pub retried_payments: usize,
    pub claims_fenced: usize,
    pub grants: usize,
    pub leases_lost: usize,
    pub rail_entries: usize,
    /// Rail arrivals of a grant older than one already seen at the rail on the same account
    /// (each an INV-05 violation at the rail).
    #[serde(default)]
    pub stale_arrivals: usize,
    pub unattributed_rail_entries: usize,
    pub torn_history_lines: usize,
    /// The operator's in-doubt procedure (`--operator-forgets`): records in doubt it took up,
    /// forgot, left in doubt because the rail had the payment, and forgets railguard refused.
    #[serde(default)]
    pub in_doubt_records_taken_up: usize,
    #[serde(default)]
    pub forgotten: usize,
    #[serde(default)]
    pub paid_per_the_rail: usize,
    #[serde(default)]
    pub forgets_refused: usize,
}

impl Counts {
    /// Stale arrivals per 1,000 rail ledger entries.
    pub fn stale_per_thousand(&self) -> f64 {
        if self.rail_entries == 0 {
            0.0
        } else {
            self.stale_arrivals as f64 * 1000.0 / self.rail_entries as f64
        }
    }
}

/// Idempotency records in doubt in railguard's PostgreSQL at the end of the run (each a payment
/// whose retries get `409 in_doubt`), and the records the rail's lookup completed (the rail had
/// the payment) or forgot (it had not, and nothing sent could still reach it), from railguard's
/// audit records (`--rail-lookup`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InDoubtAtEnd {
    pub records: usize,
    pub paid_per_the_rail: usize,
    pub not_on_the_rail: usize,
    /// Retries whose first attempt's record went back with the store, let through as the key's
    /// first request once the rail's lookup found no such payment.
    #[serde(default)]
    pub first_requests_after_store_change: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub counts: Counts,
    pub fenced_out_metric: Option<f64>,
    #[serde(default)]
    pub in_doubt_at_end: Option<InDoubtAtEnd>,
    pub faults: BTreeMap<String, usize>,
    pub violations_by_invariant: BTreeMap<String, usize>,
    pub violations: Vec<Violation>,
    /// Up to ten payments that never completed, for liveness.
    pub never_completed_sample: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// The table a person reads at the end of a run.
    pub fn table(&self) -> String {
        let c = &self.counts;
        let mut out = String::new();
        let mut row = |name: &str, value: String| {
            out.push_str(&format!("  {name:<38} {value:>10}\n"));
        };
        row("payments", c.payments.to_string());
        row("  completed", c.completed.to_string());
        row(
            "  never completed (liveness)",
            c.never_completed.to_string(),
        );
        row("grants", c.grants.to_string());
        row("leases lost (keep-alive)", c.leases_lost.to_string());
        row("submits attempted", c.submits.to_string());
        row("  answered by the rail", c.submits_ok.to_string());
        row("  fenced out (409 fenced_out)", c.fenced_out.to_string());
        row("  outcome unknown (in doubt)", c.in_doubt.to_string());
        row("    of them 409 in_doubt", c.in_doubt_answers.to_string());
        row("payments left 409 in_doubt", c.left_in_doubt.to_string());
        row("payments retried", c.retried_payments.to_string());
        row("paydb claims fenced out", c.claims_fenced.to_string());
        if let Some(m) = self.fenced_out_metric {
            row("lock_fenced_out_total (proxies)", format!("{m}"));
        }
        if let Some(end) = self.in_doubt_at_end {
            row("records in doubt at the end", end.records.to_string());
            row(
                "  lookup: paid on the rail",
                end.paid_per_the_rail.to_string(),
            );
            row("  lookup: not on the rail", end.not_on_the_rail.to_string());
            row(
                "  lookup: gone back, not on the rail",
                end.first_requests_after_store_change.to_string(),
            );
        }
        row("rail ledger entries", c.rail_entries.to_string());
        row(
            "  stale arrivals (per 1,000 entries)",
            format!("{} ({:.1})", c.stale_arrivals, c.stale_per_thousand()),
        );
        if c.unattributed_rail_entries > 0 {
            row(
                "  not sent by a worker",
                c.unattributed_rail_entries.to_string(),
            );
        }
        if c.torn_history_lines > 0 {
            row("torn history lines", c.torn_history_lines.to_string());
        }
        if c.in_doubt_records_taken_up > 0 {
            row(
                "records in doubt (operator)",
                c.in_doubt_records_taken_up.to_string(),
            );
            row("  forgotten", c.forgotten.to_string());
            row(
                "  paid per the rail, left in doubt",
                c.paid_per_the_rail.to_string(),
            );
            row("  forgets refused", c.forgets_refused.to_string());
        }
        out.push_str("  faults injected\n");
        if self.faults.is_empty() {
            out.push_str("    none\n");
        }
        for (kind, n) in &self.faults {
            out.push_str(&format!("    {kind:<36} {n:>10}\n"));
        }
        out.push_str("  violations\n");
        for inv in Invariant::ALL {
            let n = self.violations_by_invariant.get(inv.name()).unwrap_or(&0);
            out.push_str(&format!("    {:<36} {n:>10}\n", inv.name()));
        }
        for v in self.violations.iter().take(10) {
            out.push_str(&format!("  {}: {}\n", v.invariant.name(), v.message));
            for e in v.evidence.iter().take(4) {
                out.push_str(&format!("      {e}\n"));
            }
        }
        if self.violations.len() > 10 {
            out.push_str(&format!(
                "  ... and {} more (report.json)\n",
                self.violations.len() - 10
            ));
        }
        out
    }
}

/// Who sent a submit: its worker, payment and own grant token.
#[derive(Debug, Clone)]
struct Sender {
    token: Option<i64>,
    line: String,
}

pub fn check(inputs: &Inputs) -> Report {
    let mut violations = Vec::new();
    let senders = senders(&inputs.history);
    inv02(&inputs.ledger, &mut violations);
    inv04(&inputs.history, &mut violations);
    let stale_arrivals = inv05_rail(&inputs.ledger, &senders, &mut violations);
    inv05_answers(&inputs.history, &mut violations);
    inv05_paydb(&inputs.account_writes, &mut violations);
    inv06(&inputs.history, &mut violations);

    let mut report = Report {
        counts: counts(inputs, &senders, stale_arrivals),
        fenced_out_metric: inputs.fenced_out_metric,
        in_doubt_at_end: inputs.in_doubt_at_end,
        ..Report::default()
    };
    for f in &inputs.faults {
        *report.faults.entry(f.kind.clone()).or_default() += 1;
    }
    for v in &violations {
        *report
            .violations_by_invariant
            .entry(v.invariant.name().to_string())
            .or_default() += 1;
    }
    report.never_completed_sample = inputs
        .payments
        .iter()
        .filter(|p| p.state != "done")
        .take(10)
        .map(|p| format!("{} ({}, {} attempts)", p.id, p.state, p.attempts))
        .collect();
    report.violations = violations;
    report
}

fn senders(history: &[Event]) -> HashMap<String, Sender> {
    history
        .iter()
        .filter(|e| e.op == Op::Submit && e.phase == Phase::Invoke)
        .filter_map(|e| {
            let attempt = e.attempt.clone()?;
            Some((
                attempt,
                Sender {
                    token: e.token,
                    line: line(e),
                },
            ))
        })
        .collect()
}

fn line(e: &Event) -> String {
    serde_json::to_string(e).unwrap_or_default()
}

fn ledger_line(e: &LedgerEntry) -> String {
    format!(
        "rail seq {} path {} account {} token {} key {}",
        e.seq,
        e.path,
        e.account.as_deref().unwrap_or("-"),
        e.token.as_deref().unwrap_or("-"),
        e.idempotency_key.as_deref().unwrap_or("-")
    )
}

fn inv02(ledger: &[LedgerEntry], violations: &mut Vec<Violation>) {
    let mut by_payment: BTreeMap<&str, Vec<&LedgerEntry>> = BTreeMap::new();
    for e in ledger {
        if let Some((payment, _)) = parse_submit_path(&e.path) {
            by_payment.entry(payment).or_default().push(e);
        }
    }
    for (payment, entries) in by_payment {
        if entries.len() > 1 {
            violations.push(Violation {
                invariant: Invariant::Inv02,
                message: format!("payment {payment} reached the rail {} times", entries.len()),
                evidence: entries.iter().map(|e| ledger_line(e)).collect(),
            });
        }
    }
}

fn inv04(history: &[Event], violations: &mut Vec<Violation>) {
    // Per key: (invoke time, ok time, token, line) of every acquire that returned a grant.
    let mut invokes: HashMap<(u32, &str), i64> = HashMap::new();
    let mut grants: BTreeMap<&str, Vec<(i64, i64, i64, String)>> = BTreeMap::new();
    for e in history.iter().filter(|e| e.op == Op::Acquire) {
        match e.phase {
            Phase::Invoke => {
                invokes.insert((e.worker, e.account.as_str()), e.t_us);
            }
            Phase::Ok => {
                let (Some(token), Some(invoked)) =
                    (e.token, invokes.get(&(e.worker, e.account.as_str())))
                else {
                    continue;
                };
                grants.entry(e.account.as_str()).or_default().push((
                    *invoked,
                    e.t_us,
                    token,
                    line(e),
                ));
            }
            _ => {}
        }
    }
    for (key, mut list) in grants {
        let mut seen: HashMap<i64, &str> = HashMap::new();
        for (_, _, token, l) in &list {
            if let Some(first) = seen.insert(*token, l) {
                violations.push(Violation {
                    invariant: Invariant::Inv04,
                    message: format!("key {key}: token {token} was granted twice"),
                    evidence: vec![first.to_string(), l.clone()],
                });
            }
        }
        // A grant B must have a larger token than every grant whose acquire returned before
        // B's acquire was sent. Walk B by invoke time, keeping the largest token returned.
        let mut by_ok: Vec<(i64, i64, String)> = list
            .iter()
            .map(|(_, ok, t, l)| (*ok, *t, l.clone()))
            .collect();
        by_ok.sort_by_key(|(ok, ..)| *ok);
        list.sort_by_key(|(inv, ..)| *inv);
        let mut i = 0;
        let mut best: Option<(i64, String)> = None;
        for (invoked, _, token, l) in &list {
            while i < by_ok.len() && by_ok[i].0 < *invoked {
                if best.as_ref().is_none_or(|(t, _)| by_ok[i].1 > *t) {
                    best = Some((by_ok[i].1, by_ok[i].2.clone()));
                }
                i += 1;
            }
            if let Some((earlier, earlier_line)) = &best
                && token <= earlier
            {
                violations.push(Violation {
                    invariant: Invariant::Inv04,
                    message: format!(
                        "key {key}: grant with token {token} was requested after a grant with \
                         token {earlier} had been returned, and is not larger"
                    ),
                    evidence: vec![earlier_line.clone(), l.clone()],
                });
            }
        }
    }
}

/// Per account, in the rail's arrival order: the grant of each request must not be older
/// than the newest grant already seen at the rail for that account. Returns how many arrivals
/// were stale.
fn inv05_rail(
    ledger: &[LedgerEntry],
    senders: &HashMap<String, Sender>,
    violations: &mut Vec<Violation>,
) -> usize {
    let before = violations.len();
    let mut ordered: Vec<&LedgerEntry> = ledger.iter().collect();
    ordered.sort_by_key(|e| e.seq);
    let mut newest: HashMap<&str, (i64, &LedgerEntry)> = HashMap::new();
    for e in ordered {
        let (Some(account), Some((_, attempt))) =
            (e.account.as_deref(), parse_submit_path(&e.path))
        else {
            continue;
        };
        // A request no recorded submit sent (its line lost or torn) is judged by the token
        // the rail saw, so that failed attribution cannot hide a stale arrival.
        let grant = match senders.get(attempt).and_then(|s| s.token) {
            Some(grant) => grant,
            None => match e.token.as_deref().and_then(|t| t.parse().ok()) {
                Some(seen) => seen,
                None => continue,
            },
        };
        match newest.get(account) {
            Some((newer, newer_entry)) if grant < *newer => {
                violations.push(Violation {
                    invariant: Invariant::Inv05,
                    message: format!(
                        "account {account}: a request of grant {grant} reached the rail after a \
                         request of the newer grant {newer} had"
                    ),
                    evidence: vec![
                        ledger_line(newer_entry),
                        ledger_line(e),
                        senders
                            .get(attempt)
                            .map_or_else(|| "(no recorded submit)".into(), |s| s.line.clone()),
                    ],
                });
            }
            Some((newer, _)) if grant == *newer => {}
            _ => {
                newest.insert(account, (grant, e));
            }
        }
    }
    violations.len() - before
}

/// The fence's own answers: once a grant's submit on an account was answered by the rail, the
/// proxy's mark is at least that grant's token, so every later submit of an older grant must
/// be answered `409 fenced_out` (or refused before the fence, forwarding nothing). An older
/// grant's submit that got past the fence — answered by the rail, or refused only by the
/// idempotency layer (`422`, `409 in_flight`/`in_doubt`) — is a stale writer the fence let
/// through, even when the idempotency key kept it from the rail.
fn inv05_answers(history: &[Event], violations: &mut Vec<Violation>) {
    let mut invoked: HashMap<&str, &Event> = HashMap::new();
    // Per account: the newest grant whose submit the rail has answered, and that answer.
    let mut answered: HashMap<&str, (i64, &Event)> = HashMap::new();
    for e in history.iter().filter(|e| e.op == Op::Submit) {
        let Some(attempt) = e.attempt.as_deref() else {
            continue;
        };
        let Some(grant) = e.token else { continue };
        match e.phase {
            Phase::Invoke => {
                invoked.insert(attempt, e);
            }
            Phase::Ok | Phase::Fail | Phase::Info => {
                let Some(invoke) = invoked.get(attempt).copied() else {
                    continue;
                };
                let detail = e.detail.as_deref().unwrap_or("");
                let passed_the_fence = e.phase == Phase::Ok
                    || detail.starts_with("422")
                    || detail.contains("in_flight")
                    || detail.contains("in_doubt");
                if passed_the_fence
                    && let Some((newer, answer)) = answered.get(e.account.as_str())
                    && grant < *newer
                    && answer.t_us < invoke.t_us
                {
                    violations.push(Violation {
                        invariant: Invariant::Inv05,
                        message: format!(
                            "account {}: a submit of grant {grant} got past the fence ({}) \
                             after the rail had answered a submit of the newer grant {newer}",
                            e.account,
                            if detail.is_empty() {
                                "answered"
                            } else {
                                detail
                            }
                        ),
                        evidence: vec![line(answer), line(invoke), line(e)],
                    });
                }
                if e.phase == Phase::Ok
                    && answered
                        .get(e.account.as_str())
                        .is_none_or(|(t, _)| grant > *t)
                {
                    answered.insert(e.account.as_str(), (grant, e));
                }
            }
        }
    }
}

/// The same rule in paydb's own write order.
fn inv05_paydb(writes: &[AccountWrite], violations: &mut Vec<Violation>) {
    let mut ordered: Vec<&AccountWrite> = writes.iter().collect();
    ordered.sort_by_key(|w| w.seq);
    let mut newest: HashMap<&str, &AccountWrite> = HashMap::new();
    let show = |w: &AccountWrite| {
        format!(
            "paydb write seq {} account {} fence {} by grant {} ({})",
            w.seq,
            w.account,
            w.fence,
            w.grant_token.map_or("-".into(), |t| t.to_string()),
            w.attempt.as_deref().unwrap_or("-")
        )
    };
    for w in ordered {
        let Some(grant) = w.grant_token else { continue };
        match newest.get(w.account.as_str()) {
            Some(prev) if prev.grant_token.is_some_and(|p| grant < p) => {
                violations.push(Violation {
                    invariant: Invariant::Inv05,
                    message: format!(
                        "account {}: paydb moved on grant {grant} after the newer grant {} had \
                         written it",
                        w.account,
                        prev.grant_token.unwrap_or_default()
                    ),
                    evidence: vec![show(prev), show(w)],
                });
            }
            Some(prev) if prev.grant_token == Some(grant) => {}
            _ => {
                newest.insert(w.account.as_str(), w);
            }
        }
    }
}

fn inv06(history: &[Event], violations: &mut Vec<Violation>) {
    struct Grant<'a> {
        token: i64,
        granted: i64,
        expires: i64,
        released_before: Option<i64>,
        line: &'a Event,
    }
    let mut grants: BTreeMap<&str, Vec<Grant<'_>>> = BTreeMap::new();
    let mut release_invoked: HashMap<(&str, i64), i64> = HashMap::new();
    for e in history {
        match (e.op, e.phase) {
            (Op::Acquire, Phase::Ok) => {
                if let (Some(token), Some(granted), Some(expires)) =
                    (e.token, e.granted_at_us, e.expires_at_us)
                {
                    grants.entry(e.account.as_str()).or_default().push(Grant {
                        token,
                        granted,
                        expires,
                        released_before: None,
                        line: e,
                    });
                }
            }
            (Op::Release, Phase::Invoke) => {
                if let Some(token) = e.token {
                    release_invoked
                        .entry((e.account.as_str(), token))
                        .or_insert(e.t_us);
                }
            }
            _ => {}
        }
    }
    for (key, list) in grants.iter_mut() {
        for g in list.iter_mut() {
            g.released_before = release_invoked.get(&(*key, g.token)).copied();
        }
        list.sort_by_key(|g| g.token);
        for pair in list.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let end = a.released_before.map_or(a.expires, |r| r.min(a.expires));
            if b.granted < end {
                violations.push(Violation {
                    invariant: Invariant::Inv06,
                    message: format!(
                        "key {key}: grant {} was made {} µs before grant {} ended (its reported \
                         expiry, or its release request)",
                        b.token,
                        end - b.granted,
                        a.token
                    ),
                    evidence: vec![line(a.line), line(b.line)],
                });
            }
        }
    }
}

fn counts(inputs: &Inputs, senders: &HashMap<String, Sender>, stale_arrivals: usize) -> Counts {
    let h = &inputs.history;
    let of = |op: Op, phase: Phase| h.iter().filter(move |e| e.op == op && e.phase == phase);
    let mut submits_per_payment: HashMap<&str, usize> = HashMap::new();
    for e in of(Op::Submit, Phase::Invoke) {
        if let Some(p) = e.payment.as_deref() {
            *submits_per_payment.entry(p).or_default() += 1;
        }
    }
    let completed = inputs.payments.iter().filter(|p| p.state == "done").count();
    let in_doubt_answer = |e: &Event| {
        e.detail
            .as_deref()
            .is_some_and(|d| d.starts_with("409 in_doubt"))
    };
    // Each payment's last answered submit (a worker's notice that it pauses has no attempt).
    let mut last_answer: HashMap<&str, &Event> = HashMap::new();
    for e in h
        .iter()
        .filter(|e| e.op == Op::Submit && e.phase != Phase::Invoke && e.attempt.is_some())
    {
        if let Some(p) = e.payment.as_deref() {
            let last = last_answer.entry(p).or_insert(e);
            if e.t_us >= last.t_us {
                *last = e;
            }
        }
    }
    let left_in_doubt = inputs
        .payments
        .iter()
        .filter(|p| p.state == "submitting")
        .filter(|p| {
            last_answer
                .get(p.id.as_str())
                .is_some_and(|e| in_doubt_answer(e))
        })
        .count();
    Counts {
        payments: inputs.payments.len(),
        completed,
        never_completed: inputs.payments.len() - completed,
        submits: of(Op::Submit, Phase::Invoke).count(),
        submits_ok: of(Op::Submit, Phase::Ok).count(),
        fenced_out: of(Op::Submit, Phase::Fail)
            .filter(|e| e.detail.as_deref() == Some("fenced_out"))
            .count(),
        // Outcomes carry their submit's attempt; a worker's notice that it pauses does not.
        in_doubt: of(Op::Submit, Phase::Info)
            .filter(|e| e.attempt.is_some())
            .count(),
        in_doubt_answers: of(Op::Submit, Phase::Info)
            .filter(|e| in_doubt_answer(e))
            .count(),
        left_in_doubt,
        retried_payments: submits_per_payment.values().filter(|n| **n > 1).count(),
        claims_fenced: of(Op::Claim, Phase::Fail)
            .filter(|e| e.detail.as_deref() == Some("fenced_out"))
            .count(),
        grants: of(Op::Acquire, Phase::Ok).count(),
        leases_lost: of(Op::LeaseLost, Phase::Info).count(),
        rail_entries: inputs.ledger.len(),
        stale_arrivals,
        unattributed_rail_entries: inputs
            .ledger
            .iter()
            .filter(|e| {
                parse_submit_path(&e.path).is_none_or(|(_, attempt)| !senders.contains_key(attempt))
            })
            .count(),
        torn_history_lines: inputs.torn_lines,
        in_doubt_records_taken_up: of(Op::Forget, Phase::Invoke).count(),
        forgotten: of(Op::Forget, Phase::Ok).count(),
        paid_per_the_rail: of(Op::Forget, Phase::Fail)
            .filter(|e| e.detail.as_deref() == Some(crate::operator::PAID_ON_THE_RAIL))
            .count(),
        forgets_refused: of(Op::Forget, Phase::Fail)
            .filter(|e| {
                e.detail
                    .as_deref()
                    .is_some_and(|d| d.starts_with("refused"))
            })
            .count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::submit_path;

    fn ev(t: i64, worker: u32, op: Op, phase: Phase, token: Option<i64>) -> Event {
        let mut e = Event::new(worker, op, phase, "a1");
        e.t_us = t;
        e.token = token;
        e
    }

    fn grant(t0: i64, t1: i64, worker: u32, token: i64, expires: i64) -> Vec<Event> {
        let mut ok = ev(t1, worker, Op::Acquire, Phase::Ok, Some(token));
        ok.granted_at_us = Some(t1 - 1);
        ok.expires_at_us = Some(expires);
        vec![ev(t0, worker, Op::Acquire, Phase::Invoke, None), ok]
    }

    fn submit(t: i64, worker: u32, token: i64, payment: &str, attempt: &str) -> Event {
        ev(t, worker, Op::Submit, Phase::Invoke, Some(token))
            .payment(payment)
            .attempt(attempt)
    }

    fn arrival(seq: u64, token: i64, payment: &str, attempt: &str) -> LedgerEntry {
        LedgerEntry {
            seq,
            method: "POST".into(),
            path: submit_path(payment, attempt),
            account: Some("a1".into()),
            token: Some(token.to_string()),
            idempotency_key: Some(payment.into()),
            body_sha256: String::new(),
            forwarded_for: None,
            headers: Vec::new(),
            received_unix_ms: 0,
        }
    }

    fn write(seq: i64, fence: i64, grant: i64) -> AccountWrite {
        AccountWrite {
            seq,
            account: "a1".into(),
            fence,
            grant_token: Some(grant),
            attempt: None,
        }
    }

    /// The T-042 run done right: W1 (5) stalls, W2 (9) takes over and pays p2, W1's p1 is
    /// fenced out and never reaches the rail.
    fn t042_history() -> Inputs {
        let mut history = grant(0, 10, 1, 5, 1_000);
        history.extend(grant(1_100, 1_110, 2, 9, 3_000));
        history.push(submit(1_200, 2, 9, "p2", "w2-1"));
        history.push(submit(1_300, 1, 5, "p1", "w1-1"));
        Inputs {
            history,
            ledger: vec![arrival(1, 9, "p2", "w2-1")],
            account_writes: vec![write(1, 5, 5), write(2, 9, 9)],
            ..Inputs::default()
        }
    }

    #[test]
    fn a_correct_run_has_no_violation() {
        let report = check(&t042_history());
        assert!(report.ok(), "{:#?}", report.violations);
        assert_eq!(report.counts.stale_arrivals, 0);
    }

    #[test]
    fn a_payment_twice_at_the_rail_is_inv02() {
        let mut inputs = t042_history();
        inputs.ledger.push(arrival(2, 9, "p2", "w2-2"));
        inputs.history.push(submit(1_400, 2, 9, "p2", "w2-2"));
        let report = check(&inputs);
        assert_eq!(report.violations.len(), 1, "{:#?}", report.violations);
        assert_eq!(report.violations[0].invariant, Invariant::Inv02);
    }

    #[test]
    fn a_stale_grant_at_the_rail_after_a_newer_one_is_inv05() {
        let mut inputs = t042_history();
        inputs.ledger.push(arrival(2, 5, "p1", "w1-1")); // the kill switch let it through
        let report = check(&inputs);
        assert_eq!(report.violations.len(), 1, "{:#?}", report.violations);
        assert_eq!(report.violations[0].invariant, Invariant::Inv05);
        assert!(report.violations[0].message.contains("grant 5"));
        // One stale arrival in two rail entries.
        assert_eq!(report.counts.stale_arrivals, 1);
        assert_eq!(report.counts.stale_per_thousand(), 500.0);
        assert!(report.table().contains("1 (500.0)"), "{}", report.table());
    }

    #[test]
    fn a_reread_token_is_judged_by_the_grant_that_sent_it() {
        // W1 presented 9 (the token it re-read), but its own grant is 5.
        let mut inputs = t042_history();
        inputs.ledger.push(arrival(2, 9, "p1", "w1-1"));
        assert_eq!(check(&inputs).violations[0].invariant, Invariant::Inv05);
        // And in paydb: fence 9 written by grant 5 after grant 9 wrote.
        let mut inputs = t042_history();
        inputs.account_writes.push(write(3, 9, 5));
        let report = check(&inputs);
        assert_eq!(report.violations.len(), 1, "{:#?}", report.violations);
        assert!(report.violations[0].message.contains("paydb"));
    }

    #[test]
    fn equal_tokens_are_one_grant() {
        let mut inputs = t042_history();
        inputs.history.push(submit(1_500, 2, 9, "p3", "w2-2"));
        inputs.ledger.push(arrival(2, 9, "p3", "w2-2"));
        inputs.account_writes.push(write(3, 9, 9));
        assert!(check(&inputs).ok());
    }

    #[test]
    fn tokens_that_go_back_in_real_time_are_inv04() {
        let mut inputs = t042_history();
        inputs.history.extend(grant(2_000, 2_010, 3, 7, 4_000));
        inputs.history.sort_by_key(|e| e.t_us);
        let report = check(&inputs);
        assert!(
            report
                .violations
                .iter()
                .any(|v| v.invariant == Invariant::Inv04),
            "{:#?}",
            report.violations
        );
        // Concurrent acquires are not ordered: no violation if they overlap in time.
        let mut history = grant(0, 100, 1, 9, 10_000_000);
        history.extend(grant(50, 60, 2, 5, 10_000_000));
        history.sort_by_key(|e| e.t_us);
        let v = check(&Inputs {
            history,
            ..Inputs::default()
        });
        assert!(!v.violations.iter().any(|v| v.invariant == Invariant::Inv04));
    }

    #[test]
    fn a_grant_inside_the_previous_lease_is_inv06_unless_it_was_released() {
        let mut history = grant(0, 10, 1, 5, 1_000);
        history.extend(grant(400, 500, 2, 9, 3_000));
        let report = check(&Inputs {
            history: history.clone(),
            ..Inputs::default()
        });
        assert_eq!(report.violations.len(), 1, "{:#?}", report.violations);
        assert_eq!(report.violations[0].invariant, Invariant::Inv06);
        history.push(ev(300, 1, Op::Release, Phase::Invoke, Some(5)));
        history.sort_by_key(|e| e.t_us);
        assert!(
            check(&Inputs {
                history,
                ..Inputs::default()
            })
            .ok()
        );
    }

    // ---- INV-05 broken where the rail's ledger alone would not show it ----

    /// Seed 1 of `--negative-control reread --idempotency-keys true --faults worker-pause
    /// --accounts 2` on postgres: every pause is the long one, the stalled worker's payment is
    /// retried by the newer grant, and the stale worker's submit — presenting the re-read
    /// token — is *accepted by the fence* and then refused by the idempotency layer (422,
    /// the attempt is in the path). Nothing reaches the rail twice and paydb is not written,
    /// so only the proxy's answer shows that a stale writer got past the fence: it was not
    /// answered 409 (INV-05 says it must be), and the checker judges that answer.
    #[test]
    fn a_stale_grant_not_fenced_out_by_the_proxy_is_inv05_even_if_the_rail_never_saw_it() {
        let mut inputs = t042_history();
        // W2 (grant 9) retried W1's payment p1 and the rail answered it.
        inputs.history.push(submit(1_250, 2, 9, "p1", "w2-2"));
        let mut ok = submit(1_260, 2, 9, "p1", "w2-2").outcome(Phase::Ok);
        ok.t_us = 1_260;
        inputs.history.push(ok);
        inputs.ledger.push(arrival(2, 9, "p1", "w2-2"));
        // W1 (grant 5) wakes and presents the re-read token 9: not fenced out.
        let mut stale = submit(1_300, 1, 5, "p1", "w1-2");
        stale.presented = Some(9);
        inputs.history.push(stale.clone());
        let mut refused = stale
            .outcome(Phase::Fail)
            .detail("422 idempotency_key_reused");
        refused.t_us = 1_310;
        inputs.history.push(refused);
        inputs.history.sort_by_key(|e| e.t_us);
        let report = check(&inputs);
        assert!(
            !report.ok(),
            "a stale grant's submit passed the fence (answered 422, not 409 fenced_out) after a \
             newer grant's submit of the account had been answered: {:#?}",
            report.counts
        );
    }

    /// The rail received a request that no recorded submit sent (its attempt is unknown:
    /// a lost or torn history line, a proxy that rewrote or re-sent a path). INV-05 judges it
    /// by the token the rail saw, so failed attribution cannot hide a stale arrival.
    #[test]
    fn a_rail_entry_no_submit_sent_is_not_silently_skipped() {
        let mut inputs = t042_history();
        inputs.ledger.push(arrival(2, 5, "p1", "w1-unknown"));
        let report = check(&inputs);
        assert_eq!(report.counts.unattributed_rail_entries, 1);
        assert!(
            !report.ok(),
            "an unattributable rail arrival after a newer grant's must fail the check (or at \
             least make the run inconclusive), not pass it"
        );
    }

    /// Liveness is reported, never a violation (the issue: "payments never completed
    /// (liveness, not a violation)"): a payment left in doubt by a fault is safe and stuck.
    #[test]
    fn payments_never_completed_are_reported_as_liveness_not_as_violations() {
        let mut history = grant(0, 10, 1, 5, 1_000);
        history.push(submit(20, 1, 5, "p1", "w1-1"));
        let mut failed = submit(30, 1, 5, "p1", "w1-1").outcome(Phase::Fail);
        failed.t_us = 30;
        history.push(failed.detail("409 fenced_out"));
        let report = check(&Inputs {
            history,
            payments: (0..10)
                .map(|i| PaymentRow {
                    id: format!("p{i}"),
                    account: "a1".into(),
                    state: "pending".into(),
                    attempts: 0,
                })
                .collect(),
            ..Inputs::default()
        });
        assert_eq!(report.counts.completed, 0);
        assert_eq!(report.counts.never_completed, 10);
        assert_eq!(report.never_completed_sample.len(), 10);
        assert!(report.table().contains("never completed (liveness)"));
        assert!(report.ok());
    }

    /// The operator's steps are counted from its `forget` events: records taken up, forgotten,
    /// left in doubt because the rail had the payment, and forgets refused.
    #[test]
    fn the_operators_forgets_are_counted() {
        let forget = |t: i64, phase: Phase, payment: &str, detail: &str| {
            let mut e = ev(t, 0, Op::Forget, phase, None)
                .payment(payment)
                .detail(detail);
            e.account = "a1".into();
            e
        };
        let history = vec![
            forget(1, Phase::Invoke, "p1", "in doubt"),
            forget(2, Phase::Info, "p1", "waiting: 409"),
            forget(3, Phase::Ok, "p1", "forgotten: forgotten"),
            forget(4, Phase::Invoke, "p2", "in doubt"),
            forget(5, Phase::Fail, "p2", crate::operator::PAID_ON_THE_RAIL),
            forget(6, Phase::Invoke, "p3", "in doubt"),
            forget(7, Phase::Fail, "p3", "refused: 409"),
        ];
        let report = check(&Inputs {
            history,
            ..Inputs::default()
        });
        let c = &report.counts;
        assert_eq!(
            (
                c.in_doubt_records_taken_up,
                c.forgotten,
                c.paid_per_the_rail,
                c.forgets_refused
            ),
            (3, 1, 1, 1)
        );
        assert!(report.table().contains("paid per the rail, left in doubt"));
        assert!(report.ok());
    }

    #[test]
    fn the_table_names_every_invariant_and_the_first_violation() {
        let mut inputs = t042_history();
        inputs.ledger.push(arrival(2, 5, "p1", "w1-1"));
        inputs.faults.push(FaultRecord {
            kind: "worker-stop".into(),
            target: "w1".into(),
            start_us: 0,
            end_us: 1,
        });
        let table = check(&inputs).table();
        for name in [
            "INV-02",
            "INV-04",
            "INV-05",
            "INV-06",
            "worker-stop",
            "grant 5",
        ] {
            assert!(table.contains(name), "{name} missing from\n{table}");
        }
    }
}
