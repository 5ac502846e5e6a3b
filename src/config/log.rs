//! `[log]`: the format and filter of railguard's log.

use serde::{Deserialize, Serialize};

use super::Invalid;

/// `[log]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `pretty` or `json`.
    pub format: LogFormat,
    /// A tracing filter such as `info` or `railguard=debug,info`; `RUST_LOG` wins if set.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".into(),
        }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        tracing_subscriber::EnvFilter::try_new(&self.level)
            .map(|_| ())
            .map_err(|e| {
                (
                    "log.level",
                    format!("{:?} is not a tracing filter: {e}", self.level),
                )
            })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}
