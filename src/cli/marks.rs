//! `railguard marks`.

use std::path::PathBuf;
use std::process::ExitCode;

use super::config::{admin_endpoint, config_path, load};
use super::fail;

/// Read one account's high-water mark from the running railguard.
///
/// For an operator diagnosing a fenced-out account: the highest fencing token the fence has
/// accepted for it. Only the admin listener offers it: a worker must never learn a mark
/// (ADR-002 §A2.3).
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The running railguard's config file (for admin.listen).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The account id, as workers send it in Fencing-Account.
    account: String,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let Args { config, account } = args;
    let config = match load(&config_path(config)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match railguard::admin::read_mark(&admin_endpoint(&config), &account).await {
        Ok(0) => {
            println!("{account}: no mark (no token accepted yet)");
            ExitCode::SUCCESS
        }
        Ok(mark) => {
            println!("{account}: mark {mark}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("marks {account}: {e}")),
    }
}
