//! The `railguard` command. Only this file knows about flags and the process environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use railguard::config::{Config, LogFormat};
use railguard::db::Database;
use railguard::railsim::RailSim;
use railguard::{http_server, server, telemetry};

#[derive(Parser)]
#[command(
    name = "railguard",
    version,
    about = "Fenced proxy and lock service for a non-idempotent payment rail"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the rail proxy and the admin listener until SIGTERM/SIGINT.
    ///
    /// Every config key can be overridden as RAILGUARD__SECTION__KEY, e.g.
    /// RAILGUARD__PROXY__LISTEN=0.0.0.0:8080.
    Serve {
        /// TOML config file (see config/railguard.toml for every key, commented).
        #[arg(long, short, default_value = "config/railguard.toml")]
        config: PathBuf,
    },
    /// Apply pending database migrations and exit (serve applies them too).
    Migrate {
        /// TOML config file; only `[database]` and `[log]` are used.
        #[arg(long, short, default_value = "config/railguard.toml")]
        config: PathBuf,
    },
    /// Remove an idempotency record left "in doubt" by a proxy that stopped before the rail
    /// answered, so that a retry of that key is forwarded again. Check the rail's own records
    /// first: if the payment did happen, forgetting the key lets it happen twice. Asks the
    /// running railguard (its admin listener), which refuses records that may still be in
    /// flight.
    IdempotencyForget {
        /// The running railguard's config file (for admin.listen).
        #[arg(long, short, default_value = "config/railguard.toml")]
        config: PathBuf,
        /// The account the key belongs to (the Fencing-Account of the request).
        #[arg(long)]
        account: String,
        /// The Idempotency-Key.
        #[arg(long)]
        key: String,
    },
    /// Run the rail simulator: a non-idempotent rail that accepts every POST as a new payment
    /// and lists what it received at GET /ledger.
    RailSim {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9090")]
        listen: SocketAddr,
        /// Delay before answering each payment, to make overlaps visible.
        #[arg(long, default_value_t = 0)]
        latency_ms: u64,
        /// Random delay up to this long before a payment is recorded, so that requests can
        /// arrive in a different order than they were sent.
        #[arg(long, default_value_t = 0)]
        jitter_ms: u64,
        /// Behave like a payment API that deduplicates by Idempotency-Key: a second POST with
        /// a key already seen on the account is answered with the first one's response and is
        /// not a new payment.
        #[arg(long)]
        dedupe_idempotency_keys: bool,
    },
    /// Measure the proxy and the lock service against baselines taken in the same run, on
    /// loopback only. proxy: load straight at an in-process rail simulator, through the proxy
    /// with fencing off and on (over several account counts), a stale-token phase, pgbench
    /// running the same compare-and-set on the same throwaway durable PostgreSQL, and the RSS of
    /// a separate `railguard serve` holding many connections. locks: acquire+release cycles
    /// through the lock API on PostgreSQL against pgbench running the same statements. etcd: the
    /// same cycles on the etcd backend against etcd's own Lock/Unlock RPC (needs /usr/bin/etcd).
    /// Prints markdown tables (progress goes to stderr).
    Bench {
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
        pool_size: u64,
        /// Upper bound on requests per repetition, across all connections.
        #[arg(long, default_value_t = 5_000_000)]
        max_requests: u64,
        /// Concurrent clients of the lock phases, and pgbench clients there (at most 140, as
        /// for --connections).
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=140))]
        lock_clients: u64,
        /// Open client connections for the proxy RSS measurement (0 skips it).
        #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(0..=10_000))]
        rss_connections: u64,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchSuite {
    Proxy,
    Locks,
    Etcd,
    All,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        match cli.command {
            Command::Serve { config } => {
                let config = match load(&config) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match server::run(config, server::shutdown_signal()).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => fail(&e),
                }
            }
            Command::IdempotencyForget {
                config,
                account,
                key,
            } => {
                let config = match load(&config) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match railguard::admin::forget_idempotency_key(config.admin.listen, &account, &key)
                    .await
                {
                    Ok(message) => {
                        println!("{message}");
                        ExitCode::SUCCESS
                    }
                    Err(message) => fail(&message),
                }
            }
            Command::Migrate { config } => {
                let config = match load(&config) {
                    Ok(c) => c,
                    Err(code) => return code,
                };
                match Database::open(&config).await {
                    Ok(db) => {
                        tracing::info!(
                            version = railguard::db::migrate::latest_version(),
                            "schema is current"
                        );
                        db.shutdown().await;
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                }
            }
            Command::RailSim {
                listen,
                latency_ms,
                jitter_ms,
                dedupe_idempotency_keys,
            } => {
                telemetry::init(LogFormat::Pretty, "info");
                let listener = match tokio::net::TcpListener::bind(listen).await {
                    Ok(l) => l,
                    Err(e) => return fail(&format!("cannot listen on {listen}: {e}")),
                };
                let mut sim = RailSim::new(Duration::from_millis(latency_ms))
                    .with_jitter(Duration::from_millis(jitter_ms));
                if dedupe_idempotency_keys {
                    sim = sim.deduplicating();
                }
                tracing::info!(%listen, latency_ms, jitter_ms, "rail simulator listening");
                http_server::serve(
                    listener,
                    move |_peer| {
                        let sim = sim.clone();
                        hyper::service::service_fn(move |request| sim.clone().handle(request))
                    },
                    server::shutdown_signal(),
                    Duration::from_secs(5),
                )
                .await;
                ExitCode::SUCCESS
            }
            Command::Bench {
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
            } => {
                use railguard::bench::Suite;
                // Errors only: the stale phase would otherwise log a warning per request.
                telemetry::init(LogFormat::Pretty, "error");
                let suites = match suite {
                    BenchSuite::Proxy => vec![Suite::Proxy],
                    BenchSuite::Locks => vec![Suite::Locks],
                    BenchSuite::Etcd => vec![Suite::Etcd],
                    BenchSuite::All => Suite::ALL.to_vec(),
                };
                let options = railguard::bench::BenchOptions {
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
                match railguard::bench::run(options).await {
                    Ok(report) => {
                        print!("{}", report.to_markdown());
                        ExitCode::SUCCESS
                    }
                    Err(e) => fail(&e),
                }
            }
        }
    })
}

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    match Config::load(path) {
        Ok(config) => {
            telemetry::init(config.log.format, &config.log.level);
            Ok(config)
        }
        Err(e) => {
            eprintln!("railguard: configuration error: {e}");
            Err(ExitCode::from(2))
        }
    }
}

fn fail(error: &dyn std::fmt::Display) -> ExitCode {
    tracing::error!("{error}");
    eprintln!("railguard: {error}");
    ExitCode::FAILURE
}
