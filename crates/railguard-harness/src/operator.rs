//! The operator who resolves payments left in doubt (`--operator-forgets`): a task of the
//! coordinator that follows `railguard::admin::IN_DOUBT_PROCEDURE` as written, for every
//! idempotency record in doubt in railguard's PostgreSQL: in state `in_doubt` (its owner
//! declared it), or `in_flight` past its in-doubt deadline (its owner was killed first) —
//! railguard answers `409 in_doubt` for both.
//!
//! 1. The owner: a record whose owner instance is a railguard process still running is left
//!    alone (it has not stopped, and this operator stops nothing). Only an instance the harness
//!    itself killed or restarted is gone, with the moment the harness saw it gone; every forget
//!    for its records says `--owner-stopped N`.
//! 2. `railguard idempotency-forget --dry-run`, again on each pass, until it would forget; and,
//!    with `--owner-stopped`, `proxy.rail_transit_ms` from the moment the process was seen gone.
//! 3. Only then the rail simulator is asked whether it has a payment with the record's key.
//! 4. If it has: no forget. The record stays in doubt, and the payment is counted as paid per
//!    the rail.
//! 5. If not: `railguard idempotency-forget` without `--dry-run`; the worker's next retry of the
//!    payment is forwarded.
//!
//! Each step is written to `history-operator.jsonl` as an [`Op::Forget`] event (worker 0):
//! `invoke` when a record is taken up, `info` while the procedure waits, `ok` when the record
//! was forgotten, `fail` with [`PAID_ON_THE_RAIL`] when the rail had the payment, `fail` with
//! a `refused:` detail when a forget without `--dry-run` was refused.
//!
//! Under `--negative-control operator-skips-the-wait` it skips steps 2 to 4: it runs forget
//! without `--dry-run` straight away and on every pass until railguard accepts it, never asking
//! the rail — what the checker must then see as a payment made twice (INV-02).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use railguard_testkit::{Rail, Railguard};
use tokio::time::Instant;

use crate::history::{Event, HistoryWriter, Op, Phase};
use crate::paydb;

/// The detail of a `forget` `fail` event whose record's payment the rail had (step 4).
pub const PAID_ON_THE_RAIL: &str = "paid on the rail: not forgotten, left in doubt";
/// The worker number of the operator's events.
pub const OPERATOR_WORKER: u32 = 0;
/// How often the operator looks for records in doubt.
const PASS_EVERY: Duration = Duration::from_secs(2);
/// The longest one `railguard idempotency-forget` may take.
const FORGET_TIMEOUT: Duration = Duration::from_secs(10);

/// The railguard processes as the harness knows them: which instance each runs now, and which
/// instances the harness has seen gone (killed, or stopped and started again), since when.
#[derive(Debug, Default)]
pub struct Fleet {
    running: Vec<Option<i64>>,
    configs: Vec<PathBuf>,
    gone: HashMap<i64, Instant>,
}

impl Fleet {
    /// Takes note of the processes as they are now: an instance that was running and is no
    /// longer any process's is gone from now on. Called between faults, so that an instance
    /// counts as running until the fault that killed it has ended.
    pub fn observe(&mut self, proxies: &[Railguard]) {
        self.running.resize(proxies.len(), None);
        self.configs = proxies.iter().map(|rg| rg.config_path()).collect();
        let now: Vec<Option<i64>> = proxies
            .iter()
            .map(|rg| rg.pid().and(rg.instance()))
            .collect();
        for old in self.running.iter().flatten() {
            if !now.contains(&Some(*old)) {
                self.gone.entry(*old).or_insert_with(Instant::now);
            }
        }
        self.running = now;
    }

    fn owner(&self, instance: i64) -> Owner {
        if self.running.contains(&Some(instance)) {
            Owner::Running
        } else if let Some(at) = self.gone.get(&instance) {
            Owner::Gone(*at)
        } else {
            Owner::Unknown
        }
    }

    /// The config of a railguard running now, whose admin listener forget talks to.
    fn a_running_config(&self, pass: usize) -> Option<PathBuf> {
        let running: Vec<&PathBuf> = self
            .configs
            .iter()
            .zip(&self.running)
            .filter(|(_, i)| i.is_some())
            .map(|(c, _)| c)
            .collect();
        (!running.is_empty()).then(|| running[pass % running.len()].clone())
    }
}

enum Owner {
    Running,
    /// Killed or restarted by the harness, seen gone at this moment.
    Gone(Instant),
    /// No process the harness started: left alone.
    Unknown,
}

/// What the operator task needs.
pub struct Setup {
    /// railguard's PostgreSQL, read directly (not through the faults' relay).
    pub database_url: String,
    pub rail: Arc<Rail>,
    pub fleet: Arc<Mutex<Fleet>>,
    /// The `RAILGUARD__…` overrides the processes run with.
    pub env: Vec<(String, String)>,
    pub history: PathBuf,
    /// Skip the wait and the rail (the negative control).
    pub skip_the_wait: bool,
}

/// The operator task; it stops when `stop` is set, and returns how many records it forgot.
pub async fn run(setup: Setup, stop: Arc<AtomicBool>) -> usize {
    let mut history = match HistoryWriter::create(&setup.history) {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "operator: cannot write its history; not running");
            return 0;
        }
    };
    let mut state = State::default();
    let mut client = None;
    let mut pass = 0usize;
    while !stop.load(Ordering::Acquire) {
        pass += 1;
        if client.is_none() {
            client = paydb::connect(&setup.database_url).await.ok();
        }
        if let Some(c) = &client {
            match in_doubt(c).await {
                Ok(records) => {
                    for record in records {
                        if stop.load(Ordering::Acquire) {
                            break;
                        }
                        state.resolve(&setup, &mut history, &record, pass).await;
                    }
                }
                Err(_) => client = None,
            }
        }
        tokio::time::sleep(PASS_EVERY).await;
    }
    state.forgotten
}

struct Record {
    account: String,
    key: String,
    owner: Option<i64>,
}

async fn in_doubt(client: &tokio_postgres::Client) -> Result<Vec<Record>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT account_id, idempotency_key, owner_instance FROM idempotency_record \
             WHERE state = 'in_doubt' \
                OR (state = 'in_flight' AND now() > COALESCE(in_doubt_at, created_at)) \
             ORDER BY in_doubt_at",
            &[],
        )
        .await?
        .iter()
        .map(|row| Record {
            account: row.get(0),
            key: row.get(1),
            owner: row.get(2),
        })
        .collect())
}

#[derive(Default)]
struct State {
    /// Records taken up (their `invoke` written), by account, key and owner.
    taken_up: HashSet<(String, String, Option<i64>)>,
    /// Those whose wait was written already.
    waiting: HashSet<(String, String, Option<i64>)>,
    /// Keys the rail had: left in doubt for good.
    paid: HashSet<(String, String)>,
    forgotten: usize,
}

impl State {
    async fn resolve(
        &mut self,
        setup: &Setup,
        history: &mut HistoryWriter,
        record: &Record,
        pass: usize,
    ) {
        let (account, key) = (record.account.as_str(), record.key.as_str());
        if self.paid.contains(&(account.to_string(), key.to_string())) {
            return;
        }
        // Step 1: only an owner the harness has seen gone.
        let Some(owner) = record.owner else { return };
        let (stopped_at, config) = {
            let fleet = setup.fleet.lock().unwrap_or_else(|p| p.into_inner());
            match fleet.owner(owner) {
                Owner::Running | Owner::Unknown => return,
                Owner::Gone(at) => (at, fleet.a_running_config(pass)),
            }
        };
        let Some(config) = config else { return };
        let id = (account.to_string(), key.to_string(), record.owner);
        let event = |phase: Phase, detail: String| {
            Event::new(OPERATOR_WORKER, Op::Forget, phase, account)
                .payment(key)
                .detail(detail)
        };
        if self.taken_up.insert(id.clone()) {
            history.write(&event(
                Phase::Invoke,
                format!("in doubt; its owner, instance {owner}, was seen gone"),
            ));
        }
        let forget =
            |dry_run: bool| idempotency_forget(&config, &setup.env, account, key, owner, dry_run);
        if !setup.skip_the_wait {
            // Step 2: the dry run, until it would forget; and the transit from the stop.
            let (would, said) = forget(true).await;
            let transit = rail_transit(&config);
            let waited = Instant::now() >= stopped_at + transit;
            if !would || !waited {
                if self.waiting.insert(id) {
                    history.write(&event(
                        Phase::Info,
                        if would {
                            format!(
                                "waiting {} ms from the owner's stop (proxy.rail_transit_ms)",
                                transit.as_millis()
                            )
                        } else {
                            format!("waiting: {said}")
                        },
                    ));
                }
                return;
            }
            // Steps 3 and 4: the rail, only now.
            if setup.rail.times_paid(key) > 0 {
                self.paid.insert((account.to_string(), key.to_string()));
                history.write(&event(Phase::Fail, PAID_ON_THE_RAIL.to_string()));
                return;
            }
        }
        // Step 5.
        let (done, said) = forget(false).await;
        if done {
            self.forgotten += 1;
            history.write(&event(Phase::Ok, format!("forgotten: {said}")));
        } else {
            history.write(&event(Phase::Fail, format!("refused: {said}")));
        }
    }
}

/// `proxy.rail_transit_ms` from a railguard's config file (30 s, railguard's default, if it
/// does not say).
fn rail_transit(config: &Path) -> Duration {
    std::fs::read_to_string(config)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                let (name, value) = l.split_once('=')?;
                (name.trim() == "rail_transit_ms")
                    .then(|| value.trim().parse::<u64>().ok())
                    .flatten()
            })
        })
        .map_or(Duration::from_secs(30), Duration::from_millis)
}

/// `railguard idempotency-forget --owner-stopped N [--dry-run]` against the railguard of
/// `config`: whether it succeeded (would forget, or forgot), and the first line it said.
async fn idempotency_forget(
    config: &Path,
    env: &[(String, String)],
    account: &str,
    key: &str,
    owner: i64,
    dry_run: bool,
) -> (bool, String) {
    let mut command = tokio::process::Command::new(railguard_testkit::railguard_binary());
    command
        .arg("idempotency-forget")
        .arg("--config")
        .arg(config)
        .args(["--account", account, "--key", key])
        .args(["--owner-stopped", &owner.to_string()]);
    if dry_run {
        command.arg("--dry-run");
    }
    let run = command
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output();
    match tokio::time::timeout(FORGET_TIMEOUT, run).await {
        Ok(Ok(out)) => {
            let text = if out.status.success() {
                out.stdout
            } else {
                out.stderr
            };
            let first = String::from_utf8_lossy(&text)
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .map(said)
                .unwrap_or_default();
            (out.status.success(), first)
        }
        Ok(Err(e)) => (false, format!("cannot run it: {e}")),
        Err(_) => (false, "did not answer within 10 s".into()),
    }
}

/// A line railguard wrote: its message, when it is a JSON log line, or a command's failure
/// (`railguard: MESSAGE`) without the prefix.
fn said(line: &str) -> String {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| {
            v["fields"]["message"]
                .as_str()
                .or(v["message"].as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| line.strip_prefix("railguard: ").unwrap_or(line).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transit_is_read_from_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("railguard.toml");
        std::fs::write(&path, "[proxy]\nrail_transit_ms = 1000\n").unwrap();
        assert_eq!(rail_transit(&path), Duration::from_millis(1000));
        std::fs::write(&path, "[proxy]\n").unwrap();
        assert_eq!(rail_transit(&path), Duration::from_secs(30));
    }

    #[test]
    fn a_json_log_line_says_its_message() {
        assert_eq!(
            said(r#"{"level":"ERROR","fields":{"message":"409 Conflict: wait"}}"#),
            "409 Conflict: wait"
        );
        assert_eq!(said("forgotten"), "forgotten");
        assert_eq!(
            said("railguard: 409 Conflict: wait until 12:00"),
            "409 Conflict: wait until 12:00"
        );
    }
}
