//! `[admin]`: the admin listener's address and listener settings.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::ListenerConfig;

/// `[admin]`: metrics and health, on their own listener so scrapes never queue behind traffic.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// TLS and limits of the admin listener (`config::listener`).
    #[serde(flatten)]
    pub listener: ListenerConfig,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9100)),
            listener: ListenerConfig::default(),
        }
    }
}
