//! The `wire` suite: railguard against nginx, each a process of its own, under load from `wrk`.
//!
//! The `proxy` suite runs everything in one process, which is quick to set up but cannot say
//! what the proxy itself costs: the load generator, the rail simulator and the proxy share a
//! runtime and a `/proc/self/stat`. Here every component is a separate process, so CPU time
//! and context switches per request are read for each one from `/proc`:
//!
//! - the upstream: nginx answering `201` itself (`--upstream static`, the default: its cost is
//!   small and the same in every phase) or `railguard rail-sim` (`--upstream rail-sim`);
//! - nginx 1.22 as a plain reverse proxy in front of that upstream (keep-alive, HTTP/1.1,
//!   `X-Forwarded-For`), one worker per CPU;
//! - `bare-proxy` (this crate's second binary), a bare hyper proxy in front of the same
//!   upstream: a hyper 1 server on a multi-thread tokio runtime that reads each body whole and
//!   forwards through hyper-util's pooled client. It does what any Rust proxy built on hyper
//!   does for a request and nothing else, so railguard's CPU per request above it is
//!   railguard's own work;
//! - `railguard serve` twice on the same throwaway durable PostgreSQL: fencing enforced, and
//!   fencing off (`fencing.enforce = false`: the compare-and-set still runs, nothing is
//!   refused), each at the default configuration (log level `info`, its log to a file);
//! - with `--order-off`, a third: fencing enforced with `fencing.order_across_processes =
//!   false` (no process's entries waited for, no `railguard_forwarder` row written; the
//!   compare-and-set still writes the process's entry into the mark row); with
//!   `--baseline-bin`, another binary (an earlier commit, say) fenced at its defaults, its
//!   stale-token phase too (its stale accounts raised through it); with `--per-core`, one
//!   railguard process per CPU on one database, each with `runtime.worker_threads = 1`, sharing
//!   one proxy address through `proxy.reuse_port` (the kernel spreads wrk's connections among
//!   them), their CPU and context switches summed: a runtime per core, as nginx runs a worker
//!   per core, against the one multi-thread runtime of the default;
//! - each railguard on a database of its own in that cluster, so that none meets another
//!   process's entries in the mark rows (`store::handover`) and each is measured as one
//!   process alone;
//! - `wrk` sending what a worker sends (`wrk::Requests`): token, account, grant proof, and in
//!   the phases that say so an `Idempotency-Key` unique across the run;
//! - `pgbench` running the single-row compare-and-set on the same database.
//!
//! Phases run interleaved round-robin, every other repetition in reverse order, each after a
//! warm-up, so every ratio divides two medians taken at the same time; a variant's ratio to
//! the default is also given per repetition (the two phases ran side by side), as its spread. A second group of phases measures latency at one
//! connection: the p50 that railguard adds over the direct path and over the bare hyper proxy,
//! against one durable commit (pgbench's p50 at one client).

pub(crate) mod procs;
mod profiler;
mod report;
mod wrk;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use railguard_testkit::Pg;

use crate::bench::{ACCOUNT_PREFIX, STALE_MARK, STALE_PREFIX, TOKEN, advance_all, proxy_config};
use crate::cpu;
use crate::pgbench::{Pgbench, cas_script};
use procs::{Spawned, Usage};
pub(crate) use report::{StatementCost, TableScans, WireReport};
use wrk::{Requests, Wrk};

/// The stale phase's token: below every stale account's mark.
const STALE_TOKEN: i64 = 1;
/// Accounts of the stale phase (fewer if `accounts` is smaller).
const STALE_ACCOUNTS: u64 = 1_000;

/// Which upstream the proxies forward to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum UpstreamKind {
    /// nginx answering 201 itself.
    Static,
    /// `railguard rail-sim`.
    RailSim,
}

#[derive(Debug, Clone)]
pub(crate) struct WireOptions {
    pub duration: Duration,
    pub warmup: Duration,
    pub repeats: u32,
    pub connections: usize,
    pub accounts: u64,
    pub pool_size: usize,
    pub upstream: UpstreamKind,
    /// Measured seconds of each phase at one connection (0 skips them).
    pub latency_duration: Duration,
    /// `fencing.batch_concurrency` of both railguards (None: the default).
    pub batch_concurrency: Option<usize>,
    /// Record a `perf` profile of the proxy process during each measured proxy phase into
    /// this directory (`perf record -e cpu-clock --call-graph dwarf`), the one-connection
    /// phases too (`…-one-connection.perf.data`): it slows the proxy, so a profiling run's
    /// rates are not comparable.
    pub profile_dir: Option<std::path::PathBuf>,
    /// Count the proxy process's system calls during each measured proxy phase (`perf
    /// stat`), reported per request.
    pub count_syscalls: bool,
    /// PostgreSQL server settings for the run, `(name, value)`, over its defaults.
    pub pg_settings: Vec<(String, String)>,
    /// Also run the fenced phases through a railguard with
    /// `fencing.order_across_processes = false`.
    pub order_off: bool,
    /// Also run the fenced phases through this `railguard` binary (another build), on a
    /// database it migrates itself; the label names it in the report.
    pub baseline: Option<Baseline>,
    /// Also run the fenced phases through one railguard process per CPU, each with one
    /// runtime thread, sharing the proxy address (`proxy.reuse_port`).
    pub per_core: bool,
    /// The `RAILGUARD__…` settings of the environment (`NAME=value`, sorted), which every
    /// railguard process of the run inherits: the report names them.
    pub overrides: Vec<String>,
}

/// Another `railguard` binary whose fenced forward is measured beside this build's.
#[derive(Debug, Clone)]
pub(crate) struct Baseline {
    pub binary: std::path::PathBuf,
    pub label: String,
}

/// What one phase sends load through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Direct,
    Nginx,
    /// `bare-proxy`: hyper's server and pooled client, nothing else.
    Bare,
    /// `bare-proxy --fence-database`: the same, with the grant proof checked and one
    /// group-committed compare-and-set (railguard's statement) before each forward, and a
    /// keyed request's answer stored (railguard's completion) before it is answered.
    BareFenced,
    /// `bare-proxy --fence-database --last-look`: the same, and railguard's last look.
    BareLooked,
    RailguardOff,
    Fenced,
    /// Fenced, `fencing.order_across_processes = false`.
    Unordered,
    /// Fenced, through the baseline binary.
    Baseline,
    /// Fenced, through one single-threaded railguard process per CPU on one address.
    PerCore,
    Pgbench,
}

/// One phase: a route, its requests, and how many connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Phase {
    pub route: Route,
    /// The baseline binary's label (`Route::Baseline`).
    pub baseline: Option<&'static str>,
    pub keys: bool,
    pub stale: bool,
    pub connections: usize,
}

impl Phase {
    pub(crate) fn label(&self) -> String {
        let what = match (self.route, self.stale) {
            (Route::Direct, _) => "direct to the upstream".to_string(),
            (Route::Nginx, _) => "nginx, plain reverse proxy".to_string(),
            (Route::Bare, _) => "a bare hyper proxy".to_string(),
            (Route::BareFenced, _) => "a bare hyper proxy with railguard's statements".to_string(),
            (Route::BareLooked, _) => {
                "a bare hyper proxy with railguard's statements and last look".to_string()
            }
            (Route::RailguardOff, _) => "railguard, fencing off".to_string(),
            (Route::Fenced, true) => "railguard, stale token → 409".to_string(),
            (Route::Fenced, false) => "railguard, fenced".to_string(),
            (Route::Unordered, _) => {
                "railguard, fenced, order_across_processes = false".to_string()
            }
            (Route::PerCore, _) => {
                "railguard, fenced, a process per CPU, 1 thread each, reuse_port".to_string()
            }
            (Route::Baseline, stale) => format!(
                "railguard {}, {}",
                self.baseline.unwrap_or("baseline"),
                if stale {
                    "stale token → 409"
                } else {
                    "fenced"
                }
            ),
            (Route::Pgbench, _) => "pgbench, the same single-row CAS".to_string(),
        };
        let keys = match self.route {
            Route::Pgbench => "",
            _ if self.keys => ", with keys",
            _ => ", no keys",
        };
        format!("{what}{keys}")
    }

    /// Whether every answer should be a 2xx (otherwise every answer should be a refusal).
    fn accepted(&self) -> bool {
        !self.stale
    }
}

/// The phases, in the order each round runs them.
fn phases(o: &WireOptions) -> Vec<Phase> {
    let c = o.connections;
    // Leaked once per run: a phase is `Copy`, and the label lives as long as the report.
    let baseline: Option<&'static str> = o
        .baseline
        .as_ref()
        .map(|b| &*Box::leak(b.label.clone().into_boxed_str()));
    let p = |route, keys, stale, connections| Phase {
        route,
        baseline,
        keys,
        stale,
        connections,
    };
    let mut all = vec![
        p(Route::Direct, true, false, c),
        p(Route::Nginx, true, false, c),
        p(Route::RailguardOff, false, false, c),
    ];
    // The fenced forward, unkeyed then keyed, each after the bare proxy with the same requests
    // and followed by its variants: what they are compared with runs next to them.
    for keys in [false, true] {
        all.push(p(Route::Bare, keys, false, c));
        all.push(p(Route::BareFenced, keys, false, c));
        all.push(p(Route::BareLooked, keys, false, c));
        all.push(p(Route::Fenced, keys, false, c));
        if o.order_off {
            all.push(p(Route::Unordered, keys, false, c));
        }
        if o.per_core {
            all.push(p(Route::PerCore, keys, false, c));
        }
        if o.baseline.is_some() {
            all.push(p(Route::Baseline, keys, false, c));
        }
    }
    all.push(p(Route::Fenced, false, true, c));
    if o.baseline.is_some() {
        all.push(p(Route::Baseline, false, true, c));
    }
    all.push(p(Route::Pgbench, false, false, c));
    if !o.latency_duration.is_zero() {
        all.extend([
            p(Route::Direct, true, false, 1),
            p(Route::Nginx, true, false, 1),
        ]);
        // The baseline build's one-connection phases right after this build's, as at 64.
        for keys in [false, true] {
            all.push(p(Route::Bare, keys, false, 1));
            all.push(p(Route::Fenced, keys, false, 1));
            if o.baseline.is_some() {
                all.push(p(Route::Baseline, keys, false, 1));
            }
        }
        all.push(p(Route::Pgbench, false, false, 1));
    }
    all
}

/// One repetition of one phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    pub rate: f64,
    pub requests: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// CPU seconds of the proxy process (railguard, the bare proxy, or nginx with its
    /// workers).
    pub proxy_cpu: f64,
    pub proxy_switches: u64,
    /// Of `proxy_switches`, the involuntary ones (the thread was preempted).
    pub proxy_involuntary: u64,
    pub upstream_cpu: f64,
    /// CPU seconds of the load generator (wrk), read from this process's reaped children when
    /// wrk has exited; `None` when a profiler (also a reaped child) ran in the same window.
    pub load_cpu: Option<f64>,
    /// All of PostgreSQL: backends, background processes, reaped children.
    pub postgres_cpu: f64,
    /// PostgreSQL's live client backends only: the statements' own cost (railguard phases).
    pub postgres_backend_cpu: f64,
    pub machine_busy: f64,
    /// Mean rows per fence compare-and-set statement (railguard phases).
    pub batch_rows: f64,
    /// The proxy process's system calls (`--count-syscalls`).
    pub syscalls: Option<profiler::Syscalls>,
    pub problems: Vec<String>,
}

/// The processes of a run.
struct Components {
    upstream: Spawned,
    nginx: Spawned,
    bare: Spawned,
    bare_fenced: Spawned,
    bare_looked: Spawned,
    off: Spawned,
    fenced: Spawned,
    unordered: Option<Spawned>,
    baseline: Option<Spawned>,
    /// The processes of `Route::PerCore` (none unless asked for).
    per_core: Vec<Spawned>,
}

pub(crate) async fn run(options: WireOptions) -> Result<WireReport, String> {
    let work = tempfile::Builder::new()
        .prefix("railguard-wire-")
        .tempdir_in("/var/tmp")
        .map_err(|e| format!("cannot create a directory under /var/tmp: {e}"))?;
    eprintln!("wire: starting PostgreSQL (durable) under /var/tmp");
    let mut builder = Pg::builder().durable(true).temp_dir_in("/var/tmp");
    if options.order_off || options.baseline.is_some() || options.per_core {
        // Up to four railguards' sessions beside pgbench's 64 clients; a setting given on the
        // command line comes later and wins.
        builder = builder.setting("max_connections", "300");
    }
    for (name, value) in &options.pg_settings {
        builder = builder.setting(name, value);
    }
    let mut postgres = builder.start().await.map_err(|e| e.to_string())?;
    let result = with_postgres(&options, &postgres, work.path()).await;
    let version = postgres.version().await;
    postgres.server.stop().await;
    let mut report = result?;
    report.postgres = version;
    Ok(report)
}

/// A database of its own for one railguard, in the run's cluster, migrated by `binary` (a
/// binary of another version must find the schema it knows, not this build's) and holding the
/// benchmark's grant-proof key; its URL. `None`: the cluster's own database.
async fn database_for(
    pg: &Pg,
    dir: &Path,
    binary: &Path,
    name: Option<&str>,
    pool_size: usize,
) -> Result<String, String> {
    let url = match name {
        None => pg.url(),
        Some(name) => {
            let client = pg.client_with(&pg.url()).await?;
            client
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .map_err(|e| format!("creating database {name}: {e}"))?;
            let base = pg.url();
            let (server, _) = base
                .rsplit_once('/')
                .ok_or("a database URL without a path")?;
            format!("{server}/{name}")
        }
    };
    let config_name = format!("migrate-{}", name.unwrap_or("main"));
    procs::migrate(binary, &config_name, dir, proxy_config(pool_size), &url).await?;
    crate::load::store_proof_key(&url)
        .await
        .map_err(|e| format!("storing the grant-proof key: {e}"))?;
    Ok(url)
}

async fn with_postgres(o: &WireOptions, pg: &Pg, dir: &Path) -> Result<WireReport, String> {
    let binary = railguard_testkit::railguard_binary();
    let url = database_for(pg, dir, &binary, None, o.pool_size).await?;
    let off_url = database_for(pg, dir, &binary, Some("railguard_off"), o.pool_size).await?;
    let upstream = match o.upstream {
        UpstreamKind::Static => procs::static_upstream(dir).await?,
        UpstreamKind::RailSim => procs::rail_sim(dir).await?,
    };
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let nginx = procs::nginx_proxy(dir, upstream.addr, cpus).await?;
    let bare = procs::bare_proxy(dir, upstream.addr, None).await?;
    let mut floors = Vec::new();
    for (name, last_look) in [("bare_fenced", false), ("bare_looked", true)] {
        let url = database_for(pg, dir, &binary, Some(name), o.pool_size).await?;
        floors.push(procs::bare_proxy(dir, upstream.addr, Some((&url, last_look))).await?);
    }
    let (bare_looked, bare_fenced) = (floors.pop(), floors.pop());
    let (Some(bare_fenced), Some(bare_looked)) = (bare_fenced, bare_looked) else {
        return Err("the fenced bare proxies did not start".into());
    };
    let mut config = proxy_config(o.pool_size);
    if let Some(concurrency) = o.batch_concurrency {
        config.fencing.batch_concurrency = concurrency;
    }
    let fenced = procs::railguard(
        &binary,
        "railguard-fenced",
        dir,
        config.clone(),
        upstream.addr,
        &url,
    )
    .await?;
    let mut off_config = config.clone();
    off_config.fencing.enforce = false;
    eprintln!(
        "wire: starting railguard with fencing.enforce = false; the error it logs about that is expected"
    );
    let off = procs::railguard(
        &binary,
        "railguard-off",
        dir,
        off_config,
        upstream.addr,
        &off_url,
    )
    .await?;
    let unordered = if o.order_off {
        let url = database_for(pg, dir, &binary, Some("railguard_unordered"), o.pool_size).await?;
        let mut config = config.clone();
        config.fencing.order_across_processes = false;
        eprintln!(
            "wire: starting railguard with fencing.order_across_processes = false; the error it logs about that is expected"
        );
        Some(
            procs::railguard(
                &binary,
                "railguard-unordered",
                dir,
                config,
                upstream.addr,
                &url,
            )
            .await?,
        )
    } else {
        None
    };
    let baseline = match &o.baseline {
        Some(baseline) => {
            let url = database_for(
                pg,
                dir,
                &baseline.binary,
                Some("railguard_baseline"),
                o.pool_size,
            )
            .await?;
            Some(
                procs::railguard(
                    &baseline.binary,
                    "railguard-baseline",
                    dir,
                    config.clone(),
                    upstream.addr,
                    &url,
                )
                .await?,
            )
        }
        None => None,
    };
    let per_core = if o.per_core {
        let url = database_for(pg, dir, &binary, Some("railguard_per_core"), o.pool_size).await?;
        let mut config = config.clone();
        config.runtime.worker_threads = 1;
        config.proxy.reuse_port = true;
        // Each process's pool is its share of the default's: PostgreSQL sees as many
        // sessions as from the one process of the default.
        config.database.pool_size = (o.pool_size / cpus).max(2);
        procs::railguards_sharing(
            &binary,
            "railguard-per-core",
            dir,
            &config,
            upstream.addr,
            &url,
            cpus,
        )
        .await?
    } else {
        Vec::new()
    };
    let components = Components {
        upstream,
        nginx,
        bare,
        bare_fenced,
        bare_looked,
        off,
        fenced,
        unordered,
        baseline,
        per_core,
    };
    let result = measure_all(o, pg, dir, &components).await;
    let Components {
        upstream,
        nginx,
        bare,
        bare_fenced,
        bare_looked,
        off,
        fenced,
        unordered,
        baseline,
        per_core,
    } = components;
    for process in [fenced, off, bare_looked, bare_fenced, bare, nginx, upstream]
        .into_iter()
        .chain(unordered)
        .chain(baseline)
        .chain(per_core)
    {
        process.stop().await;
    }
    let mut report = result?;
    // A backend reports its counts as it exits, just after its client closed the connection.
    tokio::time::sleep(Duration::from_secs(1)).await;
    if let Ok(client) = pg.client_with(&pg.url()).await {
        report.table_scans = table_scans(&client).await;
        report.top_statements = top_statements(&client).await;
    }
    Ok(report)
}

/// The ten statements that took the most execution time, if `pg_stat_statements` is loaded.
async fn top_statements(client: &tokio_postgres::Client) -> Vec<StatementCost> {
    if client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
        .is_err()
    {
        return Vec::new();
    }
    let rows = client
        .query(
            "SELECT query, calls, rows, total_exec_time, plans, total_plan_time,
                    wal_bytes::float8, wal_fpi
             FROM pg_stat_statements WHERE toplevel
             ORDER BY total_exec_time + total_plan_time DESC LIMIT 10",
            &[],
        )
        .await
        .unwrap_or_default();
    rows.iter()
        .map(|row| {
            let query: String = row.get(0);
            StatementCost {
                query: query
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
                    .chars()
                    .take(90)
                    .collect(),
                calls: row.get(1),
                rows: row.get(2),
                total_ms: row.get(3),
                plans: row.get(4),
                plan_ms: row.get(5),
                wal_bytes: row.get(6),
                wal_full_page_images: row.get(7),
            }
        })
        .collect()
}

/// Scans of railguard's hot tables since the cluster started; empty if they cannot be read.
async fn table_scans(client: &tokio_postgres::Client) -> Vec<TableScans> {
    let rows = client
        .query(
            "SELECT relname::text, coalesce(seq_scan, 0), coalesce(seq_tup_read, 0),
                    coalesce(idx_scan, 0)
             FROM pg_stat_user_tables
             WHERE relname IN ('idempotency_record', 'rail_high_water')
             ORDER BY relname",
            &[],
        )
        .await
        .unwrap_or_default();
    rows.iter()
        .map(|row| TableScans {
            table: row.get(0),
            seq_scans: row.get(1),
            seq_rows_read: row.get(2),
            index_scans: row.get(3),
        })
        .collect()
}

async fn measure_all(
    o: &WireOptions,
    pg: &Pg,
    dir: &Path,
    c: &Components,
) -> Result<WireReport, String> {
    let stale_accounts = o.accounts.min(STALE_ACCOUNTS);
    eprintln!(
        "wire: raising {stale_accounts} accounts to {STALE_MARK} through the enforcing proxy"
    );
    advance_all(
        c.fenced.addr,
        STALE_PREFIX,
        stale_accounts,
        STALE_MARK,
        o.connections,
    )
    .await
    .map_err(|e| e.to_string())?;
    // The baseline build has a database of its own: its stale accounts are raised through it.
    // Should that fail, its stale phase is flagged (its answers are not refusals), not the run.
    if let Some(baseline) = &c.baseline
        && let Err(e) = advance_all(
            baseline.addr,
            STALE_PREFIX,
            stale_accounts,
            STALE_MARK,
            o.connections,
        )
        .await
    {
        eprintln!("wire: cannot raise the stale accounts through the baseline build: {e}");
    }
    let phases = phases(o);
    let mut samples: Vec<(Phase, Vec<Sample>)> = phases.iter().map(|p| (*p, Vec::new())).collect();
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for rep in 1..=o.repeats {
        // Every other repetition runs the phases in reverse, so that no phase always runs
        // right after the same one (a database still writing out the phase before, say).
        let order: Vec<usize> = match rep % 2 {
            1 => (0..samples.len()).collect(),
            _ => (0..samples.len()).rev().collect(),
        };
        for index in order {
            let (phase, done) = &mut samples[index];
            let run_id = format!("{run}-{rep}-{index}");
            let sample = measure(o, pg, dir, c, *phase, &run_id, stale_accounts).await;
            eprintln!(
                "wire: [{rep}/{}] {:<48} c={:<3} {:>9.0}/s  p50 {:>7.3} ms  proxy {:>5.1} µs/req  {:>4.2} cs/req ({:.2} preempted)  pg {:>5.1} µs/req (sessions {:>5.1})  batch {:>5.1}{}",
                o.repeats,
                phase.label(),
                phase.connections,
                sample.rate,
                sample.p50_us / 1000.0,
                per_request_us(sample.proxy_cpu, sample.requests),
                sample.proxy_switches as f64 / sample.requests.max(1) as f64,
                sample.proxy_involuntary as f64 / sample.requests.max(1) as f64,
                per_request_us(sample.postgres_cpu, sample.requests),
                per_request_us(sample.postgres_backend_cpu, sample.requests),
                sample.batch_rows,
                if sample.problems.is_empty() {
                    String::new()
                } else {
                    format!("  FLAGGED: {}", sample.problems.join("; "))
                }
            );
            done.push(sample);
        }
    }
    Ok(WireReport {
        options: o.clone(),
        date: crate::bench::utc_now(),
        postgres: String::new(),
        stale_accounts,
        proxy_config: {
            let mut config = proxy_config(o.pool_size);
            if let Some(concurrency) = o.batch_concurrency {
                config.fencing.batch_concurrency = concurrency;
            }
            config
        },
        samples,
        cpus: std::thread::available_parallelism().map_or(2, usize::from),
        table_scans: Vec::new(),
        top_statements: Vec::new(),
    })
}

pub(crate) fn per_request_us(cpu_secs: f64, requests: u64) -> f64 {
    cpu_secs * 1e6 / requests.max(1) as f64
}

async fn measure(
    o: &WireOptions,
    pg: &Pg,
    dir: &Path,
    c: &Components,
    phase: Phase,
    run_id: &str,
    stale_accounts: u64,
) -> Sample {
    let duration = if phase.connections == 1 {
        o.latency_duration
    } else {
        o.duration
    };
    if phase.route == Route::Pgbench {
        return measure_pgbench(o, pg, dir, phase, duration).await;
    }
    let variant: Vec<&Spawned> = match phase.route {
        Route::Unordered => c.unordered.iter().collect(),
        Route::Baseline => c.baseline.iter().collect(),
        Route::PerCore => c.per_core.iter().collect(),
        _ => Vec::new(),
    };
    // The processes whose CPU is the proxy's: one, or every process sharing the address.
    let (target, proxies): (_, Vec<&Spawned>) = match (phase.route, variant.first()) {
        (Route::Direct, _) => (c.upstream.addr, Vec::new()),
        (Route::Nginx, _) => (c.nginx.addr, vec![&c.nginx]),
        (Route::Bare, _) => (c.bare.addr, vec![&c.bare]),
        (Route::BareFenced, _) => (c.bare_fenced.addr, vec![&c.bare_fenced]),
        (Route::BareLooked, _) => (c.bare_looked.addr, vec![&c.bare_looked]),
        (Route::RailguardOff, _) => (c.off.addr, vec![&c.off]),
        (Route::Unordered | Route::Baseline | Route::PerCore, Some(first)) => {
            (first.addr, variant.clone())
        }
        (Route::Unordered | Route::Baseline | Route::PerCore, None) => {
            return failed("that railguard was not started".to_string());
        }
        _ => (c.fenced.addr, vec![&c.fenced]),
    };
    let requests = if phase.stale {
        Requests {
            prefix: STALE_PREFIX,
            count: stale_accounts,
            token: STALE_TOKEN,
            keys: phase.keys,
        }
    } else {
        Requests {
            prefix: ACCOUNT_PREFIX,
            count: o.accounts,
            token: TOKEN,
            keys: phase.keys,
        }
    };
    let script = match requests.script(dir, "load") {
        Ok(script) => script,
        Err(why) => return failed(why),
    };
    let wrk = |duration, run_id: String| Wrk {
        target,
        script: script.clone(),
        connections: phase.connections,
        duration,
        run_id,
    };
    if !o.warmup.is_zero() {
        let _ = wrk(o.warmup, format!("{run_id}-warm")).run().await;
    }
    let pids: Vec<Option<u32>> = proxies.iter().map(|p| p.pid()).collect();
    // A profile follows one process: with several, the first.
    let proxy_pid = pids.first().copied().flatten();
    let admins: Vec<_> = proxies.iter().map(|p| p.admin).collect();
    let batches_before = procs::histograms(&admins, "railguard_fence_batch_size").await;
    let before = (
        Usage::of_all(&pids),
        Usage::of(c.upstream.pid()),
        cpu::Snapshot::take(pg.pid(), None),
        procs::postgres_backend_ticks(pg.pid()),
    );
    let profile = match (&o.profile_dir, proxy_pid) {
        (Some(dir), Some(pid)) => {
            // A one-connection phase has the label of its 64-connection twin: named apart.
            let label = match phase.connections {
                1 => format!("{}, one connection", phase.label()),
                _ => phase.label(),
            };
            profiler::start(dir, &label, pid, duration).ok()
        }
        _ => None,
    };
    let counting = match (o.count_syscalls, proxy_pid) {
        (true, Some(pid)) => {
            let out = dir.join(format!("syscalls-{run_id}.stat"));
            profiler::count_syscalls(&out, pid, duration).ok()
        }
        _ => None,
    };
    let profiled = profile.is_some() || counting.is_some();
    let result = wrk(duration, run_id.to_string()).run().await;
    if let Some(profile) = profile {
        profile.finish().await;
    }
    let syscalls = match counting {
        Some(counting) => counting.finish().await,
        None => None,
    };
    let after = (
        Usage::of_all(&pids),
        Usage::of(c.upstream.pid()),
        cpu::Snapshot::take(pg.pid(), None),
        procs::postgres_backend_ticks(pg.pid()),
    );
    let batches_after = procs::histograms(&admins, "railguard_fence_batch_size").await;
    let result = match result {
        Ok(result) => result,
        Err(why) => return failed(why),
    };
    let statements = batches_after.1 - batches_before.1;
    let batch_rows = if statements > 0.0 {
        (batches_after.0 - batches_before.0) / statements
    } else {
        0.0
    };
    let (proxy_cpu, proxy_switches) = before.0.until(&after.0);
    let proxy_involuntary = before.0.involuntary_until(&after.0);
    let (upstream_cpu, _) = before.1.until(&after.1);
    let machine = before.2.until(&after.2);
    let mut problems = Vec::new();
    let expected_refusals = if phase.accepted() { 0 } else { result.requests };
    if result.non_2xx != expected_refusals {
        problems.push(if phase.accepted() {
            format!(
                "{} of {} answers were not 2xx",
                result.non_2xx, result.requests
            )
        } else {
            format!(
                "{} of {} answers were refusals; all should be",
                result.non_2xx, result.requests
            )
        });
    }
    if result.socket_errors > 0 {
        problems.push(format!("{} socket errors", result.socket_errors));
    }
    Sample {
        rate: result.rate,
        requests: result.requests,
        p50_us: result.p50_us,
        p99_us: result.p99_us,
        proxy_cpu,
        proxy_switches,
        proxy_involuntary,
        upstream_cpu,
        load_cpu: (!profiled).then_some(machine.reaped_children_secs),
        postgres_cpu: machine.postgres_secs,
        postgres_backend_cpu: after.3.saturating_sub(before.3) as f64 / 100.0,
        machine_busy: machine.machine_busy,
        batch_rows,
        syscalls,
        problems,
    }
}

async fn measure_pgbench(
    o: &WireOptions,
    pg: &Pg,
    dir: &Path,
    phase: Phase,
    duration: Duration,
) -> Sample {
    let pgbench = |duration| Pgbench {
        bin_dir: pg.server.bin_dir().to_path_buf(),
        port: pg.server.port(),
        clients: phase.connections,
        duration,
        script: cas_script(o.accounts, ACCOUNT_PREFIX, TOKEN),
    };
    let work = dir.join(format!("pgbench-{}", phase.connections));
    let _ = std::fs::remove_dir_all(&work);
    if let Err(e) = std::fs::create_dir_all(&work) {
        return failed(format!("{}: {e}", work.display()));
    }
    if !o.warmup.is_zero() {
        let _ = pgbench(o.warmup).run(&work).await;
        let _ = std::fs::remove_dir_all(&work);
        let _ = std::fs::create_dir_all(&work);
    }
    let before = cpu::Snapshot::take(pg.pid(), None);
    let result = pgbench(duration).run(&work).await;
    // pgbench's backends exit with it; their time reaches the postmaster's count of reaped
    // children only once it has waited for them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let machine = before.until(&cpu::Snapshot::take(pg.pid(), None));
    match result {
        Ok(r) => Sample {
            rate: r.tps,
            requests: r.transactions,
            p50_us: f64::from(r.percentile_us(0.50)),
            p99_us: f64::from(r.percentile_us(0.99)),
            postgres_cpu: machine.postgres_secs,
            machine_busy: machine.machine_busy,
            problems: if r.failed > 0 {
                vec![format!(
                    "{} of {} transactions failed",
                    r.failed, r.transactions
                )]
            } else {
                Vec::new()
            },
            ..Sample::default()
        },
        Err(why) => failed(why),
    }
}

fn failed(why: String) -> Sample {
    Sample {
        problems: vec![why],
        ..Sample::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn options(baseline: bool) -> WireOptions {
        WireOptions {
            duration: Duration::from_secs(1),
            warmup: Duration::ZERO,
            repeats: 1,
            connections: 64,
            accounts: 1_000,
            pool_size: 16,
            upstream: UpstreamKind::Static,
            latency_duration: Duration::ZERO,
            batch_concurrency: None,
            profile_dir: None,
            count_syscalls: false,
            pg_settings: Vec::new(),
            order_off: false,
            per_core: false,
            overrides: Vec::new(),
            baseline: baseline.then(|| Baseline {
                binary: "/bin/false".into(),
                label: "earlier".into(),
            }),
        }
    }

    #[test]
    fn a_baseline_build_runs_the_stale_phase_right_after_this_builds() {
        let stale: Vec<Phase> = phases(&options(true))
            .into_iter()
            .filter(|p| p.stale)
            .collect();
        assert_eq!(stale.len(), 2, "{stale:?}");
        assert_eq!(stale[0].route, Route::Fenced);
        assert_eq!(stale[1].route, Route::Baseline);
        assert!(!stale[1].accepted());
        assert_eq!(
            stale[1].label(),
            "railguard earlier, stale token → 409, no keys"
        );
        let alone: Vec<Phase> = phases(&options(false))
            .into_iter()
            .filter(|p| p.stale)
            .collect();
        assert_eq!(alone.len(), 1);
        assert_eq!(alone[0].route, Route::Fenced);
    }

    #[test]
    fn the_per_core_layout_runs_right_after_the_default_it_is_compared_with() {
        let mut o = options(false);
        o.per_core = true;
        let all = phases(&o);
        for keys in [false, true] {
            let at = all
                .iter()
                .position(|p| p.route == Route::PerCore && p.keys == keys)
                .expect("a per-core phase");
            assert_eq!(all[at - 1].route, Route::Fenced, "{all:?}");
            assert_eq!(all[at - 1].keys, keys);
        }
        assert!(
            !phases(&options(false))
                .iter()
                .any(|p| p.route == Route::PerCore)
        );
    }
}
