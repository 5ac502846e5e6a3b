//! `[proxy]`: the listener payment workers talk to and the rail behind it.

use std::net::SocketAddr;
use std::time::Duration;

use http::HeaderName;
use serde::{Deserialize, Serialize};

use super::values::{header, millis};
use super::{Invalid, ListenerConfig, Upstream, nonzero, positive};

/// `[proxy]`: the listener payment workers talk to and the rail behind it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address the proxy listens on (HTTP/1.1 and cleartext HTTP/2).
    pub listen: SocketAddr,
    /// The rail, `http://host:port` or `https://host:port`. Request paths are appended to it.
    pub upstream: Upstream,
    /// PEM CA certificate(s) an `https://` rail's certificate must chain to. Required for
    /// `https://`: the system's roots are not used (name the distribution's bundle to trust
    /// the public CAs).
    pub upstream_ca_file: String,
    /// PEM client certificate and key railguard presents to a rail that requires one.
    pub upstream_cert_file: String,
    pub upstream_key_file: String,
    /// Deadline for a whole request: body, fence check and the rail's response headers.
    #[serde(rename = "request_timeout_ms", with = "millis")]
    pub request_timeout: Duration,
    /// Deadline for opening a TCP connection to the rail, and again for its TLS handshake.
    #[serde(rename = "upstream_connect_timeout_ms", with = "millis")]
    pub upstream_connect_timeout: Duration,
    /// How long a forward whose request deadline passed (the client got 504) keeps waiting
    /// for the rail's answer before its connection is closed. Meanwhile no higher token's
    /// forward for the account starts, so a late request cannot reach the rail after a newer
    /// grant's. Zero: no limit — the turn passes on only when the rail answers or the
    /// connection to it fails (INV-05 under any delay, at the price of an account blocked in
    /// this process while the rail holds an answer back).
    #[serde(rename = "late_answer_wait_ms", with = "millis")]
    pub late_answer_wait: Duration,
    /// The longest a request railguard wrote to the rail can spend on its way there — in
    /// socket buffers, relays, load balancers — before the rail receives it or never will.
    /// Railguard cannot measure it; the operator states it for the network in between. A
    /// forward whose answer never came (a reset connection, a killed process) counts as
    /// possibly on its way for this long: other railguard processes hold newer tokens for its
    /// account until then, and `idempotency-forget` refuses its record until then.
    #[serde(rename = "rail_transit_ms", with = "millis")]
    pub rail_transit: Duration,
    /// Largest request body accepted; larger bodies get 413 and are never forwarded.
    pub max_body_bytes: u64,
    /// Header that carries the fencing token (C2 §2.2).
    #[serde(with = "header")]
    pub token_header: HeaderName,
    /// Header that names the account the request moves money on (C2 §2.2).
    #[serde(with = "header")]
    pub account_header: HeaderName,
    /// Header that carries the idempotency key (C3 §3.1); recorded, and passed through to the
    /// rail so that a rail which deduplicates by it absorbs a retry the proxy cannot judge.
    #[serde(with = "header")]
    pub idempotency_header: HeaderName,
    /// Header a retry sends with the token its key was first sent under (`docs/operations.md`,
    /// "When a store goes back"): if that token is below the fencing floor and the key has no
    /// record, the record may have been lost with the store, and the retry is in doubt.
    #[serde(with = "header")]
    pub first_token_header: HeaderName,
    /// Header that carries the grant's proof that the token was granted for the account's
    /// lock key (C2 §2.3).
    #[serde(with = "header")]
    pub proof_header: HeaderName,
    /// Longest account id accepted, in bytes.
    pub max_account_len: usize,
    /// Bind `listen` with `SO_REUSEPORT`, so that several railguard processes on one host
    /// (each of them setting it) share the address and the kernel spreads new connections
    /// among them: one process per core, each with `runtime.worker_threads = 1`, or a new
    /// process started beside the old one before that is stopped. Off by default: a second
    /// process on the same address is then a start-up error, not a silent share.
    pub reuse_port: bool,
    /// TLS and limits of the proxy listener (`config::listener`).
    #[serde(flatten)]
    pub listener: ListenerConfig,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstream: Upstream::parse("http://127.0.0.1:9090").expect("valid default"),
            upstream_ca_file: String::new(),
            upstream_cert_file: String::new(),
            upstream_key_file: String::new(),
            request_timeout: Duration::from_secs(10),
            upstream_connect_timeout: Duration::from_secs(2),
            // No limit: safety never depends on a clock (INV-07).
            late_answer_wait: Duration::ZERO,
            rail_transit: Duration::from_secs(30),
            max_body_bytes: 1024 * 1024,
            token_header: HeaderName::from_static("fencing-token"),
            account_header: HeaderName::from_static("fencing-account"),
            idempotency_header: HeaderName::from_static("idempotency-key"),
            first_token_header: HeaderName::from_static("idempotency-first-token"),
            proof_header: HeaderName::from_static("fencing-proof"),
            max_account_len: 128,
            reuse_port: false,
            listener: ListenerConfig::default(),
        }
    }
}

impl ProxyConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        positive("proxy.request_timeout_ms", self.request_timeout)?;
        positive(
            "proxy.upstream_connect_timeout_ms",
            self.upstream_connect_timeout,
        )?;
        if !(Duration::from_millis(1)..=Duration::from_secs(86_400)).contains(&self.rail_transit) {
            return Err((
                "proxy.rail_transit_ms",
                "must be between 1 ms and one day".into(),
            ));
        }
        if self.upstream.is_https() && self.upstream_ca_file.is_empty() {
            return Err((
                "proxy.upstream_ca_file",
                "an https:// upstream needs a CA certificate file (PEM); the system's roots are \
                 not used"
                    .into(),
            ));
        }
        if self.upstream_cert_file.is_empty() != self.upstream_key_file.is_empty() {
            return Err((
                "proxy.upstream_key_file",
                "upstream_cert_file and upstream_key_file go together".into(),
            ));
        }
        let tls = !self.upstream_ca_file.is_empty() || !self.upstream_cert_file.is_empty();
        if tls && !self.upstream.is_https() {
            return Err((
                "proxy.upstream",
                "TLS files are set (proxy.upstream_ca_file, upstream_cert_file): the upstream \
                 must be https://"
                    .into(),
            ));
        }
        nonzero("proxy.max_body_bytes", self.max_body_bytes)?;
        nonzero("proxy.max_account_len", self.max_account_len as u64)?;
        // Each header carries one thing: two roles on one header would let one value be read
        // as another.
        let headers = [
            ("proxy.token_header", &self.token_header),
            ("proxy.account_header", &self.account_header),
            ("proxy.idempotency_header", &self.idempotency_header),
            ("proxy.first_token_header", &self.first_token_header),
            ("proxy.proof_header", &self.proof_header),
        ];
        for (i, (key, name)) in headers.iter().enumerate() {
            if let Some((other, _)) = headers[..i].iter().find(|(_, n)| n == name) {
                return Err((key, format!("must differ from {other}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    use crate::config::load::parse_for_test as parse;

    #[test]
    fn tls_to_the_rail_needs_an_https_upstream_and_a_ca() {
        let config = parse(
            "[proxy]\nupstream = \"https://rail.internal:8443\"\nupstream_ca_file = \"/etc/rg/ca.pem\"\n",
            &[],
        )
        .unwrap();
        assert!(config.proxy.upstream.is_https());
        assert_eq!(
            config.proxy.upstream.to_string(),
            "https://rail.internal:8443"
        );
        let err = parse(
            "[proxy]\nupstream = \"http://rail:80\"\nupstream_ca_file = \"/ca.pem\"\n",
            &[],
        )
        .unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.upstream"));
        let err = parse(
            "[proxy]\nupstream = \"https://rail\"\nupstream_ca_file = \"/ca.pem\"\n",
            &[("RAILGUARD__PROXY__UPSTREAM_CERT_FILE", "/client.pem")],
        )
        .unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.upstream_key_file"));
        let err = parse("[proxy]\nupstream = \"https://u:p@rail\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.upstream"));
        let config = parse(
            "",
            &[("RAILGUARD__DATABASE__TLS_CA_FILE", "/etc/rg/pg-ca.pem")],
        )
        .unwrap();
        assert_eq!(config.database.tls_ca_file, "/etc/rg/pg-ca.pem");
    }
}
