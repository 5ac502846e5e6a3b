//! `railguard fast-forward`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use railguard::fast_forward::{self, FastForward, PaydbFence, ProgressLine};

use super::config::{config_path, load};
use super::fail;

/// Move the token source past every mark, after a restore or backend switch.
///
/// Run it before traffic resumes after a restore of lockdb or a switch of `lock.backend`
/// (C1 §1.7): PostgreSQL by setval, etcd by writes to a scratch key (with progress; safe to
/// interrupt and run again). Then a fresh draw must come out above the marks. Exit 0: done
/// and verified; 3: nothing to do (already above); 1: failed or interrupted (run it again);
/// 2: bad config or flags.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The config of the railguard whose source to move: `lock.backend` (the one being
    /// switched to), `[etcd]`, and `[database]` for the marks.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The paydb database (`postgres://…`, TLS as its `sslmode` says): the source must also
    /// pass max(COLUMN) of its TABLE, the fenced UPDATE's fence (C1 §1.6).
    #[arg(long, value_name = "URL")]
    paydb_url: Option<String>,
    /// The paydb table (`table` or `schema.table`); with --paydb-url.
    #[arg(
        long,
        value_name = "TABLE",
        default_value = "account",
        requires = "paydb_url"
    )]
    paydb_table: String,
    /// The paydb column holding each row's fencing token; with --paydb-url.
    #[arg(
        long,
        value_name = "COLUMN",
        default_value = "fence",
        requires = "paydb_url"
    )]
    paydb_column: String,
    /// Print what would be done and move nothing (exit 0 if something would be done, 3
    /// if nothing). Like every command that opens the database, it applies pending schema
    /// migrations first (`railguard migrate --status` shows them without applying).
    #[arg(long)]
    dry_run: bool,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let config = match load(&config_path(args.config)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let paydb = match args.paydb_url {
        None => None,
        Some(url) => {
            let checked = fast_forward::parse_identifier(&args.paydb_table, "--paydb-table", true)
                .and_then(|table| {
                    fast_forward::parse_identifier(&args.paydb_column, "--paydb-column", false)
                        .map(|column| PaydbFence { url, table, column })
                });
            match checked {
                Ok(p) => Some(p),
                Err(e) => {
                    eprintln!("railguard fast-forward: {e}");
                    return ExitCode::from(2);
                }
            }
        }
    };
    let interrupted = async {
        railguard::server::shutdown_signal().await;
        eprintln!("\ninterrupted: stopping the writes in flight");
    };
    let found = |plan: &fast_forward::Plan| println!("{plan}");
    let line = ProgressLine::default();
    let terminal = std::io::stderr().is_terminal();
    // When the last line was written (not on a terminal), and whether one was.
    let last = Mutex::new((Instant::now(), false));
    let progress = |p: railguard::lock::source::Progress| {
        let mut last = last.lock().expect("progress");
        if terminal {
            eprint!("\r{}   ", line.render(p));
            let _ = std::io::stderr().flush();
            last.1 = true;
        } else if last.0.elapsed() >= Duration::from_secs(2) || p.position >= p.target {
            *last = (Instant::now(), true);
            eprintln!("{}", line.render(p));
        }
    };
    let ran = fast_forward::run(
        &config,
        paydb.as_ref(),
        args.dry_run,
        interrupted,
        &found,
        &progress,
    )
    .await;
    if terminal && last.lock().expect("progress").1 {
        // Ends the line the progress was rewriting.
        eprintln!();
    }
    match ran {
        Ok(ran) => {
            println!("{ran}");
            match ran.outcome {
                FastForward::NothingToDo { .. } => ExitCode::from(3),
                FastForward::WouldMove { .. } | FastForward::Done { .. } => ExitCode::SUCCESS,
            }
        }
        Err(e) => fail(&e),
    }
}
