//! The `railguard` command: parses the command line and hands each subcommand to its module
//! under `cli/`, which with this file is the only code that reads flags and the process
//! environment.

mod cli;

use std::process::ExitCode;

/// The process's allocator (docs/performance.md, "Allocations").
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{CommandFactory, Parser, Subcommand};

use cli::{
    check_config, completions, credentials, demo, fast_forward, harness, idempotency_forget,
    inspect, man, marks, migrate, rail_sim, recover_account, runtime, serve,
};

/// Fenced proxy and lock service for a non-idempotent payment rail.
///
/// Workers take a lease on an account from the lock API and get a fencing token with it; the
/// proxy forwards a payment to the rail only if its token is not below the highest one the
/// account has seen. Start with `railguard demo`; run with `railguard serve`. Every command
/// has `--help`; `railguard man` prints the manual page and `railguard completions SHELL` a
/// completion script.
#[derive(Parser)]
#[command(name = "railguard", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Demo(demo::Args),
    Serve(serve::Args),
    CheckConfig(check_config::Args),
    Inspect(inspect::Args),
    Marks(marks::Args),
    FastForward(fast_forward::Args),
    RecoverAccount(recover_account::Args),
    Migrate(migrate::Args),
    IdempotencyForget(idempotency_forget::Args),
    CredentialsNewSecret(credentials::NewSecret),
    RailSim(rail_sim::Args),
    Harness(harness::Args),
    Completions(completions::Args),
    Man(man::Args),
}

fn main() -> ExitCode {
    // Each command on the runtime it needs: none for those that only print or hand over, one
    // built from the configuration for `serve`, the default for the rest.
    match Cli::parse().command {
        Command::Harness(args) => harness::run(args),
        Command::Completions(args) => completions::run(args, Cli::command()),
        Command::Man(args) => man::run(args, Cli::command()),
        Command::CredentialsNewSecret(args) => credentials::new_secret(args),
        Command::Serve(args) => serve::run(args),
        Command::Demo(args) => runtime::run(0, demo::run(args)),
        Command::CheckConfig(args) => runtime::run(0, check_config::run(args)),
        Command::Inspect(args) => runtime::run(0, inspect::run(args)),
        Command::Marks(args) => runtime::run(0, marks::run(args)),
        Command::FastForward(args) => runtime::run(0, fast_forward::run(args)),
        Command::RecoverAccount(args) => runtime::run(0, recover_account::run(args)),
        Command::Migrate(args) => runtime::run(0, migrate::run(args)),
        Command::IdempotencyForget(args) => runtime::run(0, idempotency_forget::run(args)),
        Command::RailSim(args) => runtime::run(0, rail_sim::run(args)),
    }
}
