//! The async runtime a command runs on.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

/// How long the end of a command waits for blocking work still running (see [`run`]).
const BLOCKING_WORK_AT_EXIT: Duration = Duration::from_secs(2);

/// Runs `command` to its end on a multi-threaded runtime with `threads` workers (0: one per
/// CPU), then stops the runtime.
pub(crate) fn run(threads: usize, command: impl Future<Output = ExitCode>) -> ExitCode {
    // Always set, so that tokio never reads `TOKIO_WORKER_THREADS` (it panics on a bad value):
    // the configuration is the one place this is decided.
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let runtime = match build(threads) {
        Ok(runtime) => runtime,
        Err(e) => return super::fail(&format!("cannot start the async runtime: {e}")),
    };
    let code = runtime.block_on(command);
    // Dropping a runtime waits for every `spawn_blocking` task still running, however long: a
    // TLS listener's check of its certificate files on a mount that hangs would keep a process
    // that has already drained and closed everything from ever exiting. What is left by now is
    // background work whose result nobody waits for.
    runtime.shutdown_timeout(BLOCKING_WORK_AT_EXIT);
    code
}

/// The multi-threaded runtime with `threads` workers. tokio panics, rather than returning an
/// error, when the system refuses a worker thread (a process or memory limit below what
/// `runtime.worker_threads` asks for), and the unwinding then waits forever for the workers
/// already started. So while it builds, a panic ends the process at once with a message.
fn build(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let cause = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        eprintln!(
            "railguard: cannot start the async runtime with {threads} worker threads \
             (runtime.worker_threads): {cause}"
        );
        std::process::exit(1);
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build();
    std::panic::set_hook(default_hook);
    runtime
}
