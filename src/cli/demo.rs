//! `railguard demo`.

use std::process::ExitCode;
use std::time::Duration;

use railguard::config::{LockBackendKind, LogFormat};
use railguard::demo::{DemoOptions, Verdict};
use railguard::telemetry;

use super::config::rust_log;

/// Play the stalled-survivor incident (T-042) and check that the fence held.
///
/// In one process: an embedded PostgreSQL in a temp dir, the lock service, the proxy and the
/// rail simulator run on free loopback ports; W1's lease expires while it stalls, W2 takes
/// over and pays, W1 wakes and is fenced out. Exits 0 only if the rail paid once and the fence
/// held; needs only the PostgreSQL server binaries (and etcd for --backend etcd).
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Lock backend: postgres, or etcd (a throwaway member of the `etcd` on PATH).
    #[arg(long, value_enum, default_value_t = Backend::Postgres)]
    backend: Backend,
    /// W1's lease, in milliseconds (the etcd backend rounds it up to whole seconds).
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u64).range(100..=30_000))]
    ttl_ms: u64,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Backend {
    Postgres,
    Etcd,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    // The narration is the point: railguard's own logs only from warn up.
    telemetry::init(LogFormat::Pretty, "warn", rust_log().as_deref());
    let options = DemoOptions {
        backend: match args.backend {
            Backend::Postgres => LockBackendKind::Postgres,
            Backend::Etcd => LockBackendKind::Etcd,
        },
        ttl: Duration::from_millis(args.ttl_ms),
        search_path: search_path(),
    };
    match railguard::demo::run(options).await {
        Ok(Verdict::Passed) => ExitCode::SUCCESS,
        Ok(Verdict::Failed(_)) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("railguard demo: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// `PATH`, where the demo looks for `etcd`.
#[allow(clippy::disallowed_methods)] // the binary reads the environment
fn search_path() -> Option<std::ffi::OsString> {
    std::env::var_os("PATH")
}
