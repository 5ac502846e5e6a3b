//! `railguard-harness` — the M4 fault harness (`railguard harness …` runs it).
//!
//! - `railguard-harness [OPTIONS] --out DIR`: a run — starts a deployment, drives it with
//!   worker processes under faults, saves the history and what every store recorded, checks
//!   the invariants, prints the table; exit 0 when no invariant was violated, 1 when one was.
//! - `railguard-harness check DIR`: checks a saved run again, offline.
//! - `railguard-harness worker …`: one worker process (started by a run).
//!
//! Only this file reads the process environment.

use railguard_harness::{check, coordinator, worker};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "railguard harness",
    version,
    about = "The M4 fault harness: real workers, real faults, a recorded history, an independent checker",
    args_conflicts_with_subcommands = true,
    after_help = FAULTS_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: Option<coordinator::RunOptions>,
}

const FAULTS_HELP: &str = "Faults (--faults all|none|LIST): worker-sigstop, worker-pause, \
lease-expires-mid-submit, lock-path-cut, proxy-path-cut, proxy-path-delay, proxy-kill, \
proxy-sigstop, rail-past-deadline, rolling-config;
  with --pg single (the default): pg-path-cut, pg-path-delay, pg-kill, pg-rewind-data;
  with --pg patroni: pg-failover;
  with --backend etcd: etcd-member-restart, etcd-restore, and with --etcd-members 3 \
etcd-leader-kill. `all` is every fault that applies, except the takeover kinds below, which \
run when named: pg-rewind-takeover (--pg single) and pg-failover-takeover (--pg patroni \
--pg-sync off).

Stores that go back: pg-rewind-data puts railguard's PostgreSQL back to a copy of its data \
taken 2-3 s earlier under load (what promoting an asynchronous standby that missed the last \
commits does); etcd-restore restores etcd from a snapshot taken 2-3 s earlier; pg-failover \
replaces the Patroni primary, hard (SIGKILL, the old primary rejoins) and planned \
(switchover) in turns, and with --pg-sync off every other hard one (the first included) \
after a second of commits its standbys never received. pg-rewind-takeover and \
pg-failover-takeover force a superseded grant across it: one worker is held before its \
submit, another takes its account over and is paid, the others are stopped, the data goes \
back (copy restored, or the primary lost after commits its standbys never received), every \
railguard restarts, and the held worker submits with its old grant. railguard must notice a \
store that went back; `--negative-control no-store-change-detection` turns that off, to show \
what it prevents.

Exit status: 0 no violation, 1 an invariant was violated, 2 the run could not be made.";

#[derive(Subcommand)]
enum Command {
    /// Check a saved run again, offline, from its directory.
    Check { dir: PathBuf },
    /// One worker process (started by a run; not for people).
    #[command(hide = true)]
    Worker(Box<worker::WorkerArgs>),
}

#[allow(clippy::disallowed_methods)] // main reads the environment
fn main() -> ExitCode {
    let cli = Cli::parse();
    let ci = std::env::var_os("CI").is_some();
    let exe = std::env::current_exe();
    let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(log))
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("railguard harness: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(async move {
        match (cli.command, cli.run) {
            (Some(Command::Worker(args)), _) => match worker::run(*args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("worker: {e}");
                    ExitCode::from(2)
                }
            },
            (Some(Command::Check { dir }), _) => match coordinator::check_dir(&dir) {
                Ok(report) => verdict(&report),
                Err(e) => {
                    eprintln!("railguard harness check: {e}");
                    ExitCode::from(2)
                }
            },
            (None, Some(options)) => {
                let exe = match exe {
                    Ok(exe) => exe,
                    Err(e) => {
                        eprintln!("railguard harness: cannot find its own executable: {e}");
                        return ExitCode::from(2);
                    }
                };
                // On SIGINT/SIGTERM the run is dropped, which stops everything it started
                // (workers, railguard processes, PostgreSQL, etcd) and removes their temp dirs.
                let outcome = tokio::select! {
                    outcome = coordinator::run(options, ci, &exe) => outcome,
                    () = railguard::server::shutdown_signal() => {
                        eprintln!("railguard harness: interrupted; stopping everything it started");
                        return ExitCode::from(130);
                    }
                };
                match outcome {
                    Ok(report) => verdict(&report),
                    Err(e) => {
                        eprintln!("railguard harness: {e}");
                        ExitCode::from(2)
                    }
                }
            }
            (None, None) => {
                eprintln!("railguard harness: give --out DIR for a run, or `check DIR`");
                ExitCode::from(2)
            }
        }
    })
}

fn verdict(report: &check::Report) -> ExitCode {
    println!("{}", report.table());
    if report.ok() {
        println!("no invariant violated");
        ExitCode::SUCCESS
    } else {
        println!(
            "VIOLATIONS: {}",
            report
                .violations_by_invariant
                .iter()
                .map(|(k, v)| format!("{k} × {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        ExitCode::from(1)
    }
}
