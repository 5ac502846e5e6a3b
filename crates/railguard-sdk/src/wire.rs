//! The lock API's wire format (FR-08): what travels between a worker and the lock service.
//!
//! The server and the SDK share these types so that the two cannot drift apart. Tokens travel
//! as JSON integers; a grant is the only message that carries a lease secret or a proof, and
//! [`KeyStatus`] (the answer to `inspect`) carries no token at all (FR-07).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// A lock key: 1 to 256 bytes of `A-Z a-z 0-9 . _ : -` — safe in a URL path segment, an etcd
/// key and a log line without escaping.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(String);

impl LockKey {
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::check(text)?;
        Ok(Self(text.to_string()))
    }

    /// Whether `text` is a lock key, without making one: `parse`'s answer, and its reason.
    pub fn check(text: &str) -> Result<(), String> {
        if text.is_empty() {
            return Err("the key is empty".into());
        }
        if text.len() > MAX_KEY_LEN {
            return Err(format!("the key is longer than {MAX_KEY_LEN} bytes"));
        }
        if !text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
        {
            return Err("the key may only hold A-Z a-z 0-9 . _ : -".into());
        }
        Ok(())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    /// Free text without authentication; with it, empty or the authenticated identity's name.
    #[serde(default)]
    pub holder: String,
    pub ttl_ms: u64,
    #[serde(default)]
    pub wait_ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    pub token: i64,
    /// Absent from clients older than lease secrets: they get a 400 that says so.
    #[serde(default)]
    pub lease_secret: Option<String>,
}

/// A grant on the wire. The only place a token leaves the lock service.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct GrantResponse {
    pub key: String,
    pub token: i64,
    pub holder: String,
    pub ttl_ms: u64,
    /// The backend's clock, µs since the Unix epoch; for diagnosis only.
    pub granted_at_us: i64,
    pub expires_at_us: i64,
    /// How long the service waited for the key after receiving the request (a client adds it
    /// to the time it sent the request to bound when its lease began).
    pub waited_ms: u64,
    pub backend: String,
    /// Authorises renew and release of this grant. Returned here only, never again.
    pub lease_secret: String,
    /// Sent to the proxy with the token: proves the token was granted for this key.
    pub fencing_proof: String,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RenewResponse {
    pub key: String,
    pub token: i64,
    pub ttl_ms: u64,
    pub expires_at_us: i64,
}

/// What `inspect` shows: diagnosis only. Deliberately has no token: nothing read from here
/// may be used to make a correctness decision (FR-07, ADR-002 §A2.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStatus {
    pub key: String,
    pub held: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_remaining_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_age_ms: Option<i64>,
}

/// Every refusal's body: a stable `error` code, a message for people, and for a 503 the
/// `outcome` (`none`: nothing changed; `unknown`: the change may have been made).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default)]
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
}
