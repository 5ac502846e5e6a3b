//! `railguard harness`.

use std::ffi::OsString;
use std::process::ExitCode;

/// Run the fault harness: real worker processes, real faults, and a checker.
///
/// The M4 fault harness records a history of real worker processes under real faults and has
/// an independent checker judge it (`railguard harness --help`). Runs `railguard-harness`,
/// built beside this binary (`cargo build -p railguard-harness`).
#[derive(clap::Args)]
#[command(disable_help_flag = true)]
pub(crate) struct Args {
    /// What to pass to railguard-harness (`railguard harness --help` lists it).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<OsString>,
}

/// Replaces this process with `railguard-harness` from beside this binary (as `git foo` runs
/// `git-foo`): the harness links the test kit, which the server binary does not.
#[allow(clippy::disallowed_methods)] // the binary finds its own executable
pub(crate) fn run(args: Args) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("railguard-harness")));
    let Some(binary) = beside.filter(|b| b.is_file()) else {
        eprintln!(
            "railguard: railguard-harness is not built beside this binary; build it with \
             `cargo build --release -p railguard-harness` (or use scripts/harness.sh)"
        );
        return ExitCode::from(2);
    };
    let error = std::process::Command::new(&binary).args(args.args).exec();
    eprintln!("railguard: cannot run {}: {error}", binary.display());
    ExitCode::from(2)
}
