//! Logging and traces: `pretty` for people, `json` for pipelines.
//!
//! Spans on the request path carry `lock.token` and `account` (C4 §4.8), so one trace shows
//! which grant a request belonged to at every step.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. `rust_log` (the `RUST_LOG` variable, as `main` read it),
/// when set and valid, wins over `level`.
pub fn init(format: LogFormat, level: &str, rust_log: Option<&str>) {
    let filter = rust_log
        .and_then(|filter| EnvFilter::try_new(filter).ok())
        .unwrap_or_else(|| EnvFilter::new(level));
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never into a file or a log pipeline.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Pretty => builder.with_target(false).try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
}
