//! `railguard-bench`: measures the proxy and the lock service against baselines taken in the
//! same run, on loopback only. proxy: load straight at an in-process rail simulator, through
//! the proxy with fencing off and on (over several account counts), a stale-token phase,
//! pgbench running the same compare-and-set on the same throwaway durable PostgreSQL, and the
//! RSS of a separate `railguard serve` holding many connections. locks: acquire+release cycles
//! through the lock API on PostgreSQL against pgbench running the same statements. etcd: the
//! same cycles on the etcd backend against etcd's own Lock/Unlock RPC (needs /usr/bin/etcd).
//! Prints markdown tables (progress goes to stderr). `scripts/bench.sh` runs it.

mod bench;
mod cpu;
mod load;
mod locks;
mod pgbench;
mod report;
mod rss;
mod statements;
mod wire;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use railguard::config::{Config, LogFormat};
use railguard::telemetry;

/// Measure the proxy and the lock service against baselines taken in the same run.
#[derive(Parser)]
#[command(name = "railguard-bench", version)]
struct Cli {
    /// What to measure.
    #[arg(long, value_enum, default_value_t = BenchSuite::All)]
    suite: BenchSuite,
    /// Measured seconds of each repetition of each phase.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    duration_secs: u64,
    /// Repetitions of each phase, interleaved round-robin; the table quotes medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: u32,
    /// Concurrent keep-alive connections, and pgbench clients (at most 140: the throwaway
    /// PostgreSQL allows 200 connections, shared with the pools of up to three in-process
    /// railguards).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=140))]
    connections: u64,
    /// Accounts requests are spread over, uniformly.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    accounts: u64,
    /// Unmeasured seconds of load before each repetition.
    #[arg(long, default_value_t = 1)]
    warmup_secs: u64,
    /// Each proxy's PostgreSQL pool size (database.pool_size).
    #[arg(long, default_value_t = Config::default().database.pool_size)]
    pool_size: usize,
    /// Upper bound on requests per repetition, across all connections.
    #[arg(long, default_value_t = 5_000_000)]
    max_requests: u64,
    /// Concurrent clients of the lock phases, and pgbench clients there (at most 140, as
    /// for --connections).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=140))]
    lock_clients: u64,
    /// The wire suite's upstream: nginx answering itself, or `railguard rail-sim`.
    #[arg(long, value_enum, default_value_t = wire::UpstreamKind::Static)]
    upstream: wire::UpstreamKind,
    /// The wire suite: measured seconds of each phase at one connection (0 skips them).
    #[arg(long, default_value_t = 5)]
    latency_secs: u64,
    /// The wire suite: fencing.batch_concurrency of its railguards (default: the config's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    batch_concurrency: Option<u64>,
    /// The wire suite: record a perf profile of the proxy in each proxy phase into this
    /// directory (slows the proxy: the run's rates are then not comparable).
    #[arg(long)]
    profile_dir: Option<std::path::PathBuf>,
    /// The wire suite: count the proxy process's system calls in each proxy phase (`perf stat`
    /// on the kernel's syscall tracepoints) and report them per request.
    #[arg(long)]
    count_syscalls: bool,
    /// The wire and statements suites: a PostgreSQL server setting for the throwaway cluster, `name=value`
    /// (repeatable), e.g. `shared_buffers=1GB`.
    #[arg(long = "pg-setting", value_parser = parse_setting)]
    pg_settings: Vec<(String, String)>,
    /// The wire suite: also run the fenced phases through a railguard with
    /// `fencing.order_across_processes = false`, interleaved with the default's.
    #[arg(long)]
    order_off: bool,
    /// The wire suite: also run the fenced phases through one railguard process per CPU, each
    /// with one runtime thread, sharing one proxy address (`proxy.reuse_port`).
    #[arg(long)]
    per_core: bool,
    /// The wire suite: also run the fenced phases through this `railguard` binary (another
    /// build, e.g. an earlier commit's), on a database of the run's cluster it migrates itself.
    #[arg(long)]
    baseline_bin: Option<std::path::PathBuf>,
    /// The wire suite: what the report calls the --baseline-bin binary.
    #[arg(long, default_value = "baseline", requires = "baseline_bin")]
    baseline_label: String,
    /// The statements suite: rows per statement, one group of phases each.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 64])]
    batch_rows: Vec<usize>,
    /// The statements suite: which statements to measure (default: every one).
    #[arg(long, value_delimiter = ',')]
    statements: Vec<statements::Variant>,
    /// Open client connections for the proxy RSS measurement (0 skips it).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    rss_connections: u64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchSuite {
    Proxy,
    Locks,
    Etcd,
    /// railguard and nginx as processes of their own under wrk (not part of `all`).
    Wire,
    /// What each of railguard's statements costs PostgreSQL alone, and what variants of them
    /// would cost (not part of `all`).
    Statements,
    All,
}

#[allow(clippy::disallowed_methods)] // main reads the environment
fn main() -> ExitCode {
    let Cli {
        duration_secs,
        repeats,
        connections,
        accounts,
        warmup_secs,
        pool_size,
        max_requests,
        suite,
        lock_clients,
        rss_connections,
        upstream,
        latency_secs,
        batch_concurrency,
        profile_dir,
        count_syscalls,
        pg_settings,
        order_off,
        per_core,
        baseline_bin,
        baseline_label,
        batch_rows,
        statements: variants,
    } = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        use bench::Suite;
        // Errors only: the stale phase would otherwise log a warning per request.
        telemetry::init(
            LogFormat::Pretty,
            "error",
            std::env::var("RUST_LOG").ok().as_deref(),
        );
        let suites = match suite {
            BenchSuite::Proxy => vec![Suite::Proxy],
            BenchSuite::Locks => vec![Suite::Locks],
            BenchSuite::Etcd => vec![Suite::Etcd],
            BenchSuite::All => Suite::ALL.to_vec(),
            BenchSuite::Statements => {
                let options = statements::StatementOptions {
                    duration: Duration::from_secs(duration_secs),
                    warmup: Duration::from_secs(warmup_secs),
                    repeats,
                    accounts,
                    rows: batch_rows,
                    variants: if variants.is_empty() {
                        statements::Variant::ALL.to_vec()
                    } else {
                        variants
                    },
                    pg_settings,
                };
                return match statements::run(options).await {
                    Ok(report) => {
                        print!("{}", report.to_markdown());
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                };
            }
            BenchSuite::Wire => {
                let options = wire::WireOptions {
                    duration: Duration::from_secs(duration_secs),
                    warmup: Duration::from_secs(warmup_secs),
                    repeats,
                    connections: connections as usize,
                    accounts,
                    pool_size,
                    upstream,
                    latency_duration: Duration::from_secs(latency_secs),
                    batch_concurrency: batch_concurrency.map(|c| c as usize),
                    profile_dir,
                    count_syscalls,
                    pg_settings,
                    order_off,
                    per_core,
                    // Inherited by every railguard process the run starts.
                    overrides: {
                        let mut set: Vec<String> = std::env::vars_os()
                            .filter_map(|(name, value)| {
                                let name = name.into_string().ok()?;
                                name.starts_with("RAILGUARD__")
                                    .then(|| format!("{name}={}", value.to_string_lossy()))
                            })
                            .collect();
                        set.sort();
                        set
                    },
                    baseline: baseline_bin.map(|binary| wire::Baseline {
                        binary,
                        label: baseline_label,
                    }),
                };
                return match wire::run(options).await {
                    Ok(report) => {
                        print!("{}", report.to_markdown());
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                };
            }
        };
        let options = bench::BenchOptions {
            suites,
            lock_clients: lock_clients as usize,
            rss_connections: rss_connections as usize,
            duration: Duration::from_secs(duration_secs),
            warmup: Duration::from_secs(warmup_secs),
            repeats,
            connections: connections as usize,
            accounts,
            pool_size,
            max_requests,
        };
        match bench::run(options).await {
            Ok(report) => {
                print!("{}", report.to_markdown());
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        }
    })
}

/// `name=value`, for `--pg-setting`.
fn parse_setting(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not name=value"))?;
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if !valid {
        return Err(format!("{name:?} is not a PostgreSQL setting name"));
    }
    Ok((name.to_string(), value.to_string()))
}

fn fail(error: &dyn std::fmt::Display) -> ExitCode {
    tracing::error!("{error}");
    eprintln!("railguard-bench: {error}");
    ExitCode::FAILURE
}
