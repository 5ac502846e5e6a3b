//! Configuration: one TOML file, overridable key by key from the environment.
//!
//! Parsing is separate from reading: [`Config::parse`] takes the file's text, the file's name
//! (for error messages) and the environment as a map, so tests never touch the real process
//! environment. Every error names the key and where its value came from — the file, or the
//! `RAILGUARD__SECTION__KEY` variable that overrode it — because a deployer reading a
//! start-up failure should not have to guess which of the two was wrong.
//!
//! Environment values are typed by the key they override: a key whose default is an integer
//! takes an integer, a boolean takes `true`/`false`, a string takes the text as it is. An
//! override for a key that does not exist is an error, like an unknown key in the file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Prefix of environment variables that override config keys: `RAILGUARD__PROXY__LISTEN`.
pub const ENV_PREFIX: &str = "RAILGUARD__";

/// The whole configuration of one railguard process.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub proxy: ProxyConfig,
    pub admin: AdminConfig,
    pub database: DatabaseConfig,
    pub fencing: FencingConfig,
    pub log: LogConfig,
    pub shutdown: ShutdownConfig,
    pub lock: LockConfig,
    pub idempotency: IdempotencyConfig,
    pub etcd: EtcdConfig,
}

/// `[etcd]`: the etcd lock backend (`lock.backend = "etcd"`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdConfig {
    /// Client URLs of the cluster's members. From the environment: a comma-separated list.
    pub endpoints: Vec<String>,
    /// Deadline for connecting to an endpoint.
    pub dial_timeout_ms: u64,
    /// Deadline for one request.
    pub request_timeout_ms: u64,
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
            dial_timeout_ms: 2_000,
            request_timeout_ms: 2_000,
            key_prefix: "/railguard/locks/".into(),
            tls_ca_file: String::new(),
            tls_cert_file: String::new(),
            tls_key_file: String::new(),
        }
    }
}

/// `[idempotency]`: C3 §3.1 at the proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// Refuse (400) requests without an idempotency key.
    pub required: bool,
    /// How long a record is kept; a repeat after that is a new request.
    pub retention_secs: u64,
    /// Largest response body stored for replay; a larger one is replayed without its body.
    pub max_response_bytes: u64,
    /// How often expired records are removed.
    pub sweep_interval_secs: u64,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            required: false,
            retention_secs: 86_400,
            max_response_bytes: 65_536,
            sweep_interval_secs: 60,
        }
    }
}

/// `[proxy]`: the listener payment workers talk to and the rail behind it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// Address the proxy listens on (HTTP/1.1 and cleartext HTTP/2).
    pub listen: SocketAddr,
    /// Base URL of the rail, `http://host:port`. Request paths are appended to it.
    pub upstream: String,
    /// Deadline for a whole request: body, fence check and the rail's response headers.
    pub request_timeout_ms: u64,
    /// Deadline for opening a TCP connection to the rail.
    pub upstream_connect_timeout_ms: u64,
    /// Largest request body accepted; larger bodies get 413 and are never forwarded.
    pub max_body_bytes: u64,
    /// Header that carries the fencing token (C2 §2.2).
    pub token_header: String,
    /// Header that names the account the request moves money on (C2 §2.2).
    pub account_header: String,
    /// Header that carries the idempotency key (C3 §3.1); recorded, and passed through to the
    /// rail so that a rail which deduplicates by it absorbs a retry the proxy cannot judge.
    pub idempotency_header: String,
    /// Header that carries the grant's proof that the token was granted for the account's
    /// lock key (C2 §2.3).
    pub proof_header: String,
    /// Longest account id accepted, in bytes.
    pub max_account_len: u64,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            upstream: "http://127.0.0.1:9090".into(),
            request_timeout_ms: 10_000,
            upstream_connect_timeout_ms: 2_000,
            max_body_bytes: 1024 * 1024,
            token_header: "Fencing-Token".into(),
            account_header: "Fencing-Account".into(),
            idempotency_header: "Idempotency-Key".into(),
            proof_header: "Fencing-Proof".into(),
            max_account_len: 128,
        }
    }
}

/// `[lock]`: the lock service's HTTP API.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LockConfig {
    /// Address of the lock API.
    pub listen: SocketAddr,
    /// Where grants and tokens live: `postgres` (the `[database]` above).
    pub backend: String,
    /// Largest lease a caller may ask for.
    pub max_ttl_ms: u64,
    /// Longest a blocking acquire may wait.
    pub max_wait_ms: u64,
    /// Acquirers that may wait at once in this process; more are refused with 429.
    pub max_waiters: u64,
    /// Longest sleep between attempts of a waiter, should a release notification be lost.
    pub poll_interval_ms: u64,
}

impl Default for LockConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            backend: "postgres".into(),
            max_ttl_ms: 3_600_000,
            max_wait_ms: 300_000,
            max_waiters: 10_000,
            poll_interval_ms: 500,
        }
    }
}

/// `[admin]`: metrics and health, on their own listener so scrapes never queue behind traffic.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9100)),
        }
    }
}

/// `[database]`: where the high-water marks live.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `embedded` to run a private PostgreSQL from the installed server binaries, or a
    /// `postgres://` URL.
    pub url: String,
    /// Data directory of the embedded PostgreSQL (ignored for a URL).
    pub data_dir: PathBuf,
    /// Connections in the pool.
    pub pool_size: u64,
    /// Deadline for opening a connection, and for a fence compare-and-set.
    pub timeout_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "embedded".into(),
            data_dir: PathBuf::from("/var/tmp/railguard/pg"),
            pool_size: 16,
            timeout_ms: 2_000,
        }
    }
}

/// `[fencing]`: the compare-and-set at the proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FencingConfig {
    /// Kill switch (C5 §5.2). `false` forwards stale requests too and only counts them;
    /// it exists to demonstrate the corruption on purpose.
    pub enforce: bool,
    /// Accounts whose last-known mark is kept in memory to reject stale tokens early.
    pub cache_capacity: u64,
    /// Most compare-and-sets grouped into one statement and one commit.
    pub batch_max: u64,
    /// Fence statements in flight at once (at most `database.pool_size`).
    pub batch_concurrency: u64,
    /// Refuse (400) a token without a grant proof. `false` is a migration switch for workers
    /// that cannot send the proof yet: it logs a loud error at start, exports
    /// `railguard_fencing_proof_required 0`, and counts unproven tokens; a proof that is sent
    /// and wrong is still refused.
    pub require_proof: bool,
    /// The lock key whose grants fence an account: `{account}` is replaced by the account id.
    pub lock_key_template: String,
}

impl Default for FencingConfig {
    fn default() -> Self {
        Self {
            enforce: true,
            cache_capacity: 100_000,
            batch_max: 512,
            batch_concurrency: 4,
            require_proof: true,
            lock_key_template: "{account}".into(),
        }
    }
}

/// `[log]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `pretty` or `json`.
    pub format: LogFormat,
    /// A tracing filter such as `info` or `railguard=debug,info`; `RUST_LOG` wins if set.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

/// `[shutdown]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// How long in-flight requests may take to finish after SIGTERM/SIGINT.
    pub grace_ms: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self { grace_ms: 10_000 }
    }
}

/// Where the database lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseLocation {
    Embedded { data_dir: PathBuf },
    Url(String),
}

impl Config {
    pub fn database_location(&self) -> DatabaseLocation {
        if self.database.url == "embedded" {
            DatabaseLocation::Embedded {
                data_dir: self.database.data_dir.clone(),
            }
        } else {
            DatabaseLocation::Url(self.database.url.clone())
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.proxy.request_timeout_ms)
    }

    pub fn database_timeout(&self) -> Duration {
        Duration::from_millis(self.database.timeout_ms)
    }

    /// Reads and parses `path`, applying overrides from the process environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: path.display().to_string(),
            key: None,
            message: format!("cannot read the file: {e}"),
        })?;
        // Variables that are not UTF-8 cannot be ours unless their name says so; those that
        // claim to be ours must be readable.
        let mut env = BTreeMap::new();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str() else { continue };
            if !name.starts_with(ENV_PREFIX) {
                continue;
            }
            let value = value.into_string().map_err(|_| ConfigError {
                origin: format!("environment variable {name}"),
                key: None,
                message: "value is not valid UTF-8".into(),
            })?;
            env.insert(name.to_string(), value);
        }
        Config::parse(&text, &path.display().to_string(), &env)
    }

    /// Parses `text` (named `file` in errors), then applies every `RAILGUARD__SECTION__KEY`
    /// variable of `env`, then validates.
    pub fn parse(
        text: &str,
        file: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigError> {
        let file_error = |key: Option<String>, message: String| ConfigError {
            origin: file.to_string(),
            key,
            message,
        };
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| file_error(None, e.to_string()))?;

        let overridden = apply_env(&mut table, env)?;

        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let key = e.path().to_string();
                let message = e.inner().to_string();
                match overridden.get(&key) {
                    Some(var) => ConfigError {
                        origin: var.clone(),
                        key: Some(key),
                        message,
                    },
                    None => file_error((key != ".").then_some(key), message),
                }
            })?;

        config
            .validate()
            .map_err(|(key, message)| match overridden.get(key) {
                Some(var) => ConfigError {
                    origin: var.clone(),
                    key: Some(key.into()),
                    message,
                },
                None => file_error(Some(key.into()), message),
            })?;
        Ok(config)
    }

    /// Checks what types alone cannot: returns the offending key and why.
    fn validate(&self) -> Result<(), (&'static str, String)> {
        let upstream: http::Uri = self
            .proxy
            .upstream
            .parse()
            .map_err(|e| ("proxy.upstream", format!("not a URL: {e}")))?;
        if upstream.scheme_str() != Some("http") || upstream.authority().is_none() {
            return Err((
                "proxy.upstream",
                "must be an http://host:port URL (TLS to the rail is terminated elsewhere)".into(),
            ));
        }
        if upstream.path_and_query().is_some_and(|p| p.as_str() != "/") {
            return Err(("proxy.upstream", "must not have a path or query".into()));
        }
        for (key, value) in [
            ("proxy.request_timeout_ms", self.proxy.request_timeout_ms),
            (
                "proxy.upstream_connect_timeout_ms",
                self.proxy.upstream_connect_timeout_ms,
            ),
            ("proxy.max_body_bytes", self.proxy.max_body_bytes),
            ("proxy.max_account_len", self.proxy.max_account_len),
            ("database.pool_size", self.database.pool_size),
            ("database.timeout_ms", self.database.timeout_ms),
            ("fencing.cache_capacity", self.fencing.cache_capacity),
            ("lock.max_ttl_ms", self.lock.max_ttl_ms),
            ("fencing.batch_max", self.fencing.batch_max),
            ("fencing.batch_concurrency", self.fencing.batch_concurrency),
            (
                "idempotency.retention_secs",
                self.idempotency.retention_secs,
            ),
            (
                "idempotency.sweep_interval_secs",
                self.idempotency.sweep_interval_secs,
            ),
            ("lock.max_waiters", self.lock.max_waiters),
            ("lock.poll_interval_ms", self.lock.poll_interval_ms),
        ] {
            if value == 0 {
                return Err((key, "must be greater than zero".into()));
            }
        }
        for (key, value) in [
            ("proxy.token_header", &self.proxy.token_header),
            ("proxy.account_header", &self.proxy.account_header),
            ("proxy.idempotency_header", &self.proxy.idempotency_header),
            ("proxy.proof_header", &self.proxy.proof_header),
        ] {
            http::HeaderName::from_bytes(value.as_bytes())
                .map_err(|_| (key, format!("{value:?} is not a valid HTTP header name")))?;
        }
        if self
            .proxy
            .token_header
            .eq_ignore_ascii_case(&self.proxy.account_header)
        {
            return Err((
                "proxy.account_header",
                "must differ from proxy.token_header".into(),
            ));
        }
        if self.fencing.batch_concurrency > self.database.pool_size {
            return Err((
                "fencing.batch_concurrency",
                "must be at most database.pool_size".into(),
            ));
        }
        if self.fencing.batch_max > 10_000 {
            return Err(("fencing.batch_max", "must be at most 10000".into()));
        }
        if self.idempotency.max_response_bytes > 16 * 1024 * 1024 {
            return Err((
                "idempotency.max_response_bytes",
                "must be at most 16 MiB".into(),
            ));
        }
        if [&self.proxy.token_header, &self.proxy.account_header]
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&self.proxy.idempotency_header))
        {
            return Err((
                "proxy.idempotency_header",
                "must differ from the token and account headers".into(),
            ));
        }
        if [
            &self.proxy.token_header,
            &self.proxy.account_header,
            &self.proxy.idempotency_header,
        ]
        .iter()
        .any(|h| h.eq_ignore_ascii_case(&self.proxy.proof_header))
        {
            return Err((
                "proxy.proof_header",
                "must differ from the token, account and idempotency headers".into(),
            ));
        }
        if self.fencing.lock_key_template.matches("{account}").count() != 1 {
            return Err((
                "fencing.lock_key_template",
                "must contain `{account}` exactly once".into(),
            ));
        }
        let sample = self.fencing.lock_key_template.replace("{account}", "a");
        crate::lock::LockKey::parse(&sample).map_err(|e| {
            (
                "fencing.lock_key_template",
                format!("does not make a valid lock key: {e}"),
            )
        })?;
        if self.database.pool_size > 1024 {
            return Err(("database.pool_size", "must be at most 1024".into()));
        }
        if self.database.url != "embedded"
            && !(self.database.url.starts_with("postgres://")
                || self.database.url.starts_with("postgresql://"))
        {
            return Err((
                "database.url",
                "must be \"embedded\" or a postgres:// URL".into(),
            ));
        }
        if self.database.url == "embedded" && self.database.data_dir.as_os_str().is_empty() {
            return Err((
                "database.data_dir",
                "must be set when database.url is \"embedded\"".into(),
            ));
        }
        tracing_subscriber::EnvFilter::try_new(&self.log.level).map_err(|e| {
            (
                "log.level",
                format!("{:?} is not a tracing filter: {e}", self.log.level),
            )
        })?;
        if !["postgres", "etcd"].contains(&self.lock.backend.as_str()) {
            return Err((
                "lock.backend",
                format!(
                    "{:?} is not a backend; use \"postgres\" or \"etcd\"",
                    self.lock.backend
                ),
            ));
        }
        if !(10..=86_400_000).contains(&self.lock.max_ttl_ms) {
            return Err((
                "lock.max_ttl_ms",
                "must be between 10 ms and one day".into(),
            ));
        }
        if self.lock.backend == "etcd" {
            if self.etcd.endpoints.is_empty() {
                return Err(("etcd.endpoints", "needs at least one endpoint".into()));
            }
            for endpoint in &self.etcd.endpoints {
                let uri: http::Uri = endpoint
                    .parse()
                    .map_err(|e| ("etcd.endpoints", format!("{endpoint:?} is not a URL: {e}")))?;
                match uri.scheme_str() {
                    Some("http") => {}
                    Some("https") if !self.etcd.tls_ca_file.is_empty() => {}
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
            if self.etcd.tls_cert_file.is_empty() != self.etcd.tls_key_file.is_empty() {
                return Err((
                    "etcd.tls_key_file",
                    "tls_cert_file and tls_key_file go together".into(),
                ));
            }
            if self.etcd.dial_timeout_ms == 0 || self.etcd.request_timeout_ms == 0 {
                return Err((
                    "etcd.request_timeout_ms",
                    "timeouts must be greater than zero".into(),
                ));
            }
            if !self.etcd.key_prefix.starts_with('/') || !self.etcd.key_prefix.ends_with('/') {
                return Err(("etcd.key_prefix", "must start and end with /".into()));
            }
            let tls = !self.etcd.tls_ca_file.is_empty() || !self.etcd.tls_cert_file.is_empty();
            if tls && self.etcd.endpoints.iter().any(|e| e.starts_with("http://")) {
                return Err((
                    "etcd.endpoints",
                    "TLS files are set: every endpoint must be https://".into(),
                ));
            }
        }
        let listeners = [
            ("proxy.listen", self.proxy.listen),
            ("admin.listen", self.admin.listen),
            ("lock.listen", self.lock.listen),
        ];
        for (i, (key, addr)) in listeners.iter().enumerate() {
            if addr.port() != 0 && listeners[..i].iter().any(|(_, other)| other == addr) {
                return Err((key, format!("{addr} is already used by another listener")));
            }
        }
        Ok(())
    }
}

/// Applies `RAILGUARD__SECTION__KEY` overrides to `table`, typed by the default value of the
/// key. Returns, for every overridden key (`section.key`), the variable that set it.
fn apply_env(
    table: &mut toml::Table,
    env: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
    let mut overridden = BTreeMap::new();
    for (var, raw) in env {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let env_error = |key: Option<String>, message: String| ConfigError {
            origin: format!("environment variable {var}"),
            key,
            message,
        };
        let mut parts = rest.split("__");
        let (Some(section), Some(key), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(env_error(None, "expected RAILGUARD__SECTION__KEY".into()));
        };
        let (section, key) = (section.to_ascii_lowercase(), key.to_ascii_lowercase());
        let dotted = format!("{section}.{key}");
        let Some(default) = defaults.get(&section).and_then(|s| s.get(&key)) else {
            return Err(env_error(Some(dotted), "unknown key".into()));
        };
        let value = match default {
            toml::Value::Integer(_) => raw
                .trim()
                .parse::<i64>()
                .map(toml::Value::Integer)
                .map_err(|_| {
                    env_error(Some(dotted.clone()), format!("{raw:?} is not an integer"))
                })?,
            toml::Value::Boolean(_) => match raw.trim() {
                "true" => toml::Value::Boolean(true),
                "false" => toml::Value::Boolean(false),
                _ => {
                    return Err(env_error(
                        Some(dotted),
                        format!("{raw:?} is not a boolean (true or false)"),
                    ));
                }
            },
            toml::Value::Array(_) => toml::Value::Array(
                raw.split(',')
                    .map(|s| toml::Value::String(s.trim().to_string()))
                    .collect(),
            ),
            _ => toml::Value::String(raw.clone()),
        };
        let section_table = table
            .entry(section.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(section_table) = section_table else {
            return Err(env_error(
                Some(section),
                "the file's value here is not a table".into(),
            ));
        };
        section_table.insert(key, value);
        overridden.insert(dotted, format!("environment variable {var}"));
    }
    Ok(overridden)
}

/// A configuration problem, with the key and where its value came from.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{origin}: {}{message}", key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
pub struct ConfigError {
    /// The file, or the environment variable, that supplied the bad value.
    pub origin: String,
    /// Dotted key (`proxy.listen`), when the problem is one key.
    pub key: Option<String>,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::parse(text, "test.toml", &env)
    }

    #[test]
    fn the_shipped_example_parses_to_the_defaults_it_documents() {
        let text = include_str!("../config/railguard.toml");
        let config = parse(text, &[]).expect("config/railguard.toml parses");
        assert_eq!(
            config,
            Config::default(),
            "the example documents exactly the defaults"
        );
        assert_eq!(
            config.database_location(),
            DatabaseLocation::Embedded {
                data_dir: "/var/tmp/railguard/pg".into()
            }
        );
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(parse("", &[]).unwrap(), Config::default());
    }

    #[test]
    fn unknown_key_names_the_key_and_file() {
        let err = parse("[proxy]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n", &[]).unwrap_err();
        assert_eq!(err.origin, "test.toml");
        assert!(err.to_string().contains("lisen"), "{err}");
        assert!(err.to_string().contains("proxy"), "{err}");
    }

    #[test]
    fn unknown_section_is_rejected() {
        let err = parse("[proxi]\nlisten = 1\n", &[]).unwrap_err();
        assert!(err.to_string().contains("proxi"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key() {
        let err = parse("[proxy]\nlisten = \"nowhere\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.listen"));
        assert!(
            err.to_string().starts_with("test.toml: key `proxy.listen`"),
            "{err}"
        );
    }

    #[test]
    fn env_overrides_file_with_typed_values() {
        let config = parse(
            "[proxy]\nlisten = \"127.0.0.1:1\"\n",
            &[
                ("RAILGUARD__PROXY__LISTEN", "127.0.0.1:8081"),
                ("RAILGUARD__FENCING__ENFORCE", "false"),
                ("RAILGUARD__DATABASE__POOL_SIZE", "4"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(config.proxy.listen, "127.0.0.1:8081".parse().unwrap());
        assert!(!config.fencing.enforce);
        assert_eq!(config.database.pool_size, 4);
    }

    #[test]
    fn env_errors_name_the_variable_and_key() {
        let err = parse("", &[("RAILGUARD__DATABASE__POOL_SIZE", "many")]).unwrap_err();
        assert_eq!(
            err.origin,
            "environment variable RAILGUARD__DATABASE__POOL_SIZE"
        );
        assert_eq!(err.key.as_deref(), Some("database.pool_size"));

        let err = parse("", &[("RAILGUARD__PROXY__LISTEN", "nowhere")]).unwrap_err();
        assert_eq!(err.origin, "environment variable RAILGUARD__PROXY__LISTEN");

        let err = parse("", &[("RAILGUARD__PROXY__NOPE", "1")]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.nope"));
        assert!(err.message.contains("unknown key"));

        let err = parse("", &[("RAILGUARD__FENCING__ENFORCE", "yes")]).unwrap_err();
        assert!(err.message.contains("boolean"));
    }

    #[test]
    fn validation_names_the_key() {
        let err = parse("[proxy]\nupstream = \"https://rail:443\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.upstream"));
        let err = parse("[database]\npool_size = 0\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("database.pool_size"));
        let err = parse("[database]\nurl = \"mysql://x\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("database.url"));
        let err = parse("[proxy]\ntoken_header = \"bad header\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.token_header"));
        let err = parse("[fencing]\nlock_key_template = \"acct\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("fencing.lock_key_template"));
        let err = parse("[fencing]\nlock_key_template = \"a/{account}\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("fencing.lock_key_template"));
        let err = parse("[proxy]\nproof_header = \"fencing-token\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.proof_header"));
        let err = parse("[log]\nformat = \"xml\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("log.format"));
    }

    #[test]
    fn negative_numbers_are_rejected_with_the_key() {
        let err = parse("[proxy]\nrequest_timeout_ms = -1\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.request_timeout_ms"));
    }

    #[test]
    fn malformed_toml_names_the_file() {
        let err = parse("[proxy\n", &[]).unwrap_err();
        assert_eq!(err.origin, "test.toml");
    }
}
