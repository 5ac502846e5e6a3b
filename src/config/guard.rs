//! `[guard]`: the token-source guard and store-change detection.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Invalid;
use super::values::millis;

/// `[guard]`: the token-source guard (`crate::lock::guard`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    /// How often the token source is compared with the highest fencing mark (besides at start).
    #[serde(rename = "interval_ms", with = "millis")]
    pub interval: Duration,
    /// Writes in flight at once when `railguard fast-forward` moves etcd's revision.
    pub fast_forward_concurrency: usize,
    /// Whether a store that went back (a PostgreSQL failover or rewind, etcd restored from a
    /// snapshot) is detected and fenced (`crate::store::epoch`). `false` exists only to show,
    /// in the fault harness, what goes wrong without it: it is logged loudly and
    /// `railguard_store_change_detection` is 0.
    pub detect_store_changes: bool,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(30),
            fast_forward_concurrency: 64,
            detect_store_changes: true,
        }
    }
}

impl GuardConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if !(Duration::from_millis(10)..=Duration::from_secs(3600)).contains(&self.interval) {
            return Err((
                "guard.interval_ms",
                "must be between 10 ms and one hour".into(),
            ));
        }
        if !(1..=1024).contains(&self.fast_forward_concurrency) {
            return Err((
                "guard.fast_forward_concurrency",
                "must be between 1 and 1024".into(),
            ));
        }
        Ok(())
    }
}
