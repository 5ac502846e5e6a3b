//! The benchmark run: what the fence costs, as ratios against baselines measured in the same
//! run on the same machine.
//!
//! One process starts everything on loopback, with the test kit's launchers: a throwaway
//! *durable* PostgreSQL ([`Pg`], fsync and synchronous_commit on, as in production), the rail
//! simulator ([`Rail`]), and two proxies through [`server::run`] — one enforcing, one with
//! `fencing.enforce = false` — both on that PostgreSQL; for the etcd suite also a one-member
//! etcd ([`EtcdCluster`]) and a third proxy whose lock backend it is. Two proxy instances
//! rather than a restart, so that switching phases never waits for a restart and each proxy's
//! caches and pools stay warm across repetitions. PostgreSQL's and etcd's data live under
//! /var/tmp, not /tmp: /tmp may be a tmpfs, where fsync costs nothing.
//!
//! Phases (see [`Phase`]) run `repeats` times, interleaved round-robin (A1 B1 C1 … A2 B2 C2 …)
//! so that a noisy stretch of time lands on every phase rather than on one, each after a short
//! warm-up. Every load is bounded both in time and in number of requests.
//!
//! The rail simulator records every payment in memory. Its ledger is swapped for an empty one
//! around each measured run, which keeps memory bounded and lets the run check what the rail
//! saw: a forwarded phase must deliver exactly its successful answers, the stale phase nothing.
//!
//! The load generator shares the process, the tokio runtime and the CPUs with the proxies and
//! the simulator, and PostgreSQL and pgbench share the machine: on a small machine every row
//! is partly a measurement of the load generator. That is why only ratios are claimed.

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::load::{Accounts, Connection, Load, LoadResult};
use crate::locks::CycleLoad;
use crate::pgbench::Pgbench;
pub(crate) use crate::report::{Environment, Report, Sample};
use crate::{cpu, load, locks, pgbench, rss};
use railguard::config::{Config, DatabaseUrl, LockBackendKind, Upstream};
use railguard::server::{self, ServeError};
use railguard_testkit::etcd::MemberState;
use railguard_testkit::{EtcdCluster, LaunchError, Pg, Rail};

/// The token every accepted request carries. Equal tokens are accepted, so a fixed token per
/// account keeps every request accepted while each still commits a real compare-and-set.
pub(crate) const TOKEN: i64 = 1_000_000;
/// The mark the stale phase's accounts are raised to before it hammers them with token 1.
pub(crate) const STALE_MARK: i64 = 2_000_000;
const STALE_TOKEN: i64 = 1;
pub(crate) const ACCOUNT_PREFIX: &str = "acct-";
pub(crate) const STALE_PREFIX: &str = "stale-";
/// How many accounts the stale phase uses (fewer if `accounts` is smaller). All of them stay
/// in the proxy's mark cache, so the phase measures the cache path.
const STALE_ACCOUNTS: u64 = 1_000;

/// A group of phases that can be run alone (`--suite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Suite {
    /// The fenced proxy: direct, fencing off/on, stale, pgbench of the same CAS, and the RSS
    /// of a separate `railguard serve` holding many open connections.
    Proxy,
    /// The lock API on PostgreSQL against pgbench running the backend's own statements.
    Locks,
    /// The lock API on etcd against etcd's own Lock/Unlock RPC.
    Etcd,
}

impl Suite {
    pub(crate) const ALL: [Suite; 3] = [Suite::Proxy, Suite::Locks, Suite::Etcd];
}

/// What `railguard-bench` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct BenchOptions {
    /// What to measure; the order does not matter.
    pub suites: Vec<Suite>,
    /// Measured time of each repetition of each phase.
    pub duration: Duration,
    /// Unmeasured load before each repetition.
    pub warmup: Duration,
    pub repeats: u32,
    /// Concurrent keep-alive connections (pgbench: clients).
    pub connections: usize,
    /// Accounts drawn from, uniformly.
    pub accounts: u64,
    /// Each proxy's PostgreSQL pool size.
    pub pool_size: usize,
    /// Upper bound on requests per repetition, across all connections.
    pub max_requests: u64,
    /// Concurrent clients of the lock phases (pgbench: clients).
    pub lock_clients: usize,
    /// Open client connections for the RSS measurement.
    pub rss_connections: usize,
}

impl BenchOptions {
    pub(crate) fn runs(&self, suite: Suite) -> bool {
        self.suites.contains(&suite)
    }
}

/// One thing measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Load straight at the rail simulator: the ceiling of the load generator + simulator.
    Direct,
    /// Through a proxy with `fencing.enforce = false`. It still runs the compare-and-set (to
    /// count what it would have refused), so this is *not* a proxy without a database.
    ProxyUnfenced,
    /// Through the enforcing proxy: one durable compare-and-set per request, then the forward,
    /// on `accounts` accounts.
    ProxyFenced,
    /// The same on this many accounts only: requests of one account are forwarded in order,
    /// one at a time, and hot rows serialise their compare-and-sets.
    ProxyFencedOn(u64),
    /// Token 1 against accounts whose mark is 2,000,000: every answer a 409 from the mark cache.
    StaleRejected,
    /// pgbench running the single-row compare-and-set directly against PostgreSQL, one client
    /// per connection of the HTTP phases and one commit per transaction.
    Pgbench,
    /// Acquire + release cycles through the lock API on the PostgreSQL backend.
    LockApiPostgres,
    /// pgbench running the backend's acquire statement then its release statement.
    PgbenchLocks,
    /// Acquire + release cycles through the lock API on the etcd backend.
    LockApiEtcd,
    /// etcd's own lease grant, Lock, Unlock, lease revoke, through `etcd-client`.
    EtcdNativeLocks,
}

impl Phase {
    /// Every phase of the suites asked for, in the order each round runs them.
    pub(crate) fn all(options: &BenchOptions) -> Vec<Phase> {
        let mut phases = Vec::new();
        if options.runs(Suite::Proxy) {
            phases.extend([Phase::Direct, Phase::ProxyUnfenced, Phase::ProxyFenced]);
            for few in FEW_ACCOUNTS {
                if few < options.accounts {
                    phases.push(Phase::ProxyFencedOn(few));
                }
            }
            phases.extend([Phase::StaleRejected, Phase::Pgbench]);
        }
        if options.runs(Suite::Locks) {
            phases.extend([Phase::LockApiPostgres, Phase::PgbenchLocks]);
        }
        if options.runs(Suite::Etcd) {
            phases.extend([Phase::LockApiEtcd, Phase::EtcdNativeLocks]);
        }
        phases
    }

    pub(crate) fn suite(self) -> Suite {
        match self {
            Phase::LockApiPostgres | Phase::PgbenchLocks => Suite::Locks,
            Phase::LockApiEtcd | Phase::EtcdNativeLocks => Suite::Etcd,
            _ => Suite::Proxy,
        }
    }

    pub(crate) fn label(self, options: &BenchOptions) -> String {
        let accounts = |n: u64| {
            if n == 1 {
                "1 account".to_string()
            } else {
                format!("{} accounts", crate::report::thousands(n as f64))
            }
        };
        match self {
            Phase::Direct => "direct to rail simulator".into(),
            Phase::ProxyUnfenced => "proxy, fencing off".into(),
            Phase::ProxyFenced => format!("proxy, fencing on, {}", accounts(options.accounts)),
            Phase::ProxyFencedOn(n) => format!("proxy, fencing on, {}", accounts(n)),
            Phase::StaleRejected => "proxy, stale token → 409".into(),
            Phase::Pgbench => format!("pgbench, same CAS, {} clients", options.connections),
            Phase::LockApiPostgres => "lock API, PostgreSQL backend".into(),
            Phase::PgbenchLocks => format!(
                "pgbench, same acquire + release SQL, {} clients",
                options.lock_clients
            ),
            Phase::LockApiEtcd => "lock API, etcd backend".into(),
            Phase::EtcdNativeLocks => "etcd Lock/Unlock RPC (etcd-client)".into(),
        }
    }
}

/// The smaller account sets the enforcing proxy is also measured on.
const FEW_ACCOUNTS: [u64; 2] = [64, 1];

/// The benchmark could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Setup(String),
}

/// Runs the whole benchmark and returns its report. Progress goes to stderr.
pub(crate) async fn run(options: BenchOptions) -> Result<Report, BenchError> {
    // Under /var/tmp, not /tmp: /tmp may be a tmpfs, where fsync costs nothing.
    let temp_dir = |prefix: &str| {
        tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/var/tmp")
            .map_err(|source| BenchError::Io {
                what: "cannot create a directory under /var/tmp",
                source,
            })
    };
    let work_dir = temp_dir("railguard-bench-")?;
    eprintln!("bench: starting PostgreSQL (durable) under /var/tmp");
    let mut postgres = Pg::builder()
        .durable(true)
        .temp_dir_in("/var/tmp")
        .start()
        .await?;
    eprintln!(
        "bench: PostgreSQL (durable) runs in {}",
        postgres.server.data_dir().display()
    );
    let result = with_postgres(&options, &postgres, work_dir.path()).await;
    postgres.server.stop().await;
    result
}

async fn with_postgres(
    options: &BenchOptions,
    postgres: &Pg,
    work_dir: &Path,
) -> Result<Report, BenchError> {
    let rail = Rail::try_start().await?;
    let mut proxies = Vec::new();
    let mut etcd_cluster = None;
    let setup = async {
        // One after the other: each migrates the same database on start. Before any starts,
        // the schema is made and the grant-proof key seeded with the benchmark's own, so that
        // the load generator can send the proofs real workers get from their grants.
        let url = postgres.url();
        load::seed_proof_key(&url)
            .await
            .map_err(|e| BenchError::Setup(format!("seeding the grant-proof key: {e}")))?;
        proxies.push(Proxy::start(rail.addr, &url, true, None, options.pool_size).await?);
        if options.runs(Suite::Proxy) {
            eprintln!(
                "bench: starting the second proxy with fencing.enforce = false; \
                 the error it logs about that is expected"
            );
            proxies.push(Proxy::start(rail.addr, &url, false, None, options.pool_size).await?);
        }
        if options.runs(Suite::Locks) {
            wait_for_lock_api(proxies[0].lock_addr, "postgres").await?;
        }
        let mut etcd = None;
        if options.runs(Suite::Etcd) {
            eprintln!("bench: starting etcd (one member) under /var/tmp");
            // Its data on a disk, so its fsyncs cost what they do in production; etcd's own
            // quota, as the run writes without compacting.
            let cluster = EtcdCluster::builder()
                .temp_dir_in("/var/tmp")
                .quota_backend_bytes(None)
                .start()
                .await?;
            let (endpoint, pid) = (cluster.endpoint(0), cluster.pid(0));
            etcd_cluster = Some(cluster);
            let proxy = Proxy::start(
                rail.addr,
                &url,
                true,
                Some(endpoint.clone()),
                options.pool_size,
            )
            .await?;
            let lock_addr = proxy.lock_addr;
            proxies.push(proxy);
            wait_for_lock_api(lock_addr, "etcd").await?;
            let client = locks::connect_etcd(&endpoint)
                .await
                .map_err(BenchError::Setup)?;
            etcd = Some(EtcdSetup {
                lock_addr,
                client,
                pid,
            });
        }
        Ok::<_, BenchError>(etcd)
    };
    let result = match setup.await {
        Ok(etcd) => {
            let bench = Bench {
                options,
                rail: &rail,
                fenced: &proxies[0],
                unfenced: proxies.get(1).filter(|_| options.runs(Suite::Proxy)),
                etcd,
                postgres,
                work_dir,
            };
            bench.run().await
        }
        Err(e) => Err(e),
    };
    for proxy in proxies {
        proxy.stop().await;
    }
    if let Some(mut cluster) = etcd_cluster
        && cluster.state(0) != MemberState::Stopped
    {
        cluster.kill(0).await;
    }
    rail.stop().await;
    let mut report = result?;
    report.environment.postgres = postgres.version().await;
    if options.runs(Suite::Etcd) {
        report.environment.etcd = EtcdCluster::version().await;
    }
    Ok(report)
}

/// Cycles once through the lock API at `addr` until that works (the etcd backend connects
/// lazily), for at most 60 s.
async fn wait_for_lock_api(addr: SocketAddr, backend: &str) -> Result<(), BenchError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut connection = Connection::new(addr);
    loop {
        let last = match locks::api_cycle(&mut connection, "bench-probe").await {
            Ok(StatusCode::OK) => return Ok(()),
            Ok(status) => format!("status {status}"),
            Err(e) => e,
        };
        if tokio::time::Instant::now() > deadline {
            return Err(BenchError::Setup(format!(
                "the lock API ({backend} backend) at {addr} did not complete a cycle within 60 s: {last}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the etcd phases need.
struct EtcdSetup {
    /// The lock API of the railguard whose lock backend is etcd.
    lock_addr: SocketAddr,
    /// For the native baseline.
    client: etcd_client::Client,
    pid: Option<u32>,
}

struct Bench<'a> {
    options: &'a BenchOptions,
    rail: &'a Rail,
    /// Its lock API is the PostgreSQL one.
    fenced: &'a Proxy,
    /// Only with the proxy suite.
    unfenced: Option<&'a Proxy>,
    /// Only with the etcd suite.
    etcd: Option<EtcdSetup>,
    postgres: &'a Pg,
    work_dir: &'a Path,
}

impl Bench<'_> {
    async fn run(&self) -> Result<Report, BenchError> {
        let o = self.options;
        let environment = Environment::probe();
        let stale_accounts = o.accounts.min(STALE_ACCOUNTS);
        if o.runs(Suite::Proxy) {
            eprintln!(
                "bench: raising {stale_accounts} accounts to {STALE_MARK} through the enforcing proxy"
            );
            advance_all(
                self.fenced.addr,
                STALE_PREFIX,
                stale_accounts,
                STALE_MARK,
                o.connections,
            )
            .await?;
            self.rail.clear_ledger();
        }

        let mut samples: Vec<(Phase, Vec<Sample>)> =
            Phase::all(o).into_iter().map(|p| (p, Vec::new())).collect();
        for rep in 1..=o.repeats {
            for (phase, done) in &mut samples {
                let sample = self.measure(*phase).await;
                eprintln!(
                    "bench: [{rep}/{}] {:<44} {:>9.0}/s  p50 {:>7.2} ms  p99 {:>7.2} ms  n={}{}",
                    o.repeats,
                    phase.label(o),
                    sample.rate,
                    f64::from(sample.p50_us) / 1000.0,
                    f64::from(sample.p99_us) / 1000.0,
                    sample.count,
                    if sample.problems.is_empty() {
                        String::new()
                    } else {
                        format!("  FLAGGED: {}", sample.problems.join("; "))
                    },
                );
                done.push(sample);
            }
        }
        let rss = if o.runs(Suite::Proxy) && o.rss_connections > 0 {
            eprintln!(
                "bench: RSS of a separate `railguard serve` with {} open connections",
                o.rss_connections
            );
            let rss = rss::measure(
                self.work_dir,
                self.rail.addr,
                &self.postgres.url(),
                o.pool_size,
                o.rss_connections,
            )
            .await;
            self.rail.clear_ledger();
            match &rss {
                Ok(r) => eprintln!(
                    "bench: RSS idle {:.1} MiB, with {} of {} connections open {:.1} MiB, peak {:.1} MiB",
                    r.idle_kib as f64 / 1024.0,
                    r.accepted,
                    r.connections,
                    r.open_kib as f64 / 1024.0,
                    r.peak_kib as f64 / 1024.0
                ),
                Err(why) => eprintln!("bench: RSS measurement failed: {why}"),
            }
            Some(rss)
        } else {
            None
        };
        Ok(Report {
            environment,
            options: o.clone(),
            proxy_config: proxy_config(o.pool_size),
            stale_accounts,
            samples,
            peak_rss_kib: peak_rss_kib(),
            rss,
        })
    }

    fn snapshot(&self) -> cpu::Snapshot {
        cpu::Snapshot::take(self.postgres.pid(), self.etcd.as_ref().and_then(|e| e.pid))
    }

    /// One warm-up and one measured repetition of `phase`.
    async fn measure(&self, phase: Phase) -> Sample {
        let o = self.options;
        let load = |target: SocketAddr, accounts: Accounts, token: i64, duration: Duration| Load {
            target,
            connections: o.connections,
            duration,
            max_requests: o.max_requests,
            accounts,
            token,
        };
        let accounts = |count| Accounts {
            prefix: ACCOUNT_PREFIX,
            count,
        };
        let (target, accounts, token, expect) = match phase {
            Phase::Direct => (
                self.rail.addr,
                accounts(o.accounts),
                TOKEN,
                StatusCode::CREATED,
            ),
            Phase::ProxyUnfenced => match self.unfenced {
                Some(unfenced) => (
                    unfenced.addr,
                    accounts(o.accounts),
                    TOKEN,
                    StatusCode::CREATED,
                ),
                None => return Sample::failed("no proxy with fencing off".into()),
            },
            Phase::ProxyFenced => (
                self.fenced.addr,
                accounts(o.accounts),
                TOKEN,
                StatusCode::CREATED,
            ),
            Phase::ProxyFencedOn(n) => (self.fenced.addr, accounts(n), TOKEN, StatusCode::CREATED),
            Phase::StaleRejected => (
                self.fenced.addr,
                Accounts {
                    prefix: STALE_PREFIX,
                    count: o.accounts.min(STALE_ACCOUNTS),
                },
                STALE_TOKEN,
                StatusCode::CONFLICT,
            ),
            Phase::Pgbench => {
                let script = pgbench::cas_script(o.accounts, ACCOUNT_PREFIX, TOKEN);
                return self.measure_pgbench(script, o.connections).await;
            }
            Phase::PgbenchLocks => {
                return self
                    .measure_pgbench(locks::pgbench_script(), o.lock_clients)
                    .await;
            }
            Phase::LockApiPostgres => return self.measure_lock_api(self.fenced.lock_addr).await,
            Phase::LockApiEtcd => match &self.etcd {
                Some(etcd) => return self.measure_lock_api(etcd.lock_addr).await,
                None => return Sample::failed("no etcd".into()),
            },
            Phase::EtcdNativeLocks => match &self.etcd {
                Some(etcd) => {
                    let run =
                        |duration| locks::run_etcd_native(&etcd.client, self.cycles(duration));
                    return self.measure_cycles(run).await;
                }
                None => return Sample::failed("no etcd".into()),
            },
        };
        if !o.warmup.is_zero() {
            load::run(&load(target, accounts.clone(), token, o.warmup)).await;
        }
        self.rail.clear_ledger();
        let before = self.snapshot();
        let result = load::run(&load(target, accounts, token, o.duration)).await;
        let cpu = before.until(&self.snapshot());
        let delivered = self.rail.clear_ledger();
        let should_deliver = if expect == StatusCode::CONFLICT {
            0
        } else {
            result.count(expect)
        };
        Sample {
            cpu,
            ..sample_of(&result, expect, delivered, should_deliver)
        }
    }

    fn cycles(&self, duration: Duration) -> CycleLoad {
        CycleLoad {
            clients: self.options.lock_clients,
            duration,
            max_cycles: self.options.max_requests,
        }
    }

    async fn measure_lock_api(&self, target: SocketAddr) -> Sample {
        self.measure_cycles(|duration| locks::run_api(target, self.cycles(duration)))
            .await
    }

    /// A warm-up and a measured run of `run`, whose every cycle should end in a 200.
    async fn measure_cycles<F, Fut>(&self, run: F) -> Sample
    where
        F: Fn(Duration) -> Fut,
        Fut: Future<Output = LoadResult>,
    {
        let o = self.options;
        if !o.warmup.is_zero() {
            run(o.warmup).await;
        }
        let before = self.snapshot();
        let result = run(o.duration).await;
        let cpu = before.until(&self.snapshot());
        Sample {
            cpu,
            ..sample_of(&result, StatusCode::OK, 0, 0)
        }
    }

    async fn measure_pgbench(&self, script: String, clients: usize) -> Sample {
        let o = self.options;
        let pgbench = |duration| Pgbench {
            bin_dir: self.postgres.server.bin_dir().to_path_buf(),
            port: self.postgres.server.port(),
            clients,
            duration,
            script: script.clone(),
        };
        if !o.warmup.is_zero() {
            let _ = pgbench(o.warmup).run(self.work_dir).await;
        }
        let before = self.snapshot();
        let result = pgbench(o.duration).run(self.work_dir).await;
        let cpu = before.until(&self.snapshot());
        match result {
            Ok(r) => {
                let mut problems = Vec::new();
                if r.failed > 0 {
                    problems.push(format!(
                        "{} of {} transactions failed",
                        r.failed, r.transactions
                    ));
                }
                Sample {
                    rate: r.tps,
                    p50_us: r.percentile_us(0.50),
                    p99_us: r.percentile_us(0.99),
                    count: r.transactions,
                    unexpected: r.failed,
                    problems,
                    cpu,
                }
            }
            Err(why) => Sample::failed(why),
        }
    }
}

/// A repetition's figures, with everything other than `expect` counted and described.
fn sample_of(
    result: &LoadResult,
    expect: StatusCode,
    delivered: usize,
    should_deliver: u64,
) -> Sample {
    let expected = result.count(expect);
    let mut problems: Vec<String> = result
        .statuses
        .iter()
        .filter(|(status, _)| **status != expect.as_u16())
        .map(|(status, n)| {
            format!(
                "{n} answers with status {status} (expected {})",
                expect.as_u16()
            )
        })
        .collect();
    if result.transport_errors > 0 {
        problems.push(format!(
            "{} requests got no answer (first: {})",
            result.transport_errors,
            result.first_transport_error.as_deref().unwrap_or("?")
        ));
    }
    if delivered as u64 != should_deliver {
        problems.push(format!(
            "the rail received {delivered} payments, expected {should_deliver}"
        ));
    }
    let unexpected = result.answered() - expected + result.transport_errors;
    let secs = result.elapsed.as_secs_f64().max(1e-9);
    Sample {
        rate: expected as f64 / secs,
        p50_us: result.percentile_us(0.50),
        p99_us: result.percentile_us(0.99),
        count: result.answered(),
        unexpected: unexpected.max(u64::from(!problems.is_empty())),
        problems,
        cpu: cpu::CpuUse::default(),
    }
}

/// Sends one accepted payment for each of `{prefix}1..={count}` at `token`, from `connections`
/// connections at once.
pub(crate) async fn advance_all(
    target: SocketAddr,
    prefix: &str,
    count: u64,
    token: i64,
    connections: usize,
) -> Result<(), BenchError> {
    let connections = connections.clamp(1, count.max(1) as usize) as u64;
    let workers: Vec<JoinHandle<Result<(), String>>> = (0..connections)
        .map(|w| {
            let prefix = prefix.to_string();
            tokio::spawn(async move {
                let mut connection = Connection::new(target);
                for n in (1 + w..=count).step_by(connections as usize) {
                    let account = format!("{prefix}{n}");
                    match connection.send(&account, token).await {
                        Ok(status) if status.is_success() => {}
                        Ok(status) => {
                            return Err(format!("raising {account} to {token}: status {status}"));
                        }
                        Err(e) => return Err(format!("raising {account} to {token}: {e}")),
                    }
                }
                Ok(())
            })
        })
        .collect();
    for worker in workers {
        worker
            .await
            .map_err(|e| BenchError::Setup(e.to_string()))?
            .map_err(BenchError::Setup)?;
    }
    Ok(())
}

/// The defaults, with the pool size asked for; the caller sets addresses and the database.
pub(crate) fn proxy_config(pool_size: usize) -> Config {
    let mut config = Config::default();
    config.database.pool_size = pool_size;
    config.fencing.batch_concurrency = config.fencing.batch_concurrency.min(pool_size);
    config
}

/// A proxy running in this process through [`server::run`].
struct Proxy {
    addr: SocketAddr,
    /// Its lock API.
    lock_addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Proxy {
    /// Starts a proxy and waits until a payment through it is accepted. Its lock service uses
    /// PostgreSQL, or the etcd at `etcd` when given.
    async fn start(
        rail: SocketAddr,
        database_url: &str,
        enforce: bool,
        etcd: Option<String>,
        pool_size: usize,
    ) -> Result<Self, BenchError> {
        let mut config = proxy_config(pool_size);
        if let Some(endpoint) = etcd {
            config.lock.backend = LockBackendKind::Etcd;
            config.etcd.endpoints = vec![endpoint];
        }
        config.proxy.upstream = Upstream::parse(&format!("http://{rail}"))
            .map_err(|e| BenchError::Setup(format!("the rail's address: {e}")))?;
        config.database.url = DatabaseUrl::Postgres(database_url.to_string());
        config.fencing.enforce = enforce;
        config.shutdown.grace = Duration::from_secs(2);
        let bind = || tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0));
        let bound = |what| move |source| BenchError::Io { what, source };
        let listeners = server::Listeners {
            proxy: bind()
                .await
                .map_err(bound("cannot bind a proxy listener"))?
                .into(),
            admin: bind()
                .await
                .map_err(bound("cannot bind an admin listener"))?,
            lock: bind().await.map_err(bound("cannot bind a lock listener"))?,
        };
        let addr = listeners
            .proxy
            .local_addr()
            .map_err(bound("proxy address"))?;
        let lock_addr = listeners.lock.local_addr().map_err(bound("lock address"))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let mut task = tokio::spawn(server::run(listeners, config, async move {
            let _ = stopped.await;
        }));

        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut connection = Connection::new(addr);
        loop {
            if task.is_finished() {
                let why = match (&mut task).await {
                    Ok(Ok(())) => "it stopped".to_string(),
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                };
                return Err(BenchError::Setup(format!(
                    "the proxy (enforce = {enforce}) did not start: {why}"
                )));
            }
            let last = match connection.send("bench-probe", 1).await {
                Ok(status) if status.is_success() => {
                    return Ok(Self {
                        addr,
                        lock_addr,
                        stop,
                        task,
                    });
                }
                Ok(status) => format!("status {status}"),
                Err(e) => e.to_string(),
            };
            if tokio::time::Instant::now() > deadline {
                let _ = stop.send(());
                return Err(BenchError::Setup(format!(
                    "the proxy (enforce = {enforce}) at {addr} did not accept a payment within 60 s: {last}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
    }
}

impl Environment {
    fn probe() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let meminfo = read("/proc/meminfo");
        let field = |text: &str, name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_else(|| "unknown".into())
        };
        let memory = field(&meminfo, "MemTotal")
            .trim_end_matches(" kB")
            .parse::<f64>()
            .map(|kib| format!("{:.0} GiB", kib / (1024.0 * 1024.0)))
            .unwrap_or_else(|_| "unknown".into());
        Self {
            date: utc_now(),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            cpu_model: field(&cpuinfo, "model name"),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            memory,
            postgres: String::new(),
            etcd: String::new(),
        }
    }
}

/// VmHWM: the most resident memory this process has had.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `2026-12-03 14:05 UTC`, without a date crate (days-to-civil, proleptic Gregorian).
pub(crate) fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rem / 3_600,
        rem % 3_600 / 60
    )
}
