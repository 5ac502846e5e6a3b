//! A superseded grant across a store that goes back, with the interleaving forced:
//! `pg-rewind-takeover` (lockdb put back to a copy) and `pg-failover-takeover` (lockdb's
//! Patroni primary lost after commits its standby never received).
//!
//! 1. The point the store will go back to: a copy of lockdb's data, or the primary's
//!    replication paused (what it commits from then on reaches no standby).
//! 2. One worker, W1, is held right before its next submit: it has claimed a payment under a
//!    live grant `t1` and stops itself (SIGHUP asks for it, see [`crate::worker`]) until
//!    continued. Its lease lapses.
//! 3. The run waits until the rail has paid a newer grant `t2 > t1` on W1's account: another
//!    worker took the account over, and railguard's mark for it is `t2` — in the store only,
//!    after the point of step 1.
//! 4. Every other worker is stopped, so that no grant pays on that account before W1 does.
//! 5. The store goes back (rewind, or the primary SIGKILLed and its standby promoted): the
//!    mark is `≤ t1` again, and the idempotency records made since are gone.
//! 6. Every railguard is restarted, so that none remembers `t2` in memory, and the run waits
//!    until they grant.
//! 7. W1 is continued: it submits with `t1`. railguard must refuse it — on the etcd lock
//!    backend, where the tokens did not go back, only the detection of the store change does
//!    (the grants from before it are fenced); without it, `t1` reaches the rail after `t2`
//!    (INV-05), and a payment `t2` already paid is paid again (INV-02).
//! 8. The other workers are continued.
//!
//! Every wait is bounded; a step that does not happen in time is said in the fault's record,
//! and every stopped worker is continued whatever happened.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use crate::faults::{Targets, Timing, recover, signal};
use crate::history::{Event, Op, Phase, now_us};
use crate::lockdb::LockDb;
use crate::rng::Rng;
use crate::worker::HOLDING;

/// How the store goes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoBack {
    /// lockdb (one PostgreSQL) put back to a copy of its data directory.
    Rewind,
    /// lockdb's Patroni primary SIGKILLed after commits its standbys never received.
    AsyncFailover,
}

/// The point the store goes back to.
enum Point {
    Copy(railguard_testkit::DataCopy),
    Paused { primary: usize },
}

/// What W1 holds when it stops itself.
#[derive(Debug, Clone)]
struct Held {
    account: String,
    token: i64,
    payment: String,
}

/// How long a promotion may take (Patroni's ttl is 10 s).
const PROMOTION_LIMIT: Duration = Duration::from_secs(40);
/// How often the run looks at a worker's history and the rail's ledger.
const POLL: Duration = Duration::from_millis(50);

pub async fn inject(
    targets: &mut Targets<'_>,
    rng: &mut Rng,
    timing: Timing,
    go_back: GoBack,
) -> String {
    if targets.worker_pids.is_empty() {
        return "no worker running".to_string();
    }
    let (w1, w1_pid) = targets.worker_pids[rng.below(targets.worker_pids.len() as u64) as usize];
    let began = Instant::now();
    let mut said = Vec::new();

    // 1. The point the store goes back to.
    let point = match (go_back, &mut *targets.lockdb) {
        (GoBack::Rewind, LockDb::Single(pg)) => match pg.copy_data().await {
            Ok(copy) => Point::Copy(copy),
            Err(e) => return format!("data copy FAILED: {e}"),
        },
        (GoBack::AsyncFailover, LockDb::Patroni { cluster, .. }) => Point::Paused {
            primary: cluster.pause_replication().await,
        },
        (GoBack::Rewind, _) => return "lockdb is not one PostgreSQL".to_string(),
        (GoBack::AsyncFailover, _) => return "lockdb is not a Patroni cluster".to_string(),
    };
    said.push(match &point {
        Point::Copy(copy) => format!("PostgreSQL copied (lsn {})", copy.lsn),
        Point::Paused { .. } => "the primary's replication paused".to_string(),
    });

    // 2. W1 held before its next submit.
    let history = history_path(targets.history_dir, w1);
    let offset = file_len(&history);
    signal(w1_pid, "HUP").await;
    let hold_limit = timing.ttl * 4 + Duration::from_secs(5);
    let held = wait_for_hold(&history, offset, w1_pid, hold_limit).await;
    let Some(held) = held else {
        // Replace the request with a short pause, so that it never stops itself unwatched,
        // and continue it in case it stopped in between.
        signal(w1_pid, "USR1").await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        signal(w1_pid, "CONT").await;
        said.push(format!(
            "worker {w1} did not reach a submit within {} ms",
            hold_limit.as_millis()
        ));
        said.push(go_back_now(targets, point).await);
        said.push(restart_every_railguard(targets).await);
        return said.join("; ");
    };
    said.push(format!(
        "worker {w1} held before its submit of {} on {} with grant {}",
        held.payment, held.account, held.token
    ));

    // 3. A newer grant paid on W1's account.
    let takeover_limit = timing.ttl * 4 + Duration::from_secs(10);
    let waiting = Instant::now();
    let mut newer = None;
    while waiting.elapsed() < takeover_limit {
        newer = targets
            .rail
            .ledger()
            .iter()
            .filter(|e| e.account.as_deref() == Some(held.account.as_str()))
            .filter_map(|e| e.token.as_deref().and_then(|t| t.parse::<i64>().ok()))
            .filter(|t| *t > held.token)
            .max();
        if newer.is_some() {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    said.push(match newer {
        Some(t2) => format!(
            "grant {t2} took {} over and the rail paid it {} ms later",
            held.account,
            waiting.elapsed().as_millis()
        ),
        None => format!(
            "no newer grant paid on {} within {} ms",
            held.account,
            takeover_limit.as_millis()
        ),
    });

    // 4. Nobody else pays from here until W1 has.
    let others: Vec<(u32, u32)> = targets
        .worker_pids
        .iter()
        .copied()
        .filter(|(id, _)| *id != w1)
        .collect();
    for (_, pid) in &others {
        signal(*pid, "STOP").await;
    }

    // 5, 6. The store goes back; no railguard remembers what it saw.
    said.push(go_back_now(targets, point).await);
    said.push(restart_every_railguard(targets).await);

    // 7. W1's old grant submits.
    let woken = now_us();
    let offset = file_len(&history);
    signal(w1_pid, "CONT").await;
    let limit = timing.request_timeout + Duration::from_secs(3);
    said.push(
        match wait_for_submit(&history, offset, &held, woken, limit).await {
            Some(answer) => format!(
                "worker {w1} continued: its submit of grant {} {answer}",
                held.token
            ),
            None => format!(
                "worker {w1} continued: no answer to its submit within {} ms",
                limit.as_millis()
            ),
        },
    );

    // 8. The others carry on.
    for (_, pid) in &others {
        signal(*pid, "CONT").await;
    }
    if go_back == GoBack::AsyncFailover {
        said.push(rejoin_old_primary(targets).await);
    }
    said.push(format!("{} ms in all", began.elapsed().as_millis()));
    said.join("; ")
}

/// Puts the store back to `point`.
async fn go_back_now(targets: &mut Targets<'_>, point: Point) -> String {
    match (point, &mut *targets.lockdb) {
        (Point::Copy(copy), LockDb::Single(pg)) => {
            let held = copy.taken.elapsed();
            match pg.rewind_to(&copy).await {
                Ok(()) => format!(
                    "PostgreSQL put back to the copy taken {} ms earlier",
                    held.as_millis()
                ),
                Err(e) => format!("PostgreSQL rewind FAILED: {e}"),
            }
        }
        (Point::Paused { primary }, LockDb::Patroni { cluster, .. }) => {
            let began = Instant::now();
            cluster.kill_member(primary).await;
            let new = cluster.wait_for_new_primary(primary, PROMOTION_LIMIT).await;
            format!(
                "primary {} SIGKILLed after commits its standbys never received, {} promoted \
                 after {} ms",
                cluster.member_name(primary),
                cluster.member_name(new),
                began.elapsed().as_millis()
            )
        }
        _ => "lockdb changed shape".to_string(),
    }
}

/// The SIGKILLed primary of an async-loss failover back as a standby.
async fn rejoin_old_primary(targets: &mut Targets<'_>) -> String {
    let LockDb::Patroni { cluster, .. } = &mut *targets.lockdb else {
        return String::new();
    };
    let Some(old) = (0..cluster.size()).find(|&i| !cluster.is_running(i)) else {
        return "no member to rejoin".to_string();
    };
    let began = Instant::now();
    cluster.restart_member(old).await;
    format!(
        "{} rejoined as a standby after {} ms",
        cluster.member_name(old),
        began.elapsed().as_millis()
    )
}

/// Stops every railguard and starts it again (its memory of marks gone), then waits until
/// all of them grant.
async fn restart_every_railguard(targets: &mut Targets<'_>) -> String {
    for rg in targets.proxies.iter_mut() {
        rg.stop().await;
        // Not waiting for `/readyz`: one that noticed the store go back may refuse until
        // recovery has run.
        rg.start_again_unready().await;
    }
    format!(
        "every railguard restarted, {}",
        recover(targets.proxies, targets.operator).await
    )
}

fn history_path(dir: &Path, worker: u32) -> PathBuf {
    dir.join(format!("history-{worker}.jsonl"))
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// The whole lines of `path` from byte `offset` on.
fn events_from(path: &Path, offset: u64) -> Vec<Event> {
    let Ok(bytes) = std::fs::read(path) else {
        return Vec::new();
    };
    let start = (offset as usize).min(bytes.len());
    let end = bytes[start..]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(start, |i| start + i + 1);
    bytes[start..end]
        .split(|b| *b == b'\n')
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect()
}

/// Whether process `pid` is stopped (by a signal).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
    })
}

/// Waits until the worker has written that it holds and has stopped itself.
async fn wait_for_hold(history: &Path, offset: u64, pid: u32, limit: Duration) -> Option<Held> {
    let began = Instant::now();
    let mut held = None;
    while began.elapsed() < limit {
        if held.is_none() {
            held = events_from(history, offset)
                .into_iter()
                .find(|e| {
                    e.op == Op::Submit
                        && e.phase == Phase::Info
                        && e.detail.as_deref() == Some(HOLDING)
                })
                .and_then(|e| {
                    Some(Held {
                        token: e.token?,
                        payment: e.payment?,
                        account: e.account,
                    })
                });
        }
        if held.is_some() && is_stopped(pid) {
            return held;
        }
        tokio::time::sleep(POLL).await;
    }
    None
}

/// Waits for the answer to W1's submit, and says it.
async fn wait_for_submit(
    history: &Path,
    offset: u64,
    held: &Held,
    since_us: i64,
    limit: Duration,
) -> Option<String> {
    let began = Instant::now();
    while began.elapsed() < limit {
        let answer = events_from(history, offset).into_iter().find(|e| {
            e.op == Op::Submit
                && e.phase != Phase::Invoke
                && e.attempt.is_some()
                && e.token == Some(held.token)
                && e.payment.as_deref() == Some(held.payment.as_str())
                && e.t_us >= since_us
        });
        if let Some(e) = answer {
            let detail = e.detail.unwrap_or_default();
            return Some(match e.phase {
                Phase::Ok => format!("was paid ({detail})"),
                Phase::Fail => format!("was refused ({detail})"),
                _ => format!("is in doubt ({detail})"),
            });
        }
        tokio::time::sleep(POLL).await;
    }
    None
}
