//! `[etcd]`: the etcd lock backend.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::millis;
use super::{Invalid, positive};

/// `[etcd]`: the etcd lock backend (`lock.backend = "etcd"`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdConfig {
    /// Client URLs of the cluster's members. From the environment: a comma-separated list.
    pub endpoints: Vec<String>,
    /// Deadline for connecting to an endpoint.
    #[serde(rename = "dial_timeout_ms", with = "millis")]
    pub dial_timeout: Duration,
    /// Deadline for one request.
    #[serde(rename = "request_timeout_ms", with = "millis")]
    pub request_timeout: Duration,
    /// Prefix of lock keys.
    pub key_prefix: String,
    /// PEM CA certificate for `https://` endpoints.
    pub tls_ca_file: String,
    /// PEM client certificate and key, when etcd requires client authentication.
    pub tls_cert_file: String,
    pub tls_key_file: String,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            dial_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            key_prefix: "/railguard/locks/".into(),
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
        }
    }
}

impl EtcdConfig {
    /// Checked only when etcd is the backend: an unused section may hold anything.
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if self.endpoints.is_empty() {
            return Err(("etcd.endpoints", "needs at least one endpoint".into()));
        }
        for endpoint in &self.endpoints {
            let uri: http::Uri = endpoint
                .parse()
                .map_err(|e| ("etcd.endpoints", format!("{endpoint:?} is not a URL: {e}")))?;
            match uri.scheme_str() {
                Some("http") => {}
                Some("https") if !self.tls_ca_file.is_empty() => {}
                Some("https") => {
                    return Err((
                        "etcd.tls_ca_file",
                        "https:// endpoints need a CA certificate file".into(),
                    ));
                }
                _ => {
                    return Err((
                        "etcd.endpoints",
                        format!("{endpoint:?} must be http:// or https://"),
                    ));
                }
            }
        }
        if self.tls_cert_file.is_empty() != self.tls_key_file.is_empty() {
            return Err((
                "etcd.tls_key_file",
                "tls_cert_file and tls_key_file go together".into(),
            ));
        }
        positive("etcd.dial_timeout_ms", self.dial_timeout)?;
        positive("etcd.request_timeout_ms", self.request_timeout)?;
        if !self.key_prefix.starts_with('/') || !self.key_prefix.ends_with('/') {
            return Err(("etcd.key_prefix", "must start and end with /".into()));
        }
        let tls = !self.tls_ca_file.is_empty() || !self.tls_cert_file.is_empty();
        if tls && self.endpoints.iter().any(|e| e.starts_with("http://")) {
            return Err((
                "etcd.endpoints",
                "TLS files are set: every endpoint must be https://".into(),
            ));
        }
        Ok(())
    }
}
