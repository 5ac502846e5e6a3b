//! `railguard migrate`.

use std::path::PathBuf;
use std::process::ExitCode;

use railguard::db::migrate;

use super::config::{config_path, load};
use super::fail;

/// Apply pending database migrations and bring indexes up to date, then exit.
///
/// Indexes are built without blocking writes, and waited for. `serve` does both too, the
/// indexes in the background; running this first keeps a long index build out of a rollout.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// TOML config file; only `[database]` and `[log]` are used.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// List every migration and whether it is applied, pending or changed, and apply
    /// nothing. Exit 0 when the schema is current, 1 when it is not. Needs a
    /// `postgres://` database.url: the embedded database is private to `railguard serve`
    /// (whose /readyz says whether its schema is current).
    #[arg(long)]
    status: bool,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let config = match load(&config_path(args.config)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if !args.status {
        return match migrate::apply(&config.database).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&e),
        };
    }
    match migrate::read_status(&config.database).await {
        Ok(status) => {
            print!("{status}");
            if status.is_current() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => fail(&e),
    }
}
