//! The settings every listener has, whatever it serves: TLS and the limits that keep a client
//! from holding the listener.
//!
//! `[proxy]`, `[admin]` and `[lock]` each carry the same flat keys (`proxy.max_connections`,
//! `lock.tls_cert_file`, …), so each is overridable as `RAILGUARD__SECTION__KEY` like any
//! other key. They are read into one [`ListenerConfig`] flattened into each section, and
//! handed to the accept loop as [`ListenerSettings`]: the limits, and the TLS files when
//! `tls_cert_file` is set (empty means plain TCP).

use std::path::PathBuf;
use std::time::Duration;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use super::Invalid;
use super::values::millis;

/// Whether a TLS listener asks for client certificates (mutual TLS).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// No client certificate is asked for.
    #[default]
    None,
    /// A client may present a certificate; if it does, it must verify against
    /// `tls_client_ca_file`. Clients without one are served too.
    Optional,
    /// Every client must present a certificate that verifies against `tls_client_ca_file`;
    /// others are refused at the handshake.
    Required,
}

/// The listener keys of one section, as the file spells them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ListenerConfig {
    /// PEM certificate chain served by this listener; empty for plain TCP. Re-read when the
    /// file changes (checked at most once a second, at a handshake).
    pub tls_cert_file: String,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: String,
    /// PEM CA certificates that client certificates must chain to (mutual TLS).
    pub tls_client_ca_file: String,
    /// `none`, `optional` or `required`: whether clients are asked for a certificate.
    pub tls_client_auth: ClientAuth,
    /// Open connections; a connection accepted beyond this is closed at once.
    pub max_connections: usize,
    /// Requests being served at once across the listener; more are answered 503.
    pub max_in_flight: usize,
    /// Largest request head (request line and headers) in bytes; larger gets 431.
    pub max_header_bytes: usize,
    /// Most request headers; more gets 431.
    pub max_headers: usize,
    /// Concurrent streams an HTTP/2 client may open on one connection.
    pub h2_max_concurrent_streams: u32,
    /// Deadline for a request head from its first byte (from the connection's start for the
    /// first request), and for the TLS handshake. A client that is slower is disconnected.
    #[serde(rename = "header_read_timeout_ms", with = "millis")]
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and nothing received for this long is closed.
    #[serde(rename = "idle_timeout_ms", with = "millis")]
    pub idle_timeout: Duration,
}

/// The field names of [`ListenerConfig`], for error messages that name the key.
#[derive(Deserialize)]
#[serde(default)]
struct Raw {
    tls_cert_file: String,
    tls_key_file: String,
    tls_client_ca_file: String,
    tls_client_auth: ClientAuth,
    max_connections: usize,
    max_in_flight: usize,
    max_header_bytes: usize,
    max_headers: usize,
    h2_max_concurrent_streams: u32,
    #[serde(rename = "header_read_timeout_ms", with = "millis")]
    header_read_timeout: Duration,
    #[serde(rename = "idle_timeout_ms", with = "millis")]
    idle_timeout: Duration,
}

impl Default for Raw {
    fn default() -> Self {
        let d = ListenerConfig::default();
        Raw {
            tls_cert_file: d.tls_cert_file,
            tls_key_file: d.tls_key_file,
            tls_client_ca_file: d.tls_client_ca_file,
            tls_client_auth: d.tls_client_auth,
            max_connections: d.max_connections,
            max_in_flight: d.max_in_flight,
            max_header_bytes: d.max_header_bytes,
            max_headers: d.max_headers,
            h2_max_concurrent_streams: d.h2_max_concurrent_streams,
            header_read_timeout: d.header_read_timeout,
            idle_timeout: d.idle_timeout,
        }
    }
}

/// Flattened into a section, these keys are read from the section's buffered entries, out of
/// sight of the path tracking that names the key in errors: the key is put into the message
/// (`` `max_headers`: invalid type… ``) so that the error still says which one was wrong.
impl<'de> Deserialize<'de> for ListenerConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: Raw = serde_path_to_error::deserialize(d)
            .map_err(|e| D::Error::custom(format!("`{}`: {}", e.path(), e.inner())))?;
        Ok(ListenerConfig {
            tls_cert_file: raw.tls_cert_file,
            tls_key_file: raw.tls_key_file,
            tls_client_ca_file: raw.tls_client_ca_file,
            tls_client_auth: raw.tls_client_auth,
            max_connections: raw.max_connections,
            max_in_flight: raw.max_in_flight,
            max_header_bytes: raw.max_header_bytes,
            max_headers: raw.max_headers,
            h2_max_concurrent_streams: raw.h2_max_concurrent_streams,
            header_read_timeout: raw.header_read_timeout,
            idle_timeout: raw.idle_timeout,
        })
    }
}

impl Default for ListenerConfig {
    fn default() -> Self {
        let limits = ListenerLimits::default();
        Self {
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
            tls_client_ca_file: String::new(),
            tls_client_auth: ClientAuth::None,
            max_connections: limits.max_connections,
            max_in_flight: limits.max_in_flight,
            max_header_bytes: limits.max_header_bytes,
            max_headers: limits.max_headers,
            h2_max_concurrent_streams: limits.h2_max_concurrent_streams,
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
        }
    }
}

/// What the accept loop needs to know about one listener.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListenerSettings {
    /// `None` for plain TCP.
    pub tls: Option<ListenerTls>,
    pub limits: ListenerLimits,
}

/// A TLS listener's files.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Set whenever `client_auth` is not [`ClientAuth::None`].
    pub client_ca_file: Option<PathBuf>,
    pub client_auth: ClientAuth,
}

/// The limits of one listener. The defaults are those of the config file.
#[derive(Debug, Clone, PartialEq)]
pub struct ListenerLimits {
    pub max_connections: usize,
    pub max_in_flight: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub h2_max_concurrent_streams: u32,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            max_in_flight: 10_000,
            max_header_bytes: 32 * 1024,
            max_headers: 100,
            h2_max_concurrent_streams: 200,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// hyper's read buffer, which bounds the request head, cannot be smaller than this.
pub const MIN_HEADER_BYTES: usize = 8192;

impl ListenerConfig {
    /// The settings the accept loop takes.
    pub fn settings(&self) -> ListenerSettings {
        let tls = (!self.tls_cert_file.is_empty()).then(|| ListenerTls {
            cert_file: PathBuf::from(&self.tls_cert_file),
            key_file: PathBuf::from(&self.tls_key_file),
            client_ca_file: (!self.tls_client_ca_file.is_empty())
                .then(|| PathBuf::from(&self.tls_client_ca_file)),
            client_auth: self.tls_client_auth,
        });
        ListenerSettings {
            tls,
            limits: ListenerLimits {
                max_connections: self.max_connections,
                max_in_flight: self.max_in_flight,
                max_header_bytes: self.max_header_bytes,
                max_headers: self.max_headers,
                h2_max_concurrent_streams: self.h2_max_concurrent_streams,
                header_read_timeout: self.header_read_timeout,
                idle_timeout: self.idle_timeout,
            },
        }
    }

    /// Checks the keys of `section` (`"proxy"`, `"admin"` or `"lock"`).
    pub(super) fn validate(&self, section: &'static str) -> Result<(), Invalid> {
        let key = |name: &str| -> &'static str { key(section, name) };
        let nonzero = |name: &str, value: u64| {
            if value == 0 {
                return Err((key(name), "must be greater than zero".to_string()));
            }
            Ok(())
        };
        nonzero("max_connections", self.max_connections as u64)?;
        nonzero("max_in_flight", self.max_in_flight as u64)?;
        nonzero("max_headers", self.max_headers as u64)?;
        nonzero(
            "h2_max_concurrent_streams",
            u64::from(self.h2_max_concurrent_streams),
        )?;
        nonzero(
            "header_read_timeout_ms",
            self.header_read_timeout.as_millis() as u64,
        )?;
        nonzero("idle_timeout_ms", self.idle_timeout.as_millis() as u64)?;
        if !(MIN_HEADER_BYTES..=16 * 1024 * 1024).contains(&self.max_header_bytes) {
            return Err((
                key("max_header_bytes"),
                format!("must be between {MIN_HEADER_BYTES} and 16777216"),
            ));
        }
        let tls = !self.tls_cert_file.is_empty();
        if tls && self.tls_key_file.is_empty() {
            return Err((
                key("tls_key_file"),
                "tls_cert_file and tls_key_file go together".into(),
            ));
        }
        if !tls && !self.tls_key_file.is_empty() {
            return Err((
                key("tls_cert_file"),
                "tls_cert_file and tls_key_file go together".into(),
            ));
        }
        match self.tls_client_auth {
            ClientAuth::None => {}
            _ if !tls => {
                return Err((
                    key("tls_client_auth"),
                    "client certificates need TLS: set tls_cert_file and tls_key_file".into(),
                ));
            }
            _ if self.tls_client_ca_file.is_empty() => {
                return Err((
                    key("tls_client_ca_file"),
                    "must be set when tls_client_auth is \"optional\" or \"required\"".into(),
                ));
            }
            _ => {}
        }
        if self.tls_client_auth == ClientAuth::None && !self.tls_client_ca_file.is_empty() {
            return Err((
                key("tls_client_auth"),
                "tls_client_ca_file is set: say \"optional\" or \"required\"".into(),
            ));
        }
        Ok(())
    }
}

/// `section.name` as the `&'static str` [`Invalid`] carries. Only the listener sections' keys
/// reach here, so the table is finite; anything else (a bug) names the section alone.
fn key(section: &'static str, name: &str) -> &'static str {
    macro_rules! keys {
        ($($field:literal),*) => {
            match (section, name) {
                $(("proxy", $field) => concat!("proxy.", $field),)*
                $(("admin", $field) => concat!("admin.", $field),)*
                $(("lock", $field) => concat!("lock.", $field),)*
                _ => section,
            }
        };
    }
    keys!(
        "tls_cert_file",
        "tls_key_file",
        "tls_client_ca_file",
        "tls_client_auth",
        "max_connections",
        "max_in_flight",
        "max_header_bytes",
        "max_headers",
        "h2_max_concurrent_streams",
        "header_read_timeout_ms",
        "idle_timeout_ms"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::load::parse_for_test as parse;

    #[test]
    fn each_listener_section_has_its_own_keys_from_the_file_and_the_environment() {
        let config = parse(
            "[proxy]\nmax_connections = 7\nheader_read_timeout_ms = 250\n\
             tls_cert_file = \"/c.pem\"\ntls_key_file = \"/k.pem\"\n\
             tls_client_ca_file = \"/ca.pem\"\ntls_client_auth = \"required\"\n\
             [lock]\nmax_in_flight = 3\n",
            &[
                ("RAILGUARD__ADMIN__MAX_HEADERS", "12"),
                ("RAILGUARD__LOCK__IDLE_TIMEOUT_MS", "900"),
            ],
        )
        .unwrap();
        let proxy = config.proxy.listener.settings();
        assert_eq!(proxy.limits.max_connections, 7);
        assert_eq!(proxy.limits.header_read_timeout, Duration::from_millis(250));
        let tls = proxy.tls.expect("TLS on the proxy");
        assert_eq!(tls.client_auth, ClientAuth::Required);
        assert_eq!(tls.client_ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(config.admin.listener.settings().limits.max_headers, 12);
        assert_eq!(config.admin.listener.settings().tls, None);
        let lock = config.lock.listener.settings().limits;
        assert_eq!(lock.max_in_flight, 3);
        assert_eq!(lock.idle_timeout, Duration::from_millis(900));
        assert_eq!(
            parse("", &[]).unwrap().proxy.listener.settings(),
            ListenerSettings::default()
        );
    }

    #[test]
    fn unknown_and_mistyped_listener_keys_are_named() {
        let err = parse("[admin]\nmax_conections = 1\n", &[]).unwrap_err();
        assert!(err.to_string().contains("max_conections"), "{err}");
        let err = parse("[proxy]\nmax_headers = \"many\"\n", &[]).unwrap_err();
        assert_eq!(err.origin, "test.toml");
        assert!(err.to_string().contains("max_headers"), "{err}");
        let err = parse("[lock]\ntls_client_auth = \"sometimes\"\n", &[]).unwrap_err();
        assert!(err.to_string().contains("tls_client_auth"), "{err}");
        let err = parse("", &[("RAILGUARD__PROXY__MAX_IN_FLIGHT", "lots")]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.max_in_flight"));
    }

    #[test]
    fn validation_names_the_listener_key() {
        let key = |text: &str| parse(text, &[]).unwrap_err().key;
        assert_eq!(
            key("[proxy]\nmax_connections = 0\n").as_deref(),
            Some("proxy.max_connections")
        );
        assert_eq!(
            key("[lock]\nmax_header_bytes = 100\n").as_deref(),
            Some("lock.max_header_bytes")
        );
        assert_eq!(
            key("[admin]\nidle_timeout_ms = 0\n").as_deref(),
            Some("admin.idle_timeout_ms")
        );
        assert_eq!(
            key("[proxy]\ntls_cert_file = \"/c.pem\"\n").as_deref(),
            Some("proxy.tls_key_file")
        );
        assert_eq!(
            key("[lock]\ntls_client_auth = \"optional\"\n").as_deref(),
            Some("lock.tls_client_auth")
        );
        assert_eq!(
            key("[proxy]\ntls_cert_file = \"/c\"\ntls_key_file = \"/k\"\ntls_client_auth = \"required\"\n")
                .as_deref(),
            Some("proxy.tls_client_ca_file")
        );
        let err = parse("", &[("RAILGUARD__ADMIN__MAX_HEADERS", "0")]).unwrap_err();
        assert_eq!(
            err.origin,
            "environment variable RAILGUARD__ADMIN__MAX_HEADERS"
        );
        assert_eq!(err.key.as_deref(), Some("admin.max_headers"));
    }
}
