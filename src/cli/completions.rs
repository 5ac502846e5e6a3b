//! `railguard completions`.

use std::process::ExitCode;

use clap_complete::Shell;

/// Print a shell completion script for railguard's commands and flags.
///
/// Install it where the shell looks for completions, e.g. bash:
/// `railguard completions bash > /etc/bash_completion.d/railguard` (or `source <(railguard
/// completions bash)` in ~/.bashrc); zsh: `railguard completions zsh > _railguard` in a
/// directory on $fpath; fish: `railguard completions fish >
/// ~/.config/fish/completions/railguard.fish`. Print it again after an upgrade.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: Shell,
}

/// Writes the script for `command`, railguard's whole command line, to stdout.
pub(crate) fn run(args: Args, mut command: clap::Command) -> ExitCode {
    clap_complete::generate(
        args.shell,
        &mut command,
        "railguard",
        &mut std::io::stdout(),
    );
    ExitCode::SUCCESS
}
