//! Logging and traces: `pretty` for people, `json` for pipelines.
//!
//! Spans on the request path carry `lock.token` and `account` (C4 §4.8), so one trace shows
//! which grant a request belonged to at every step. The level can be changed while running
//! ([`LogLevel`], SIGHUP with a new `log.level`).

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, fmt, reload};

use crate::config::LogFormat;

/// Installs the global subscriber. `rust_log` (the `RUST_LOG` variable, as `main` read it),
/// when set and valid, wins over `level`. Returns the handle that changes the level later, or
/// `None` when a subscriber was already installed.
pub fn init(format: LogFormat, level: &str, rust_log: Option<&str>) -> Option<LogLevel> {
    let from_rust_log = rust_log.and_then(|filter| EnvFilter::try_new(filter).ok());
    let rust_log_wins = from_rust_log.is_some();
    let filter = from_rust_log.unwrap_or_else(|| EnvFilter::new(level));
    let (filter, handle) = reload::Layer::new(filter);
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never into a file or a log pipeline.
    let ansi = std::io::stderr().is_terminal();
    let registry = tracing_subscriber::registry().with(filter);
    let installed = match format {
        LogFormat::Pretty => registry
            .with(
                fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi)
                    .with_target(false),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(true)
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi),
            )
            .try_init(),
    };
    installed.ok().map(|()| LogLevel {
        handle,
        rust_log_wins,
    })
}

/// Changes the level of the subscriber [`init`] installed.
pub struct LogLevel {
    handle: reload::Handle<EnvFilter, Registry>,
    /// `RUST_LOG` was set and valid: it stays in force, whatever `log.level` says.
    rust_log_wins: bool,
}

/// What [`LogLevel::set`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum LevelChange {
    /// The new level is in force.
    Applied,
    /// `RUST_LOG` is set and wins over `log.level`: nothing changed.
    RustLogWins,
}

impl LogLevel {
    /// Puts `level` (a tracing filter, `log.level`) in force.
    pub fn set(&self, level: &str) -> Result<LevelChange, String> {
        if self.rust_log_wins {
            return Ok(LevelChange::RustLogWins);
        }
        let filter = EnvFilter::try_new(level)
            .map_err(|e| format!("{level:?} is not a tracing filter: {e}"))?;
        self.handle
            .reload(filter)
            .map_err(|e| format!("cannot change the log level: {e}"))?;
        Ok(LevelChange::Applied)
    }
}
