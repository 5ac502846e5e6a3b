//! `[idempotency]`: C3 §3.1 at the proxy.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::secs;
use super::{Invalid, positive};

/// `[idempotency]`: C3 §3.1 at the proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// Refuse (400) requests without an idempotency key.
    pub required: bool,
    /// How long a record is kept; a repeat after that is a new request.
    #[serde(rename = "retention_secs", with = "secs")]
    pub retention: Duration,
    /// How often expired records are removed.
    #[serde(rename = "sweep_interval_secs", with = "secs")]
    pub sweep_interval: Duration,
    /// Largest response body stored for replay; a larger one is replayed without its body.
    pub max_response_bytes: usize,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            required: false,
            retention: Duration::from_secs(86_400),
            sweep_interval: Duration::from_secs(60),
            max_response_bytes: 65_536,
        }
    }
}

impl IdempotencyConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        positive("idempotency.retention_secs", self.retention)?;
        positive("idempotency.sweep_interval_secs", self.sweep_interval)?;
        if self.max_response_bytes > 16 * 1024 * 1024 {
            return Err((
                "idempotency.max_response_bytes",
                "must be at most 16 MiB".into(),
            ));
        }
        Ok(())
    }
}
