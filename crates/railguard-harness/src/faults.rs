//! The faults the harness injects: each one real (a signal to a real process, a real
//! connection cut or slowed by a relay on the real path, a real server killed), each bounded
//! in time — it heals itself, and what it delayed has arrived, before the next one starts —
//! and each recorded.
//!
//! One at a time on purpose: a railguard killed or restarted while one of its forwards is
//! still held in the network could let that forward reach the rail after a newer grant's,
//! and no proxy can retract bytes it has sent (docs/contract.md, "Ordering of
//! overlapping requests").
//!
//! The schedule is drawn from the run's seed: the order of kinds (every enabled kind before
//! any repeats), their targets and the gaps between them.
//!
//! Two kinds make a store that railguard fences against **go back**, as production does:
//! `pg-rewind-data` puts lockdb back to a copy taken seconds earlier (what promoting an
//! asynchronous standby that missed the last commits does: marks, records and
//! `fencing_token_seq` go back together), `etcd-restore` restores etcd from a snapshot taken
//! seconds earlier (the revision, and so the next tokens, go back). Load runs while the copy
//! is taken and for 2–3 s after it. Then the run waits until every railguard grants again; one
//! that refuses (it saw the store go back) gets what an operator does
//! (docs/operations.md, "Restore of lockdb"): `railguard fast-forward` past the marks and
//! paydb's fences, and, if its guard has not reopened a few seconds later, a restart.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use railguard_testkit::{EtcdCluster, Http, Rail, Railguard, Relay};
use tokio::time::Instant;

use crate::check::FaultRecord;
use crate::history::now_us;
use crate::lockdb::LockDb;
use crate::rng::Rng;
use crate::takeover::{self, GoBack};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGSTOP a worker past its lease, then SIGCONT.
    WorkerStop,
    /// The worker pauses itself after its paydb claim, just before the submit (T-042).
    WorkerPause,
    /// The rail slows down past the lease and a worker stalls while its submit is at the rail.
    LeaseExpiresMidSubmit,
    /// Workers' connections to the lock API cut (renewals fail, leases lapse).
    LockPathCut,
    /// Workers' connections to the proxy cut (submits in flight lose their answer).
    ProxyPathCut,
    /// Workers' requests to the proxy delayed past the lease.
    ProxyPathDelay,
    /// railguard's connections to PostgreSQL cut.
    PgPathCut,
    /// railguard's connections to PostgreSQL slowed.
    PgPathDelay,
    /// PostgreSQL (marks, records, the PostgreSQL lock backend) SIGKILLed and restarted.
    PgKill,
    /// An etcd member stopped and started again.
    EtcdMemberRestart,
    /// The etcd leader SIGKILLed and started again (three members).
    EtcdLeaderKill,
    /// A `railguard serve` SIGKILLed and started again.
    ProxyKill,
    /// A `railguard serve` SIGSTOPped and continued.
    ProxyStop,
    /// Forwards from railguard to the rail delayed past the request deadline.
    RailPastDeadline,
    /// A `railguard serve` restarted with another request timeout: for a while two processes
    /// run with different timeouts, as during a rolling config change.
    RollingConfig,
    /// lockdb put back to a copy of its data directory taken 2–3 s earlier, under load.
    PgRewindData,
    /// etcd restored from a snapshot taken 2–3 s earlier, under load.
    EtcdRestore,
    /// lockdb's Patroni primary replaced, in turns: SIGKILLed (the standby is promoted, the
    /// old primary rejoins), switched over, and — with asynchronous replication — SIGKILLed
    /// after a second of commits its standbys never received.
    PgFailover,
    /// lockdb put back to a copy across a takeover, the interleaving forced: a worker held
    /// before its submit, its account taken over and paid, every other worker stopped, the
    /// copy restored, every railguard restarted, the held worker continued (see
    /// [`crate::takeover`]).
    PgRewindTakeover,
    /// The same with an asynchronous Patroni failover instead of the copy: the primary's
    /// replication paused where the copy would be taken, SIGKILLed where it would be restored.
    PgFailoverTakeover,
}

/// What a run is made of, as far as which faults mean anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Setup {
    /// etcd members when the lock backend is etcd.
    pub etcd_members: Option<usize>,
    /// lockdb is a Patroni cluster rather than one PostgreSQL.
    pub patroni: bool,
    /// The Patroni cluster replicates synchronously (a failover loses no commit).
    pub pg_synchronous: bool,
}

impl FaultKind {
    pub const ALL: [FaultKind; 20] = [
        FaultKind::WorkerStop,
        FaultKind::WorkerPause,
        FaultKind::LeaseExpiresMidSubmit,
        FaultKind::LockPathCut,
        FaultKind::ProxyPathCut,
        FaultKind::ProxyPathDelay,
        FaultKind::PgPathCut,
        FaultKind::PgPathDelay,
        FaultKind::PgKill,
        FaultKind::EtcdMemberRestart,
        FaultKind::EtcdLeaderKill,
        FaultKind::ProxyKill,
        FaultKind::ProxyStop,
        FaultKind::RailPastDeadline,
        FaultKind::RollingConfig,
        FaultKind::PgRewindData,
        FaultKind::EtcdRestore,
        FaultKind::PgFailover,
        FaultKind::PgRewindTakeover,
        FaultKind::PgFailoverTakeover,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::WorkerStop => "worker-sigstop",
            FaultKind::WorkerPause => "worker-pause",
            FaultKind::LeaseExpiresMidSubmit => "lease-expires-mid-submit",
            FaultKind::LockPathCut => "lock-path-cut",
            FaultKind::ProxyPathCut => "proxy-path-cut",
            FaultKind::ProxyPathDelay => "proxy-path-delay",
            FaultKind::PgPathCut => "pg-path-cut",
            FaultKind::PgPathDelay => "pg-path-delay",
            FaultKind::PgKill => "pg-kill",
            FaultKind::EtcdMemberRestart => "etcd-member-restart",
            FaultKind::EtcdLeaderKill => "etcd-leader-kill",
            FaultKind::ProxyKill => "proxy-kill",
            FaultKind::ProxyStop => "proxy-sigstop",
            FaultKind::RailPastDeadline => "rail-past-deadline",
            FaultKind::RollingConfig => "rolling-config",
            FaultKind::PgRewindData => "pg-rewind-data",
            FaultKind::EtcdRestore => "etcd-restore",
            FaultKind::PgFailover => "pg-failover",
            FaultKind::PgRewindTakeover => "pg-rewind-takeover",
            FaultKind::PgFailoverTakeover => "pg-failover-takeover",
        }
    }

    pub fn parse(name: &str) -> Option<FaultKind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether the kind means anything for this setup.
    pub fn applies(self, setup: Setup) -> bool {
        match self {
            FaultKind::EtcdMemberRestart | FaultKind::EtcdRestore => setup.etcd_members.is_some(),
            FaultKind::EtcdLeaderKill => setup.etcd_members.is_some_and(|n| n >= 3),
            // These act on one PostgreSQL: its relay, its process, its data directory.
            FaultKind::PgPathCut
            | FaultKind::PgPathDelay
            | FaultKind::PgKill
            | FaultKind::PgRewindData
            | FaultKind::PgRewindTakeover => !setup.patroni,
            FaultKind::PgFailover => setup.patroni,
            // Commits lost at the failover are what it needs.
            FaultKind::PgFailoverTakeover => setup.patroni && !setup.pg_synchronous,
            _ => true,
        }
    }

    /// Whether `all` includes the kind. The takeover kinds stop every worker but one for the
    /// whole of a rewind or failover; they run when named.
    fn in_all(self) -> bool {
        !matches!(
            self,
            FaultKind::PgRewindTakeover | FaultKind::PgFailoverTakeover
        )
    }

    /// Why the kind does not apply to a setup, for the refusal of `--faults`.
    fn needs(self) -> &'static str {
        match self {
            FaultKind::EtcdLeaderKill => "the etcd backend with --etcd-members 3",
            FaultKind::EtcdMemberRestart | FaultKind::EtcdRestore => "the etcd backend",
            FaultKind::PgFailover => "--pg patroni",
            FaultKind::PgFailoverTakeover => "--pg patroni --pg-sync off",
            _ => "--pg single (one PostgreSQL, not Patroni)",
        }
    }

    /// `all`, `none`, or a comma-separated list of names.
    pub fn parse_list(text: &str, setup: Setup) -> Result<Vec<FaultKind>, String> {
        match text {
            "none" | "" => Ok(Vec::new()),
            "all" => Ok(Self::ALL
                .into_iter()
                .filter(|k| k.applies(setup) && k.in_all())
                .collect()),
            list => list
                .split(',')
                .map(|name| {
                    let kind = Self::parse(name.trim()).ok_or_else(|| {
                        format!(
                            "--faults: unknown fault {name:?}; known: all, none, {}",
                            Self::ALL.map(|k| k.name()).join(", ")
                        )
                    })?;
                    if !kind.applies(setup) {
                        return Err(format!("--faults: {name} needs {}", kind.needs()));
                    }
                    Ok(kind)
                })
                .collect(),
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The order of fault kinds: every enabled kind once, shuffled, then again.
pub struct Schedule {
    kinds: Vec<FaultKind>,
    round: Vec<FaultKind>,
}

impl Schedule {
    pub fn new(kinds: Vec<FaultKind>) -> Self {
        Self {
            kinds,
            round: Vec::new(),
        }
    }

    pub fn next(&mut self, rng: &mut Rng) -> Option<FaultKind> {
        if self.kinds.is_empty() {
            return None;
        }
        if self.round.is_empty() {
            self.round = self.kinds.clone();
            rng.shuffle(&mut self.round);
        }
        self.round.pop()
    }
}

/// What a fault can reach.
pub struct Targets<'a> {
    pub worker_pids: Vec<(u32, u32)>,
    pub lockdb: &'a mut LockDb,
    pub etcd: Option<&'a mut EtcdCluster>,
    pub proxies: &'a mut [Railguard],
    pub lock_relays: &'a [Relay],
    pub proxy_relays: &'a [Relay],
    /// railguard → lockdb, when lockdb is one PostgreSQL.
    pub pg_relay: Option<&'a Relay>,
    /// railguard → rail, one per railguard.
    pub rail_relays: &'a [Relay],
    pub operator: &'a Operator,
    /// The rail simulator, whose ledger a fault may watch.
    pub rail: &'a Rail,
    /// Where the workers write their histories, which a fault may watch.
    pub history_dir: &'a Path,
}

/// What an operator runs when railguard refuses to grant after a store went back.
#[derive(Debug, Clone)]
pub struct Operator {
    /// A railguard's config file and its `RAILGUARD__…` overrides, as the processes run.
    pub config: PathBuf,
    pub env: Vec<(String, String)>,
    /// paydb, whose `account.fence` `railguard fast-forward` must pass too.
    pub paydb_url: String,
}

/// How long faults last, from the run's lease and request timeout.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Longer than any lease: a stall this long always outlives the grant, but shorter than
    /// the time after which other workers retry the stalled worker's payment.
    pub stall: Duration,
    /// Longer than that too.
    pub long_stall: Duration,
    pub ttl: Duration,
    pub request_timeout: Duration,
    /// The most each railguard → rail relay adds to a chunk, each way, for the whole run.
    pub rail_jitter: Duration,
}

pub(crate) async fn signal(pid: u32, name: &str) {
    let _ = tokio::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .await;
}

/// Injects one fault of `kind`, waits for it to heal, and says what was done.
pub async fn inject(
    kind: FaultKind,
    targets: &mut Targets<'_>,
    rng: &mut Rng,
    timing: Timing,
) -> FaultRecord {
    let start_us = now_us();
    let pick = |rng: &mut Rng, n: usize| rng.below(n as u64) as usize;
    let target = match kind {
        FaultKind::WorkerStop | FaultKind::WorkerPause | FaultKind::LeaseExpiresMidSubmit
            if targets.worker_pids.is_empty() =>
        {
            "no worker running".to_string()
        }
        FaultKind::WorkerStop => {
            let (id, pid) = targets.worker_pids[pick(rng, targets.worker_pids.len())];
            let stall = if rng.below(2) == 0 {
                timing.stall
            } else {
                timing.long_stall
            };
            signal(pid, "STOP").await;
            tokio::time::sleep(stall).await;
            signal(pid, "CONT").await;
            format!("worker {id} stopped {} ms", stall.as_millis())
        }
        FaultKind::WorkerPause => {
            let (id, pid) = targets.worker_pids[pick(rng, targets.worker_pids.len())];
            let (sig, stall) = if rng.below(2) == 0 {
                ("USR1", timing.stall)
            } else {
                ("USR2", timing.long_stall)
            };
            signal(pid, sig).await;
            tokio::time::sleep(stall + timing.ttl).await;
            format!(
                "worker {id} asked to pause {} ms before its next submit",
                stall.as_millis()
            )
        }
        FaultKind::LeaseExpiresMidSubmit => {
            let slow = (timing.ttl + timing.ttl / 2).min(timing.request_timeout * 3 / 5);
            for relay in targets.rail_relays {
                relay.set_delay(slow);
            }
            // Let submits reach the slow rail, then stall a worker while it waits on one.
            tokio::time::sleep(timing.ttl / 4).await;
            let (id, pid) = targets.worker_pids[pick(rng, targets.worker_pids.len())];
            signal(pid, "STOP").await;
            tokio::time::sleep(timing.stall).await;
            signal(pid, "CONT").await;
            for relay in targets.rail_relays {
                relay.set_delay(Duration::ZERO);
            }
            // What the slow path holds arrives before the next fault.
            tokio::time::sleep(slow + timing.rail_jitter * 2).await;
            format!(
                "rail slowed to {} ms, worker {id} stopped {} ms",
                slow.as_millis(),
                timing.stall.as_millis()
            )
        }
        FaultKind::LockPathCut => {
            let i = pick(rng, targets.lock_relays.len());
            let d = timing.ttl + timing.ttl / 2;
            targets.lock_relays[i].cut_for(d);
            tokio::time::sleep(d).await;
            format!("workers → lock API {i} cut {} ms", d.as_millis())
        }
        FaultKind::ProxyPathCut => {
            let i = pick(rng, targets.proxy_relays.len());
            targets.proxy_relays[i].cut_for(timing.ttl);
            tokio::time::sleep(timing.ttl).await;
            format!("workers → proxy {i} cut {} ms", timing.ttl.as_millis())
        }
        FaultKind::ProxyPathDelay => {
            let i = pick(rng, targets.proxy_relays.len());
            let d = timing.ttl + timing.ttl / 2;
            targets.proxy_relays[i].set_delay(d);
            tokio::time::sleep(timing.stall).await;
            targets.proxy_relays[i].set_delay(Duration::ZERO);
            tokio::time::sleep(d).await;
            format!("workers → proxy {i} delayed {} ms", d.as_millis())
        }
        FaultKind::PgPathCut | FaultKind::PgPathDelay | FaultKind::PgKill
            if targets.pg_relay.is_none() || targets.lockdb.single().is_none() =>
        {
            "lockdb is not one PostgreSQL".to_string()
        }
        FaultKind::PgPathCut => {
            let d = Duration::from_millis(800);
            if let Some(relay) = targets.pg_relay {
                relay.cut_for(d);
            }
            tokio::time::sleep(d).await;
            "railguard → PostgreSQL cut 800 ms".to_string()
        }
        FaultKind::PgPathDelay => {
            if let Some(relay) = targets.pg_relay {
                relay.set_delay(Duration::from_millis(150));
                tokio::time::sleep(Duration::from_secs(2)).await;
                relay.set_delay(Duration::ZERO);
            }
            "railguard → PostgreSQL delayed 150 ms for 2 s".to_string()
        }
        FaultKind::PgKill => match targets.lockdb.single() {
            Some(pg) => {
                pg.kill().await;
                tokio::time::sleep(Duration::from_millis(500)).await;
                match pg.server.start().await {
                    Ok(()) => "PostgreSQL SIGKILLed, restarted after 500 ms".to_string(),
                    Err(e) => format!("PostgreSQL SIGKILLed; restart FAILED: {e}"),
                }
            }
            None => "lockdb is not one PostgreSQL".to_string(),
        },
        FaultKind::EtcdMemberRestart => match targets.etcd.as_deref_mut() {
            Some(etcd) => {
                let i = pick(rng, etcd.size());
                etcd.stop(i).await;
                tokio::time::sleep(Duration::from_millis(1000)).await;
                etcd.start(i).await;
                format!("etcd member {i} stopped, started after 1 s")
            }
            None => "no etcd".to_string(),
        },
        FaultKind::EtcdLeaderKill => match targets.etcd.as_deref_mut() {
            Some(etcd) => match etcd.try_leader().await {
                Some(i) => {
                    etcd.kill(i).await;
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    etcd.start(i).await;
                    format!("etcd leader (member {i}) SIGKILLed, started after 1.5 s")
                }
                None => "etcd had no leader to kill".to_string(),
            },
            None => "no etcd".to_string(),
        },
        FaultKind::ProxyKill => {
            let i = pick(rng, targets.proxies.len());
            targets.proxies[i].kill().await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            targets.proxies[i].start_again().await;
            format!("railguard {i} SIGKILLed, started again")
        }
        FaultKind::ProxyStop => {
            let i = pick(rng, targets.proxies.len());
            match targets.proxies[i].pid() {
                Some(pid) => {
                    signal(pid, "STOP").await;
                    tokio::time::sleep(timing.stall).await;
                    signal(pid, "CONT").await;
                    format!("railguard {i} stopped {} ms", timing.stall.as_millis())
                }
                None => format!("railguard {i} not running"),
            }
        }
        FaultKind::RailPastDeadline => {
            let d = timing.request_timeout + Duration::from_millis(500);
            for relay in targets.rail_relays {
                relay.set_delay(d);
            }
            tokio::time::sleep(Duration::from_millis(700)).await;
            for relay in targets.rail_relays {
                relay.set_delay(Duration::ZERO);
            }
            // The delayed forwards reach the rail, and their late answers railguard, before
            // the next fault (which may restart the railguard waiting for them).
            tokio::time::sleep((d + timing.rail_jitter * 2) * 2).await;
            format!(
                "every railguard → rail path delayed {} ms (past the request deadline) for \
                 700 ms",
                d.as_millis()
            )
        }
        FaultKind::RollingConfig => {
            let i = pick(rng, targets.proxies.len());
            let ms = if rng.below(2) == 0 {
                timing.request_timeout.as_millis() / 2
            } else {
                timing.request_timeout.as_millis()
            };
            let rg = &mut targets.proxies[i];
            rg.set_env("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", &ms.to_string());
            let stopped = rg.stop().await;
            rg.start_again().await;
            format!("railguard {i} restarted ({stopped}) with request_timeout_ms = {ms}")
        }
        FaultKind::PgRewindData => {
            // A stalled survivor across the rewind: right after the copy one worker pauses
            // before its next submit, past its lease, so that another takes its account over
            // and pays before the data goes back; it wakes after, with its old grant, to meet
            // marks from before the newer payment.
            let hold = Duration::from_millis(rng.between(2000, 3000))
                .max(timing.ttl * 2 + Duration::from_millis(1500));
            let survivor = (!targets.worker_pids.is_empty())
                .then(|| targets.worker_pids[pick(rng, targets.worker_pids.len())]);
            let before = targets.lockdb.token_position().await;
            let rewound = match targets.lockdb.single() {
                Some(pg) => match pg.copy_data().await {
                    Ok(copy) => {
                        // The long pause: past the hold, so that it wakes after the rewind.
                        if let Some((_, pid)) = survivor {
                            signal(pid, "USR2").await;
                        }
                        tokio::time::sleep(hold.saturating_sub(copy.taken.elapsed())).await;
                        let held = copy.taken.elapsed();
                        pg.rewind_to(&copy).await.map(|()| (held, copy.lsn.clone()))
                    }
                    Err(e) => Err(format!("data copy: {e}")),
                },
                None => Err("lockdb is not one PostgreSQL".to_string()),
            };
            match rewound {
                Ok((held, lsn)) => {
                    let after = targets.lockdb.token_position().await;
                    let recovery = recover(targets.proxies, targets.operator).await;
                    let survivor = survivor.map_or(String::new(), |(id, _)| {
                        format!("; worker {id} paused before its next submit across it")
                    });
                    format!(
                        "PostgreSQL put back to a copy taken {} ms earlier (lsn {lsn}; \
                         fencing_token_seq {before} at the copy, {after} after){survivor}; \
                         {recovery}",
                        held.as_millis()
                    )
                }
                Err(e) => format!("PostgreSQL rewind FAILED: {e}"),
            }
        }
        FaultKind::EtcdRestore => {
            let hold = Duration::from_millis(rng.between(2000, 3000));
            let Some(etcd) = targets.etcd.as_deref_mut() else {
                return record(kind, "no etcd".to_string(), start_us);
            };
            let restored = match etcd.snapshot().await {
                Ok(snapshot) => {
                    tokio::time::sleep(hold.saturating_sub(snapshot.taken.elapsed())).await;
                    let reached = etcd.try_revision().await;
                    let held = snapshot.taken.elapsed();
                    etcd.restore(&snapshot).await.map(|()| {
                        format!(
                            "etcd ({} members) restored from a snapshot taken {} ms earlier \
                             (revision {} in the snapshot, {} at the stop)",
                            etcd.size(),
                            held.as_millis(),
                            snapshot.revision,
                            reached.map_or("?".into(), |r| r.to_string())
                        )
                    })
                }
                Err(e) => Err(format!("snapshot: {e}")),
            };
            match restored {
                Ok(done) => format!(
                    "{done}; {}",
                    recover(targets.proxies, targets.operator).await
                ),
                Err(e) => format!("etcd restore FAILED: {e}"),
            }
        }
        FaultKind::PgFailover => failover(targets).await,
        FaultKind::PgRewindTakeover => takeover::inject(targets, rng, timing, GoBack::Rewind).await,
        FaultKind::PgFailoverTakeover => {
            takeover::inject(targets, rng, timing, GoBack::AsyncFailover).await
        }
    };
    record(kind, target, start_us)
}

fn record(kind: FaultKind, target: String, start_us: i64) -> FaultRecord {
    FaultRecord {
        kind: kind.name().to_string(),
        target,
        start_us,
        end_us: now_us(),
    }
}

/// How long recovery after a store went back may take before the run goes on without it.
const RECOVERY_LIMIT: Duration = Duration::from_secs(60);

/// How a Patroni primary is replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failover {
    /// SIGKILL; the standby is promoted once the leader key expires; the old primary rejoins.
    Hard,
    /// Patroni's switchover: the primary hands over and follows the new one.
    Planned,
    /// Replication paused, a second of commits only the primary has, then SIGKILL: the
    /// promoted standby never had them (asynchronous replication only).
    AsyncLoss,
}

impl Failover {
    /// The `n`th failover's form: hard and planned take turns; without synchronous
    /// replication every other hard one, the first included, loses the primary's last
    /// commits.
    fn nth(n: usize, synchronous: bool) -> Failover {
        match (n % 4, synchronous) {
            (1 | 3, _) => Failover::Planned,
            (0, false) => Failover::AsyncLoss,
            _ => Failover::Hard,
        }
    }
}

/// How long a promotion may take (Patroni's ttl is 10 s).
const PROMOTION_LIMIT: Duration = Duration::from_secs(40);

/// `pg-failover`: replaces lockdb's primary, waits until railguard grants again, and brings the
/// old primary back as a standby before the next fault.
async fn failover(targets: &mut Targets<'_>) -> String {
    let before = targets.lockdb.token_position().await;
    let LockDb::Patroni {
        cluster,
        failovers,
        synchronous,
    } = &mut *targets.lockdb
    else {
        return "lockdb is not a Patroni cluster".to_string();
    };
    let form = Failover::nth(*failovers, *synchronous);
    *failovers += 1;
    let began = Instant::now();
    let (old, new, lost) = match form {
        Failover::Planned => {
            let old = cluster.primary().await;
            let new = cluster.switchover().await;
            (old, new, String::new())
        }
        Failover::Hard | Failover::AsyncLoss => {
            let old = cluster.primary().await;
            let mut lost = String::new();
            if form == Failover::AsyncLoss {
                cluster.pause_replication().await;
                tokio::time::sleep(Duration::from_secs(1)).await;
                lost = ", after 1 s of commits its standbys never received".to_string();
            }
            cluster.kill_member(old).await;
            let new = cluster.wait_for_new_primary(old, PROMOTION_LIMIT).await;
            (old, new, lost)
        }
    };
    let promoted = began.elapsed();
    let names = (
        cluster.member_name(old).to_string(),
        cluster.member_name(new).to_string(),
    );
    let after = targets.lockdb.token_position().await;
    let recovery = recover(targets.proxies, targets.operator).await;
    let mut said = match form {
        Failover::Planned => format!(
            "switchover {} → {} in {} ms (fencing_token_seq {before} before, {after} after); \
             {recovery}",
            names.0,
            names.1,
            promoted.as_millis()
        ),
        _ => format!(
            "{} failover: primary {} SIGKILLed{lost}, {} promoted after {} ms \
             (fencing_token_seq {before} before, {after} after); {recovery}",
            if form == Failover::Hard {
                "hard"
            } else {
                "async-loss"
            },
            names.0,
            names.1,
            promoted.as_millis()
        ),
    };
    if form != Failover::Planned {
        let LockDb::Patroni { cluster, .. } = &mut *targets.lockdb else {
            unreachable!("matched above")
        };
        let rejoining = Instant::now();
        cluster.restart_member(old).await;
        said.push_str(&format!(
            "; {} rejoined as a standby after {} ms",
            names.0,
            rejoining.elapsed().as_millis()
        ));
    }
    said
}

/// How long railguard may say it refuses on purpose (it saw the store go back) before the
/// operator runs `railguard fast-forward`, and then before a restart.
const OPERATOR_PATIENCE: Duration = Duration::from_secs(1);
const GUARD_PATIENCE: Duration = Duration::from_secs(5);
/// How long every railguard must keep granting for recovery to count as done.
const SETTLE: Duration = Duration::from_secs(1);

/// Waits until every railguard grants (a probe grant on a key no worker uses, released at once)
/// and says `/readyz`, and still does a second later. One that refuses because its token source is behind (it says
/// to run `railguard fast-forward`) gets what an operator does: `railguard fast-forward`,
/// then, if its guard has not reopened a few seconds later, a restart. Says what it took.
pub(crate) async fn recover(proxies: &mut [Railguard], operator: &Operator) -> String {
    let began = Instant::now();
    let mut fast_forward: Option<String> = None;
    let mut restarted = Vec::new();
    let mut refusing_since: Option<Instant> = None;
    let mut granting_since: Option<Duration> = None;
    loop {
        let mut refusing = Vec::new();
        let mut down = Vec::new();
        for (i, rg) in proxies.iter().enumerate() {
            match state(rg).await {
                State::Granting => {}
                State::Refusing => refusing.push(i),
                State::Down(why) => down.push((i, why)),
            }
        }
        if refusing.is_empty() && down.is_empty() {
            // Granting, and still a moment later: under load, the workers' own grants are
            // what shows whether the token source went back.
            let since = *granting_since.get_or_insert_with(|| began.elapsed());
            if began.elapsed() < since + SETTLE {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let mut said = format!("granting again after {} ms", since.as_millis());
            if let Some(ff) = &fast_forward {
                said.push_str(&format!(", after `railguard fast-forward` ({ff})"));
            }
            if !restarted.is_empty() {
                said.push_str(&format!(" and a restart of railguard {restarted:?}"));
            }
            return said;
        }
        granting_since = None;
        if began.elapsed() > RECOVERY_LIMIT {
            return format!(
                "railguard NOT granting {} s later (refusing: {refusing:?}, down: {down:?}; \
                 fast-forward: {})",
                RECOVERY_LIMIT.as_secs(),
                fast_forward.as_deref().unwrap_or("not run")
            );
        }
        if refusing.is_empty() {
            refusing_since = None;
        } else {
            let since = *refusing_since.get_or_insert_with(Instant::now);
            if fast_forward.is_none() && since.elapsed() > OPERATOR_PATIENCE {
                fast_forward = Some(run_fast_forward(operator).await);
                refusing_since = Some(Instant::now());
            } else if fast_forward.is_some()
                && restarted.is_empty()
                && since.elapsed() > GUARD_PATIENCE
            {
                for i in refusing {
                    let rg = &mut proxies[i];
                    rg.stop().await;
                    rg.start_again().await;
                    restarted.push(i);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a railguard's lock service does now.
#[derive(Debug)]
enum State {
    /// Grants, and `/readyz` says ready.
    Granting,
    /// Refuses on purpose: its token source is behind (it names `railguard fast-forward`).
    Refusing,
    /// Cannot grant now (a store it needs is unreachable, say).
    Down(String),
}

async fn state(rg: &Railguard) -> State {
    let client = rg.lock_client().with_timeout(Duration::from_secs(2));
    let refusal = |message: &str| message.contains("fast-forward");
    match client
        .acquire(
            "harness-recovery-probe",
            "harness",
            Duration::from_secs(1),
            Duration::ZERO,
        )
        .await
    {
        Ok(handle) => {
            let _ = client.release(handle).await;
        }
        // Held by a probe whose release was lost: the service grants.
        Err(railguard_sdk::SdkError::Held) => {}
        Err(e) if refusal(&e.to_string()) => return State::Refusing,
        Err(e) => return State::Down(e.to_string()),
    }
    match Http::new()
        .get(&format!("http://{}/readyz", rg.admin))
        .await
    {
        Ok((http::StatusCode::OK, _)) => State::Granting,
        Ok((_, body)) if refusal(&body) => State::Refusing,
        Ok((status, body)) => State::Down(format!("/readyz {status}: {}", body.trim())),
        Err(e) => State::Down(format!("/readyz: {e}")),
    }
}

/// `railguard fast-forward` past the marks and paydb's fences; its exit and last line.
async fn run_fast_forward(operator: &Operator) -> String {
    let run = tokio::process::Command::new(railguard_testkit::railguard_binary())
        .arg("fast-forward")
        .arg("--config")
        .arg(&operator.config)
        .args(["--paydb-url", &operator.paydb_url])
        .args(["--paydb-table", "account", "--paydb-column", "fence"])
        .envs(operator.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output();
    match tokio::time::timeout(Duration::from_secs(60), run).await {
        Ok(Ok(out)) => {
            // The verdict is stdout's last line; stderr has progress, or why it failed.
            let last = |bytes: &[u8]| {
                String::from_utf8_lossy(bytes)
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .map(|l| l.trim().to_string())
            };
            let said = match out.status.success() {
                true => last(&out.stdout).or_else(|| last(&out.stderr)),
                false => last(&out.stderr).or_else(|| last(&out.stdout)),
            };
            format!("{}: {}", out.status, said.unwrap_or_default())
        }
        Ok(Err(e)) => format!("cannot run it: {e}"),
        Err(_) => "did not finish within 60 s".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_refuse_what_does_not_apply() {
        let pg = Setup::default();
        let etcd = |n| Setup {
            etcd_members: Some(n),
            ..Setup::default()
        };
        let patroni = Setup {
            patroni: true,
            ..Setup::default()
        };
        let patroni_sync = Setup {
            pg_synchronous: true,
            ..patroni
        };
        assert_eq!(FaultKind::parse_list("none", pg).unwrap(), vec![]);
        let all_pg = FaultKind::parse_list("all", pg).unwrap();
        assert!(!all_pg.contains(&FaultKind::EtcdMemberRestart));
        assert!(!all_pg.contains(&FaultKind::EtcdRestore));
        assert!(all_pg.contains(&FaultKind::PgRewindData));
        assert!(!all_pg.contains(&FaultKind::PgFailover));
        assert_eq!(FaultKind::parse_list("all", etcd(3)).unwrap().len(), 17);
        let all_patroni = FaultKind::parse_list("all", patroni).unwrap();
        assert!(all_patroni.contains(&FaultKind::PgFailover));
        for single in ["pg-kill", "pg-path-cut", "pg-path-delay", "pg-rewind-data"] {
            assert!(!all_patroni.contains(&FaultKind::parse(single).unwrap()));
            assert!(
                FaultKind::parse_list(single, patroni)
                    .unwrap_err()
                    .contains("--pg single")
            );
        }
        assert!(
            FaultKind::parse_list("pg-failover", pg)
                .unwrap_err()
                .contains("--pg patroni")
        );
        // The takeover kinds run when named, never in `all`.
        for all in [&all_pg, &all_patroni] {
            assert!(!all.contains(&FaultKind::PgRewindTakeover));
            assert!(!all.contains(&FaultKind::PgFailoverTakeover));
        }
        assert_eq!(
            FaultKind::parse_list("pg-rewind-takeover", etcd(1)).unwrap(),
            vec![FaultKind::PgRewindTakeover]
        );
        assert!(
            FaultKind::parse_list("pg-rewind-takeover", patroni)
                .unwrap_err()
                .contains("--pg single")
        );
        assert_eq!(
            FaultKind::parse_list("pg-failover-takeover", patroni).unwrap(),
            vec![FaultKind::PgFailoverTakeover]
        );
        assert!(
            FaultKind::parse_list("pg-failover-takeover", patroni_sync)
                .unwrap_err()
                .contains("--pg-sync off")
        );
        assert_eq!(
            FaultKind::parse_list("worker-sigstop,pg-kill", pg).unwrap(),
            vec![FaultKind::WorkerStop, FaultKind::PgKill]
        );
        assert!(
            FaultKind::parse_list("etcd-leader-kill", etcd(1))
                .unwrap_err()
                .contains("--etcd-members 3")
        );
        assert!(
            FaultKind::parse_list("etcd-restore", pg)
                .unwrap_err()
                .contains("the etcd backend")
        );
        assert_eq!(
            FaultKind::parse_list("etcd-restore,pg-rewind-data", etcd(1)).unwrap(),
            vec![FaultKind::EtcdRestore, FaultKind::PgRewindData]
        );
        assert!(
            FaultKind::parse_list("sigkill-everything", pg)
                .unwrap_err()
                .contains("unknown fault")
        );
    }

    #[test]
    fn failovers_take_turns_and_lose_commits_only_when_asynchronous() {
        let forms = |sync| (0..8).map(|n| Failover::nth(n, sync)).collect::<Vec<_>>();
        use Failover::*;
        assert_eq!(
            forms(false),
            [
                AsyncLoss, Planned, Hard, Planned, AsyncLoss, Planned, Hard, Planned
            ]
        );
        assert_eq!(
            forms(true),
            [Hard, Planned, Hard, Planned, Hard, Planned, Hard, Planned]
        );
    }

    #[test]
    fn a_schedule_uses_every_kind_before_repeating_and_a_seed_reproduces_it() {
        let kinds = FaultKind::ALL.to_vec();
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            let mut s = Schedule::new(kinds.clone());
            (0..30)
                .map(|_| s.next(&mut rng).unwrap())
                .collect::<Vec<_>>()
        };
        let a = draw(1);
        let mut first: Vec<_> = a[..20].to_vec();
        first.sort();
        assert_eq!(first, FaultKind::ALL.to_vec());
        assert_eq!(a, draw(1));
        assert_ne!(a, draw(2));
    }
}
