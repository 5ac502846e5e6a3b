//! A one-line progress display on stderr for long runs: payments done, faults so far, and
//! violations so far (the checker run on the history and the rail's ledger as they stand).
//! Shown only when asked for or when stderr is a terminal and `CI` is unset.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use railguard_testkit::Rail;
use tokio::task::JoinHandle;

use crate::check::{self, Inputs};
use crate::history::{self, Op, Phase};

pub struct Progress {
    faults: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Progress {
    pub fn start(out: PathBuf, rail: Arc<Rail>) -> Self {
        let faults = Arc::new(AtomicUsize::new(0));
        let seen = faults.clone();
        let task = tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let (events, _) = history::read_dir(&out).unwrap_or_default();
                let done = events
                    .iter()
                    .filter(|e| e.op == Op::Complete && e.phase == Phase::Ok)
                    .count();
                let fenced = events
                    .iter()
                    .filter(|e| e.op == Op::Submit && e.detail.as_deref() == Some("fenced_out"))
                    .count();
                let report = check::check(&Inputs {
                    history: events,
                    ledger: rail.ledger(),
                    ..Inputs::default()
                });
                eprint!(
                    "\r[{:>4}s] payments done {done:>6} · fenced out {fenced:>4} · faults {:>4} · violations so far {:>3}   ",
                    started.elapsed().as_secs(),
                    seen.load(Ordering::Relaxed),
                    report.violations.len()
                );
                let _ = std::io::stderr().flush();
            }
        });
        Self { faults, task }
    }

    pub fn fault(&self) {
        self.faults.fetch_add(1, Ordering::Relaxed);
    }

    pub async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
        eprintln!();
    }
}
