//! `[lock]`: the lock service's HTTP API.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::millis;
use super::{Invalid, ListenerConfig, LockBackendKind, nonzero, positive};

/// `[lock]`: the lock service's HTTP API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LockConfig {
    /// Address of the lock API.
    pub listen: SocketAddr,
    /// Where grants and tokens live.
    pub backend: LockBackendKind,
    /// Largest lease a caller may ask for.
    #[serde(rename = "max_ttl_ms", with = "millis")]
    pub max_ttl: Duration,
    /// Longest a blocking acquire may wait.
    #[serde(rename = "max_wait_ms", with = "millis")]
    pub max_wait: Duration,
    /// Acquirers that may wait at once in this process; more are refused with 429.
    pub max_waiters: usize,
    /// Longest sleep between attempts of a waiter, should a release notification be lost.
    #[serde(rename = "poll_interval_ms", with = "millis")]
    pub poll_interval: Duration,
    /// TLS and limits of the lock listener (`config::listener`).
    #[serde(flatten)]
    pub listener: ListenerConfig,
}

impl Default for LockConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            backend: LockBackendKind::Postgres,
            max_ttl: Duration::from_secs(3600),
            max_wait: Duration::from_secs(300),
            max_waiters: 10_000,
            poll_interval: Duration::from_millis(500),
            listener: ListenerConfig::default(),
        }
    }
}

impl LockConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if !(Duration::from_millis(10)..=Duration::from_secs(86_400)).contains(&self.max_ttl) {
            return Err((
                "lock.max_ttl_ms",
                "must be between 10 ms and one day".into(),
            ));
        }
        nonzero("lock.max_waiters", self.max_waiters as u64)?;
        positive("lock.poll_interval_ms", self.poll_interval)
    }
}
