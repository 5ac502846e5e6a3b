//! The subcommands of `railguard`, one module each, and what they share: where the
//! configuration comes from ([`config`]) and the async runtime they run on ([`runtime`]).
//! These modules and `main.rs` are the only code that reads flags and the process
//! environment; the library is handed values.

pub(crate) mod check_config;
pub(crate) mod completions;
pub(crate) mod config;
pub(crate) mod credentials;
pub(crate) mod demo;
pub(crate) mod fast_forward;
pub(crate) mod harness;
pub(crate) mod idempotency_forget;
pub(crate) mod inspect;
pub(crate) mod man;
pub(crate) mod marks;
pub(crate) mod migrate;
pub(crate) mod rail_sim;
pub(crate) mod recover_account;
pub(crate) mod runtime;
pub(crate) mod serve;

use std::process::ExitCode;

/// A command's failure, said once on stderr as `railguard: ERROR`; exit 1. For a command that
/// runs until stopped and logs as it goes (`serve`), [`fail_logged`] instead.
pub(crate) fn fail(error: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("railguard: {error}");
    ExitCode::FAILURE
}

/// A failure of a command whose output is its log: said once, as an ERROR log line in the
/// configured format (a JSON log pipeline gets it as a record), or as [`fail`] does when the
/// log filter (`log.level`, `RUST_LOG`) lets no error through; exit 1.
pub(crate) fn fail_logged(error: &dyn std::fmt::Display) -> ExitCode {
    if tracing::enabled!(tracing::Level::ERROR) {
        tracing::error!("{error}");
        ExitCode::FAILURE
    } else {
        fail(error)
    }
}
