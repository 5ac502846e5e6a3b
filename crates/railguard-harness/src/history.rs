//! The recorded history: what every worker did, one JSON line per step, Jepsen-style.
//!
//! A step is written when it is invoked and again when its outcome is known: `ok` (it happened),
//! `fail` (it certainly did not happen) or `info` (it may or may not have happened — a timeout,
//! a 502/504, a worker that cannot tell). The checker must treat `info` as "maybe", never as
//! "no". Each worker writes its own file, line by line and unbuffered, so a worker killed
//! mid-way leaves every line it finished; the checker merges the files by timestamp.
//!
//! Every entry names the worker's **own** grant token: the token its acquire returned. Under the
//! `reread` negative control a worker presents another token (`presented`); the checker judges
//! a write by the grant that made it, which is how it sees the §A2.3 bug.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Microseconds since the Unix epoch on this machine's clock, which every process of a run
/// shares (workers, coordinator, rail simulator and lock service all run on one host).
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Acquire the account's lock.
    Acquire,
    /// The fenced paydb write that claims a payment for this grant (state `submitting`).
    Claim,
    /// The payment sent to the rail through the proxy.
    Submit,
    /// The fenced paydb write that records the payment as done and moves the balance.
    Complete,
    Release,
    /// The worker's keep-alive reported the lease lost.
    LeaseLost,
    /// The operator's in-doubt procedure for one idempotency record (`operator`): `invoke`
    /// taken up, `info` waiting, `ok` forgotten, `fail` not forgotten (the rail had the
    /// payment, or forget refused).
    Forget,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Invoke,
    Ok,
    Fail,
    Info,
}

/// One line of a worker's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub t_us: i64,
    pub worker: u32,
    pub op: Op,
    pub phase: Phase,
    pub account: String,
    /// The worker's own grant token (from its acquire), once it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<i64>,
    /// The token sent, where it differs from `token` (the `reread` negative control only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presented: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment: Option<String>,
    /// A submit's unique id, also in the request path, so that a rail ledger entry names the
    /// submit (and so the grant) that sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    /// An acquire's lease as the lock service reported it (backend clock, µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted_at_us: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_us: Option<i64>,
    /// Why, for people: an HTTP status, an error code, a message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Event {
    pub fn new(worker: u32, op: Op, phase: Phase, account: &str) -> Self {
        Self {
            t_us: now_us(),
            worker,
            op,
            phase,
            account: account.to_string(),
            token: None,
            presented: None,
            payment: None,
            attempt: None,
            granted_at_us: None,
            expires_at_us: None,
            detail: None,
        }
    }

    pub fn token(mut self, token: i64) -> Self {
        self.token = Some(token);
        self
    }

    pub fn payment(mut self, payment: &str) -> Self {
        self.payment = Some(payment.to_string());
        self
    }

    pub fn attempt(mut self, attempt: &str) -> Self {
        self.attempt = Some(attempt.to_string());
        self
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// The same step's outcome, stamped now.
    pub fn outcome(&self, phase: Phase) -> Self {
        let mut e = self.clone();
        e.t_us = now_us();
        e.phase = phase;
        e.detail = None;
        e
    }
}

/// The path of a submit: the attempt travels in it, so the rail's ledger names it.
pub fn submit_path(payment: &str, attempt: &str) -> String {
    format!("/pay/{payment}/{attempt}")
}

/// The `(payment, attempt)` of a submit path, if it is one.
pub fn parse_submit_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/pay/")?;
    let (payment, attempt) = rest.split_once('/')?;
    (!payment.is_empty() && !attempt.is_empty()).then_some((payment, attempt))
}

/// Appends events to one worker's file, a line at a time.
pub struct HistoryWriter {
    file: File,
}

impl HistoryWriter {
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            file: File::options().create(true).append(true).open(path)?,
        })
    }

    /// Writes `event` as one line with one `write` call, so that it is whole or absent.
    pub fn write(&mut self, event: &Event) {
        let mut line = serde_json::to_vec(event).expect("events serialise");
        line.push(b'\n');
        if let Err(e) = self.file.write_all(&line) {
            tracing::error!(error = %e, "cannot write the history; the run's check will be incomplete");
        }
    }
}

/// Every `history-*.jsonl` in `dir`, merged by time. A torn last line (a worker killed while
/// writing it) is skipped and counted.
pub fn read_dir(dir: &Path) -> std::io::Result<(Vec<Event>, usize)> {
    let mut events = Vec::new();
    let mut torn = 0;
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("history-") && n.ends_with(".jsonl"))
        })
        .collect();
    names.sort();
    for path in names {
        // Split on bytes: a line torn inside a UTF-8 character is not text, and is skipped.
        for line in BufReader::new(File::open(&path)?).split(b'\n') {
            let line = line?;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match serde_json::from_slice::<Event>(&line) {
                Ok(e) => events.push(e),
                Err(_) => torn += 1,
            }
        }
    }
    events.sort_by_key(|e| (e.t_us, e.worker));
    Ok((events, torn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_paths_round_trip_and_reject_other_paths() {
        let path = submit_path("p-3-7", "w2-15");
        assert_eq!(parse_submit_path(&path), Some(("p-3-7", "w2-15")));
        assert_eq!(parse_submit_path("/payments"), None);
        assert_eq!(parse_submit_path("/pay//x"), None);
        assert_eq!(parse_submit_path("/pay/p1/"), None);
    }

    #[test]
    fn a_torn_line_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = HistoryWriter::create(&dir.path().join("history-1.jsonl")).unwrap();
        let e = Event::new(1, Op::Acquire, Phase::Invoke, "a1");
        w.write(&e);
        w.write(&e.outcome(Phase::Ok).token(9));
        std::fs::write(
            dir.path().join("history-2.jsonl"),
            "{\"t_us\":1,\"worker\":2,\"op\":\"acq",
        )
        .unwrap();
        let (events, torn) = read_dir(dir.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(torn, 1);
        assert_eq!(events[1].token, Some(9));
    }

    /// A line torn inside a multi-byte character (serde_json does not escape non-ASCII;
    /// error details can carry any text) is not valid UTF-8: it is skipped and counted like
    /// any torn line, not fatal to the whole check.
    #[test]
    fn a_line_torn_inside_a_utf8_character_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = HistoryWriter::create(&dir.path().join("history-1.jsonl")).unwrap();
        let e = Event::new(1, Op::Acquire, Phase::Invoke, "a1");
        w.write(&e);
        let mut torn = br#"{"t_us":1,"worker":1,"op":"submit","phase":"info","account":"a1","detail":"no answer within 500"#.to_vec();
        torn.push(0xC2); // the first byte of "µ", the rest never written
        std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join("history-1.jsonl"))
            .unwrap()
            .write_all(&torn)
            .unwrap();
        let (events, torn) = read_dir(dir.path()).expect("a torn line is skipped, not fatal");
        assert_eq!(events.len(), 1);
        assert_eq!(torn, 1);
    }
}
