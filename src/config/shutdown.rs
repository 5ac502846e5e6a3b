//! `[shutdown]`: how long a stop waits for work in flight.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::millis;

/// `[shutdown]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// How long in-flight requests may take to finish after SIGTERM/SIGINT.
    #[serde(rename = "grace_ms", with = "millis")]
    pub grace: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(10),
        }
    }
}
