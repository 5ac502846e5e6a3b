//! `[auth]`: who may call railguard.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Invalid;
use super::values::millis;

/// `[auth]`: who may call railguard (`crate::auth`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The credentials file (hashed secrets, certificate fingerprints, and what each identity
    /// may touch). Empty: no authentication on any listener.
    pub credentials_file: PathBuf,
    /// How often the credentials file is checked for changes.
    #[serde(rename = "reload_interval_ms", with = "millis")]
    pub reload_interval: Duration,
    /// Lock-API requests per second per identity, unless the identity has its own limit.
    pub lock_requests_per_s: u32,
    /// Lock-API requests one identity may have open at once (waiting acquires included), so
    /// that one worker cannot fill the lock listener's `max_in_flight`.
    pub lock_in_flight_per_identity: usize,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            credentials_file: PathBuf::new(),
            reload_interval: Duration::from_secs(1),
            lock_requests_per_s: 200,
            lock_in_flight_per_identity: 100,
        }
    }
}

impl AuthConfig {
    /// Whether authentication is on.
    pub fn enabled(&self) -> bool {
        !self.credentials_file.as_os_str().is_empty()
    }

    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if !(Duration::from_millis(50)..=Duration::from_secs(3600)).contains(&self.reload_interval)
        {
            return Err((
                "auth.reload_interval_ms",
                "must be between 50 ms and one hour".into(),
            ));
        }
        if !(1..=1_000_000).contains(&self.lock_requests_per_s) {
            return Err((
                "auth.lock_requests_per_s",
                "must be between 1 and 1000000".into(),
            ));
        }
        if !(1..=1_000_000).contains(&self.lock_in_flight_per_identity) {
            return Err((
                "auth.lock_in_flight_per_identity",
                "must be between 1 and 1000000".into(),
            ));
        }
        Ok(())
    }
}
