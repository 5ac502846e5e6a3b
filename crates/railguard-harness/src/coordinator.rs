//! `railguard harness`: starts a whole deployment on this machine, drives it with worker
//! processes while injecting faults, saves what every store recorded, and checks it.
//!
//! What it starts, and how the pieces are wired (each arrow a real TCP path):
//!
//! ```text
//!  workers ──relay──▶ railguard serve (lock API) ──▶ etcd (etcd backend)
//!          ──relay──▶ railguard serve (proxy) ──relay──▶ rail simulator
//!                            └──relay──▶ PostgreSQL (marks, records, postgres backend)
//!  workers ─────────▶ paydb (its own PostgreSQL)
//! ```
//!
//! With `--proxies N`, each `railguard serve` has relays of its own: from the workers, and to
//! the rail (so that `--rail-delay-ms` delays each process's forwards independently, as
//! separate network paths do); the relay to PostgreSQL is shared.
//!
//! With `--pg patroni`, railguard's PostgreSQL is a Patroni cluster instead, reached without a
//! relay through a URL naming every member (`target_session_attrs=read-write`), so that it
//! follows the primary across failovers as a production client does.
//!
//! Every relay can cut or slow its path; processes can be stopped and killed. Everything it
//! started is stopped at the end, whatever happened.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use railguard_testkit::{EtcdCluster, Http, PatroniCluster, Pg, Rail, Railguard, Relay};
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::check::{self, FaultRecord, InDoubtAtEnd, Inputs, Report};
use crate::faults::{self, FaultKind, Operator, Schedule, Setup, Targets, Timing};
use crate::history;
use crate::lockdb::LockDb;
use crate::operator::{self, Fleet};
use crate::paydb;
use crate::progress::Progress;
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackendChoice {
    Postgres,
    Etcd,
}

/// What railguard's own PostgreSQL is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PgChoice {
    /// One PostgreSQL cluster, behind a relay (the `pg-kill`, `pg-path-*`, `pg-rewind-data` and
    /// `pg-rewind-takeover` faults act on it).
    Single,
    /// A Patroni cluster (`--pg-members`, `--pg-sync`; the `pg-failover` fault acts on it).
    Patroni,
}

/// The bug a run has on purpose, to prove that the checker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum NegativeControl {
    /// Workers present the token re-read from the backend at write time (§A2.3). The proxy's
    /// grant proof would refuse such a token, so this control also turns the proof off.
    Reread,
    /// The proxy runs with `fencing.enforce = false`.
    KillSwitch,
    /// railguard runs with `guard.detect_store_changes = false`: it does not notice a store
    /// it fences against going back (`pg-rewind-data`, `etcd-restore`, `pg-failover`, and the
    /// takeover kinds).
    NoStoreChangeDetection,
    /// railguard runs with `fencing.order_across_processes = false`: with several railguard
    /// processes (`--proxies`), an account's requests are ordered at the rail only within
    /// each process.
    NoCrossProcessOrder,
    /// With `--operator-forgets`: the operator runs forget without `--dry-run` as soon as it
    /// finds a record in doubt whose owner is gone, and again on every pass until railguard
    /// accepts it, never asking the rail whether it has the payment (steps 2 to 4 of the
    /// in-doubt procedure skipped).
    OperatorSkipsTheWait,
}

#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct RunOptions {
    #[arg(long, value_enum, default_value = "postgres")]
    pub backend: BackendChoice,
    /// etcd members (1 or 3), for `--backend etcd`.
    #[arg(long, default_value_t = 1)]
    pub etcd_members: usize,
    /// railguard's own PostgreSQL (marks, idempotency records, the postgres lock backend).
    #[arg(long, value_enum, default_value = "single")]
    pub pg: PgChoice,
    /// PostgreSQL members of `--pg patroni` (2 or 3).
    #[arg(long, default_value_t = 2)]
    pub pg_members: usize,
    /// Patroni's synchronous_mode for `--pg patroni` (on|off). Off, a failover can lose the
    /// primary's last commits.
    #[arg(long, default_value = "off", action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub pg_sync: bool,
    /// `railguard serve` processes; workers spread their calls over all of them.
    #[arg(long, default_value_t = 1)]
    pub proxies: usize,
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    #[arg(long, default_value_t = 4)]
    pub accounts: usize,
    /// Keys workers also lock with no payment under them (`lock-only-0`, ...): no fencing
    /// mark ever records their tokens, which must increase all the same (INV-04).
    #[arg(long, default_value_t = 0)]
    pub lock_only_keys: usize,
    /// Workers fence only at the proxy: paydb keeps each payment's state, but no fenced UPDATE
    /// of the account row stands in front of the proxy (a worker with no database of its own).
    /// What only the proxy's fence stops then reaches the checker at the rail.
    #[arg(long)]
    pub proxy_only: bool,
    /// Workers do not keep their leases alive: every grant ends `--ttl-ms` after it was made,
    /// whatever its holder is doing — a submit still on its way to the rail included. With a
    /// slow path to the rail (`--rail-delay-ms` above the ttl) and several railguards, the next
    /// holder's request, sent through another railguard, races the late one.
    #[arg(long)]
    pub no_keep_alive: bool,
    /// An operator resolves payments left in doubt, following the in-doubt procedure
    /// (`railguard idempotency-forget`) for records whose owner the harness killed or
    /// restarted: it waits until forget's dry run says the time has passed, then asks the
    /// rail, and forgets only a payment the rail does not have (see `operator`).
    #[arg(long)]
    pub operator_forgets: bool,
    /// The railguards ask the rail simulator about a payment in doubt, by idempotency key, when
    /// a retry of its key finds its record in doubt (`[rail_lookup]`): paid, the record is
    /// completed with the rail's answer; not paid, it is forgotten once `idempotency-forget`
    /// would forget it without an operator's word.
    #[arg(long)]
    pub rail_lookup: bool,
    /// Payments created up front; enough that the workers stay busy for the whole run (they
    /// stop early when every payment is done, and faults after that would hit an idle system).
    #[arg(long, default_value_t = 20_000)]
    pub payments: usize,
    /// Lease length asked for; etcd grants whole seconds, 2000 ms at least.
    #[arg(long)]
    pub ttl_ms: Option<u64>,
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// `all`, `none`, or a comma-separated list (see `--help` of `railguard harness`).
    #[arg(long, default_value = "all")]
    pub faults: String,
    #[arg(long, value_enum)]
    pub negative_control: Option<NegativeControl>,
    /// Send `Idempotency-Key` with every submit. `false` makes any retry of a payment whose
    /// outcome was unknown a possible duplicate at the rail — INV-02 is then expected under
    /// faults that leave payments in doubt; the negative controls use it with `worker-pause`
    /// only, where the duplicate can come from the bug alone.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub idempotency_keys: bool,
    /// The proxy's request timeout.
    #[arg(long, default_value_t = 3000)]
    pub request_timeout_ms: u64,
    /// The rail simulator's own latency per payment.
    #[arg(long, default_value_t = 5)]
    pub rail_latency_ms: u64,
    /// Every railguard → rail relay delays each chunk, both ways, by a random 0..=MAX ms drawn
    /// per chunk, for the whole run: a slow, uneven network between railguard and the rail,
    /// never past the request deadline (twice MAX plus the rail's latency must stay below
    /// `--request-timeout-ms`). Each railguard has its own relay.
    #[arg(long, default_value_t = 0, value_name = "MAX")]
    pub rail_delay_ms: u64,
    /// Where the history, the stores' records, the logs and the report go (must not exist,
    /// or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Show progress on stderr (default: when stderr is a terminal and `CI` is unset).
    #[arg(long, action = clap::ArgAction::Set)]
    pub progress: Option<bool>,
}

impl RunOptions {
    fn etcd_members(&self) -> Option<usize> {
        (self.backend == BackendChoice::Etcd).then_some(self.etcd_members)
    }

    fn setup(&self) -> Setup {
        Setup {
            etcd_members: self.etcd_members(),
            patroni: self.pg == PgChoice::Patroni,
            pg_synchronous: self.pg_sync,
        }
    }

    fn ttl(&self) -> Duration {
        let asked = self.ttl_ms.unwrap_or(match self.backend {
            BackendChoice::Postgres => 1000,
            BackendChoice::Etcd => 2000,
        });
        Duration::from_millis(match self.backend {
            BackendChoice::Postgres => asked,
            // etcd leases are whole seconds, and etcd grants no less than its minimum.
            BackendChoice::Etcd => asked.max(2000).div_ceil(1000) * 1000,
        })
    }

    /// Refuses what cannot be run, before anything is started.
    pub fn validate(&self) -> Result<Vec<FaultKind>, String> {
        let positive = [
            ("--workers", self.workers),
            ("--accounts", self.accounts),
            ("--payments", self.payments),
            ("--proxies", self.proxies),
        ];
        for (flag, n) in positive {
            if n == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if self.proxies > 4 {
            return Err("--proxies must be at most 4".into());
        }
        if self.workers > 64 {
            return Err("--workers must be at most 64".into());
        }
        if self.lock_only_keys > 64 {
            return Err("--lock-only-keys must be at most 64".into());
        }
        if !matches!(self.etcd_members, 1 | 3) {
            return Err("--etcd-members must be 1 or 3".into());
        }
        if !matches!(self.pg_members, 2 | 3) {
            return Err("--pg-members must be 2 or 3".into());
        }
        if self.duration_s == 0 || self.duration_s > 3600 {
            return Err("--duration-s must be between 1 and 3600".into());
        }
        if !(100..=60_000).contains(&self.ttl().as_millis()) {
            return Err("--ttl-ms must be between 100 and 60000".into());
        }
        if self.request_timeout_ms < 200 {
            return Err("--request-timeout-ms must be at least 200".into());
        }
        if self.rail_delay_ms > 0
            && self.rail_delay_ms * 2 + self.rail_latency_ms >= self.request_timeout_ms
        {
            return Err(format!(
                "--rail-delay-ms {}: a forward could take {} ms both ways with the rail's \
                 latency, past --request-timeout-ms {}; a slow path here stays below the \
                 deadline (the rail-past-deadline fault goes past it)",
                self.rail_delay_ms,
                self.rail_delay_ms * 2 + self.rail_latency_ms,
                self.request_timeout_ms
            ));
        }
        if self.negative_control == Some(NegativeControl::OperatorSkipsTheWait)
            && !self.operator_forgets
        {
            return Err(
                "--negative-control operator-skips-the-wait needs --operator-forgets".into(),
            );
        }
        if self.out.exists()
            && std::fs::read_dir(&self.out).map_or(true, |mut d| d.next().is_some())
        {
            return Err(format!(
                "--out {}: exists and is not empty; a run never overwrites another",
                self.out.display()
            ));
        }
        FaultKind::parse_list(&self.faults, self.setup())
    }
}

/// A worker process and its id.
struct WorkerProcess {
    id: u32,
    child: Child,
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Runs the whole thing; the report says whether the invariants held.
pub async fn run(options: RunOptions, ci: bool, exe: &Path) -> Result<Report, String> {
    let kinds = options.validate()?;
    let out = options.out.clone();
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    write_json(&out.join("run.json"), &options)?;
    let ttl = options.ttl();
    let timeout = Duration::from_millis(options.request_timeout_ms);
    let pg = match options.pg {
        PgChoice::Single => "one PostgreSQL".to_string(),
        PgChoice::Patroni => format!(
            "Patroni PostgreSQL ({} members, synchronous_mode {})",
            options.pg_members,
            if options.pg_sync { "on" } else { "off" }
        ),
    };
    eprintln!(
        "harness: {:?} backend on {pg}, {} proxies, {} workers, {} accounts, {} payments, \
         ttl {} ms, {} s, seed {}, faults {}, control {:?}, idempotency keys {}, \
         rail delay 0..={} ms, leases kept alive {}, operator forgets {}",
        options.backend,
        options.proxies,
        options.workers,
        options.accounts,
        options.payments,
        ttl.as_millis(),
        options.duration_s,
        options.seed,
        options.faults,
        options.negative_control,
        options.idempotency_keys,
        options.rail_delay_ms,
        !options.no_keep_alive,
        options.operator_forgets
    );

    // The stores and the rail.
    let mut lockdb = match options.pg {
        PgChoice::Single => LockDb::Single(Box::new(
            Pg::builder()
                .start()
                .await
                .map_err(|e| format!("lock database: {e}"))?,
        )),
        PgChoice::Patroni => LockDb::Patroni {
            cluster: Box::new(
                PatroniCluster::builder()
                    .members(options.pg_members)
                    .synchronous_mode(options.pg_sync)
                    .start()
                    .await
                    .map_err(|e| format!("lock database (Patroni): {e}"))?,
            ),
            synchronous: options.pg_sync,
            failovers: 0,
        },
    };
    let paydb_pg = Pg::builder()
        .start()
        .await
        .map_err(|e| format!("paydb: {e}"))?;
    let paydb_client = paydb::connect(&paydb_pg.url())
        .await
        .map_err(|e| format!("paydb: {e}"))?;
    paydb::create(&paydb_client, options.accounts, options.payments).await?;
    let mut etcd = match options.etcd_members() {
        Some(members) => Some(
            EtcdCluster::builder()
                .members(members)
                .start()
                .await
                .map_err(|e| format!("etcd: {e}"))?,
        ),
        None => None,
    };
    let rail = Arc::new(Rail::with_latency(Duration::from_millis(options.rail_latency_ms)).await);
    // One path to the rail per railguard.
    let mut rail_relays = Vec::new();
    for _ in 0..options.proxies {
        let relay = Relay::start(rail.addr).await;
        relay.set_jitter(Duration::from_millis(options.rail_delay_ms));
        rail_relays.push(relay);
    }
    let pg_relay = match lockdb.single() {
        Some(pg) => Some(
            Relay::start(std::net::SocketAddr::from((
                [127, 0, 0, 1],
                pg.server.port(),
            )))
            .await,
        ),
        None => None,
    };

    // railguard.
    let mut env: Vec<(String, String)> = vec![
        (
            "RAILGUARD__PROXY__REQUEST_TIMEOUT_MS".into(),
            options.request_timeout_ms.to_string(),
        ),
        ("RAILGUARD__DATABASE__TIMEOUT_MS".into(), "1000".into()),
    ];
    if let Some(etcd) = &etcd {
        env.push(("RAILGUARD__LOCK__BACKEND".into(), "etcd".into()));
        env.push(("RAILGUARD__ETCD__ENDPOINTS".into(), etcd.endpoints_csv()));
        env.push(("RAILGUARD__ETCD__REQUEST_TIMEOUT_MS".into(), "1000".into()));
        env.push(("RAILGUARD__ETCD__DIAL_TIMEOUT_MS".into(), "1000".into()));
    }
    match options.negative_control {
        Some(NegativeControl::KillSwitch) => {
            env.push(("RAILGUARD__FENCING__ENFORCE".into(), "false".into()));
        }
        Some(NegativeControl::Reread) => {
            env.push(("RAILGUARD__FENCING__REQUIRE_PROOF".into(), "false".into()));
        }
        Some(NegativeControl::NoStoreChangeDetection) => {
            env.push((
                "RAILGUARD__GUARD__DETECT_STORE_CHANGES".into(),
                "false".into(),
            ));
        }
        Some(NegativeControl::NoCrossProcessOrder) => {
            env.push((
                "RAILGUARD__FENCING__ORDER_ACROSS_PROCESSES".into(),
                "false".into(),
            ));
        }
        Some(NegativeControl::OperatorSkipsTheWait) | None => {}
    }
    if options.rail_lookup {
        env.push((
            "RAILGUARD__RAIL_LOOKUP__PATH".into(),
            "/payments?account={account}&idempotency_key={key}".into(),
        ));
    }
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let database_url = match &pg_relay {
        Some(relay) => relay.postgres_url(&lockdb.url()),
        None => lockdb.url(),
    };
    let mut proxies = Vec::new();
    for relay in &rail_relays {
        proxies.push(Railguard::start_process(&database_url, &relay.url(), &env_refs).await);
    }
    let operator = Operator {
        config: proxies[0].config_path(),
        env: env.clone(),
        paydb_url: paydb_pg.url(),
    };
    let fleet = Arc::new(std::sync::Mutex::new(Fleet::default()));
    observe(&fleet, &proxies);
    let operator_stop = Arc::new(AtomicBool::new(false));
    let operator_task = options.operator_forgets.then(|| {
        tokio::spawn(operator::run(
            operator::Setup {
                database_url: lockdb.url(),
                rail: rail.clone(),
                fleet: fleet.clone(),
                env: env.clone(),
                history: out.join("history-operator.jsonl"),
                skip_the_wait: options.negative_control
                    == Some(NegativeControl::OperatorSkipsTheWait),
            },
            operator_stop.clone(),
        ))
    });
    let mut lock_relays = Vec::new();
    let mut proxy_relays = Vec::new();
    for rg in &proxies {
        lock_relays.push(Relay::start(rg.lock).await);
        proxy_relays.push(Relay::start(rg.proxy).await);
    }

    // The workers.
    let duration = Duration::from_secs(options.duration_s);
    let mut workers = Vec::new();
    for id in 1..=options.workers as u32 {
        workers.push(spawn_worker(
            exe,
            id,
            &options,
            ttl,
            duration,
            &lock_relays,
            &proxy_relays,
            &paydb_pg.url(),
            &lockdb.url(),
            etcd.as_ref(),
        )?);
    }
    let show_progress = options
        .progress
        .unwrap_or(!ci && std::io::stderr().is_terminal());
    let progress = show_progress.then(|| Progress::start(out.clone(), rail.clone()));

    // The faults, one at a time, until shortly before the workers stop.
    let mut rng = Rng::new(options.seed);
    let mut schedule = Schedule::new(kinds);
    let timing = Timing {
        stall: timing_short(ttl),
        long_stall: timing_long(ttl),
        ttl,
        request_timeout: timeout,
        rail_jitter: Duration::from_millis(options.rail_delay_ms),
    };
    let started = Instant::now();
    let faults_until = started + duration.saturating_sub(timing.stall + Duration::from_secs(1));
    let mut fault_log = Vec::new();
    tokio::time::sleep(Duration::from_millis(800).min(duration / 4)).await;
    while Instant::now() < faults_until {
        let Some(kind) = schedule.next(&mut rng) else {
            break;
        };
        let mut targets = Targets {
            worker_pids: workers
                .iter()
                .filter_map(|w| w.child.id().map(|pid| (w.id, pid)))
                .collect(),
            lockdb: &mut lockdb,
            etcd: etcd.as_mut(),
            proxies: &mut proxies,
            lock_relays: &lock_relays,
            proxy_relays: &proxy_relays,
            pg_relay: pg_relay.as_ref(),
            rail_relays: &rail_relays,
            operator: &operator,
            rail: &rail,
            history_dir: &out,
        };
        let record = faults::inject(kind, &mut targets, &mut rng, timing).await;
        observe(&fleet, &proxies);
        if let Some(p) = &progress {
            p.fault();
        }
        tracing::info!(kind = %record.kind, target = %record.target, "fault");
        fault_log.push(record);
        tokio::time::sleep(Duration::from_millis(rng.between(200, 700))).await;
    }
    write_jsonl(&out.join("faults.jsonl"), &fault_log)?;

    // The workers stop on their own at the deadline (or when every payment is done).
    let wait_until = started + duration + timing.long_stall * 2 + Duration::from_secs(15);
    for w in &mut workers {
        let left = wait_until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.child.wait()).await {
            Ok(Ok(status)) if !status.success() => {
                eprintln!(
                    "harness: worker {} exited with {status} (see worker-{}.log)",
                    w.id, w.id
                );
            }
            Ok(_) => {}
            Err(_) => {
                eprintln!("harness: worker {} did not stop; killed", w.id);
                let _ = w.child.kill().await;
            }
        }
    }
    if let Some(p) = progress {
        p.stop().await;
    }
    operator_stop.store(true, Ordering::Release);
    if let Some(task) = operator_task {
        let _ = task.await;
    }
    // Forwards still at the rail finish or time out.
    tokio::time::sleep(timeout.min(Duration::from_secs(2))).await;

    // What the stores recorded.
    let ledger = rail.ledger();
    write_json(&out.join("rail-ledger.json"), &ledger)?;
    let writes = paydb::account_writes(&paydb_client)
        .await
        .map_err(|e| format!("paydb write log: {e}"))?;
    write_json(&out.join("paydb-account-writes.json"), &writes)?;
    let payments = paydb::payments(&paydb_client)
        .await
        .map_err(|e| format!("paydb payments: {e}"))?;
    write_json(&out.join("paydb-payments.json"), &payments)?;
    // The payments railguard still holds in doubt (`409 in_doubt` to their retries), and what
    // the rail's lookup resolved (its audit records: counted across restarts).
    match paydb::connect(&lockdb.url()).await {
        Ok(client) => match client
            .query_one(
                IN_DOUBT_AT_END_SQL,
                &[&railguard::store::records::FIRST_REQUEST_AFTER_STORE_CHANGE],
            )
            .await
        {
            Ok(row) => {
                let count = |i: usize| usize::try_from(row.get::<_, i64>(i)).unwrap_or(0);
                let end = InDoubtAtEnd {
                    records: count(0),
                    paid_per_the_rail: count(1),
                    not_on_the_rail: count(2),
                    first_requests_after_store_change: count(3),
                };
                write_json(&out.join("in-doubt-at-end.json"), &end)?;
            }
            Err(e) => eprintln!("could not count the records in doubt at the end: {e}"),
        },
        Err(e) => eprintln!("could not count the records in doubt at the end: {e}"),
    }
    let http = Http::new();
    for (i, rg) in proxies.iter_mut().enumerate() {
        if let Ok((_, text)) = http.get(&format!("http://{}/metrics", rg.admin)).await {
            let _ = std::fs::write(out.join(format!("metrics-railguard-{i}.txt")), text);
        }
        rg.stop().await;
        let _ = std::fs::write(out.join(format!("railguard-{i}.log")), rg.log());
    }
    let report = check_dir(&out)?;
    if let Ok((moved, done)) = paydb::balance_check(&paydb_client).await
        && moved != done
        && !options.proxy_only
    {
        eprintln!(
            "harness: paydb balances moved by {moved} but completed payments sum to {done} \
             (a payment completed twice, or a completion without its payment)"
        );
    }
    drop(lockdb);
    drop(paydb_pg);
    drop(etcd);
    Ok(report)
}

/// Tells the operator which railguard processes run now.
fn observe(fleet: &std::sync::Mutex<Fleet>, proxies: &[Railguard]) {
    fleet
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .observe(proxies);
}

/// When workers take an unresolved payment again.
fn retry_after(ttl: Duration) -> Duration {
    ttl * 3
}

/// A stall past the lease but shorter than [`retry_after`]: the stale holder wakes to find
/// newer grants' payments at the rail.
fn timing_short(ttl: Duration) -> Duration {
    ttl * 2 + Duration::from_millis(500)
}

/// A stall past [`retry_after`]: the stale holder wakes to find its payment retried.
fn timing_long(ttl: Duration) -> Duration {
    ttl * 4 + Duration::from_millis(500)
}

#[allow(clippy::too_many_arguments)]
fn spawn_worker(
    exe: &Path,
    id: u32,
    options: &RunOptions,
    ttl: Duration,
    duration: Duration,
    lock_relays: &[Relay],
    proxy_relays: &[Relay],
    paydb_url: &str,
    lockdb_url: &str,
    etcd: Option<&EtcdCluster>,
) -> Result<WorkerProcess, String> {
    let out = &options.out;
    let log = std::fs::File::create(out.join(format!("worker-{id}.log")))
        .map_err(|e| format!("worker log: {e}"))?;
    let urls = |relays: &[Relay]| relays.iter().map(|r| r.url()).collect::<Vec<_>>().join(",");
    let mut command = Command::new(exe);
    command
        .arg("worker")
        .args(["--id", &id.to_string()])
        .args(["--lock-urls", &urls(lock_relays)])
        .args(["--proxy-urls", &urls(proxy_relays)])
        .args(["--paydb-url", paydb_url])
        .args(["--accounts", &options.accounts.to_string()])
        .args(["--lock-only-keys", &options.lock_only_keys.to_string()])
        .args(["--proxy-only", &options.proxy_only.to_string()])
        .args(["--no-keep-alive", &options.no_keep_alive.to_string()])
        .args(["--ttl-ms", &ttl.as_millis().to_string()])
        .args(["--duration-ms", &duration.as_millis().to_string()])
        .args(["--pause-ms", &timing_short(ttl).as_millis().to_string()])
        .args(["--long-pause-ms", &timing_long(ttl).as_millis().to_string()])
        .args([
            "--retry-after-ms",
            &retry_after(ttl).as_millis().to_string(),
        ])
        .args(["--seed", &options.seed.to_string()])
        .arg("--history")
        .arg(out.join(format!("history-{id}.jsonl")))
        .args(["--idempotency-keys", &options.idempotency_keys.to_string()]);
    if options.negative_control == Some(NegativeControl::Reread) {
        command.args(["--control", "reread"]);
        match etcd {
            Some(etcd) => command.args(["--etcd-endpoints", &etcd.endpoints_csv()]),
            None => command.args(["--lockdb-url", lockdb_url]),
        };
    }
    let stderr = log.try_clone().map_err(|e| format!("worker log: {e}"))?;
    let child = command
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(stderr))
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start worker {id}: {e}"))?;
    Ok(WorkerProcess { id, child })
}

fn write_jsonl<T: Serialize>(path: &Path, items: &[T]) -> Result<(), String> {
    let mut text = String::new();
    for item in items {
        text.push_str(&serde_json::to_string(item).map_err(|e| e.to_string())?);
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// `railguard harness check DIR`: checks a saved run again, offline, and rewrites its report.
pub fn check_dir(dir: &Path) -> Result<Report, String> {
    let (history, torn) = history::read_dir(dir)
        .map_err(|e| format!("cannot read the history in {}: {e}", dir.display()))?;
    if history.is_empty() {
        return Err(format!(
            "{}: no history-*.jsonl — not a harness run",
            dir.display()
        ));
    }
    let faults: Vec<FaultRecord> = match std::fs::read_to_string(dir.join("faults.jsonl")) {
        Ok(text) => text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).map_err(|e| format!("faults.jsonl: {e}")))
            .collect::<Result<_, _>>()?,
        Err(_) => Vec::new(),
    };
    let inputs = Inputs {
        history,
        ledger: read_json(&dir.join("rail-ledger.json"))?,
        account_writes: read_json(&dir.join("paydb-account-writes.json"))?,
        payments: read_json(&dir.join("paydb-payments.json"))?,
        faults,
        fenced_out_metric: fenced_out_metric(dir),
        in_doubt_at_end: read_json(&dir.join("in-doubt-at-end.json")).ok(),
        torn_lines: torn,
    };
    let report = check::check(&inputs);
    write_json(&dir.join("report.json"), &report)?;
    std::fs::write(dir.join("report.txt"), report.table())
        .map_err(|e| format!("cannot write the report: {e}"))?;
    Ok(report)
}

/// Idempotency records in doubt in railguard's PostgreSQL — declared so, or in flight past
/// their owner's deadline: railguard answers `409 in_doubt` for both — and the records the rail's
/// lookup completed or forgot, and the retries whose record went back with the store it let
/// through (`idempotency::resolve`'s audit records; `$1`: the last ones' result).
const IN_DOUBT_AT_END_SQL: &str = "\
SELECT (SELECT count(*) FROM idempotency_record
        WHERE state = 'in_doubt'
           OR (state = 'in_flight' AND now() > COALESCE(in_doubt_at, created_at))),
       (SELECT count(*) FROM railguard_audit
        WHERE action = 'idempotency_resolve' AND outcome->>'result' = 'completed_from_the_rail'),
       (SELECT count(*) FROM railguard_audit
        WHERE action = 'idempotency_forget' AND reason LIKE 'the rail''s lookup%'),
       (SELECT count(*) FROM railguard_audit
        WHERE action = 'idempotency_resolve' AND outcome->>'result' = $1)";

/// `lock_fenced_out_total` summed over the saved metrics of every railguard.
fn fenced_out_metric(dir: &Path) -> Option<f64> {
    let mut total = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("metrics-") && name.ends_with(".txt")) {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).ok()?;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("lock_fenced_out_total") else {
                continue;
            };
            // `lock_fenced_out_total 3` or `lock_fenced_out_total{…} 3`.
            if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                *total.get_or_insert(0.0) += v;
            }
        }
    }
    total
}
