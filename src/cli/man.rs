//! `railguard man`.

use std::process::ExitCode;

/// Print railguard's manual page, or one command's, as roff.
///
/// Read it with `railguard man | man -l -`; install it with `railguard man >
/// /usr/local/share/man/man1/railguard.1` and, for each command, `railguard man COMMAND >
/// /usr/local/share/man/man1/railguard-COMMAND.1`. The pages say what `--help` says.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// A command whose page to print (railguard-COMMAND(1)), e.g. fast-forward; without it,
    /// railguard(1), which lists the commands.
    command: Option<String>,
}

/// Writes the page of `command` (railguard's whole command line), or of its subcommand, to
/// stdout.
pub(crate) fn run(args: Args, mut command: clap::Command) -> ExitCode {
    // Building names each subcommand's page and usage after railguard's (`railguard-marks`,
    // `railguard marks`).
    command.build();
    let page = match &args.command {
        None => command,
        Some(name) => match command.find_subcommand(name) {
            Some(sub) => sub.clone(),
            None => {
                let known: Vec<&str> = command.get_subcommands().map(|c| c.get_name()).collect();
                eprintln!(
                    "railguard man: there is no command {name:?}; the commands are {}",
                    known.join(", ")
                );
                return ExitCode::from(2);
            }
        },
    };
    let mut out = Vec::new();
    let rendered = clap_mangen::Man::new(page)
        .source(format!("railguard {}", env!("CARGO_PKG_VERSION")))
        .manual("railguard")
        .render(&mut out);
    match rendered.and_then(|()| std::io::Write::write_all(&mut std::io::stdout(), &out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => super::fail(&format!("cannot write the manual page: {e}")),
    }
}
