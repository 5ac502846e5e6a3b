//! `railguard idempotency-forget`.

use std::path::PathBuf;
use std::process::ExitCode;

use railguard::store::records::OwnerStopped;

use super::config::{admin_endpoint, config_path, load};
use super::fail;

/// Forget a record left in doubt, so that a retry of its key is forwarded.
///
/// An idempotency record is in doubt when its forward ended without the rail's answer. Follow the procedure
/// below: if the payment did happen, forgetting the key lets it happen twice. Asks a running
/// railguard (its admin listener), which refuses while the record's owner may still send it or
/// what it sent may still reach the rail, and says until when.
#[derive(clap::Args)]
#[command(after_help = railguard::admin::IN_DOUBT_PROCEDURE)]
pub(crate) struct Args {
    /// The running railguard's config file (for admin.listen).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The account the key belongs to (the Fencing-Account of the request).
    #[arg(long)]
    account: String,
    /// The Idempotency-Key.
    #[arg(long)]
    key: String,
    /// Only when forget answers that nothing shows the record's owner has stopped (it
    /// crashed, or may be paused): the owner's instance, named in that answer and logged by
    /// that railguard when it started, once you have seen that process stop. Paused is not
    /// stopped. An owner holding its instance lock is refused whatever this says; the audit
    /// record says the forget rested on your word. `unrecorded` is for a record that names
    /// no owner (made by a railguard older than migration 0004): every railguard running
    /// when it was made has stopped.
    #[arg(long, value_name = "INSTANCE|unrecorded")]
    owner_stopped: Option<OwnerStopped>,
    /// Decide and change nothing: say whether the record would be forgotten now, or why
    /// not and until when (step 2 of the procedure). Exit 0 if it would be, 1 if not.
    #[arg(long)]
    dry_run: bool,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let config = match load(&config_path(args.config)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match railguard::admin::forget_idempotency_key(
        &admin_endpoint(&config),
        &args.account,
        &args.key,
        args.owner_stopped,
        args.dry_run,
    )
    .await
    {
        Ok(message) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(message) => fail(&message),
    }
}
