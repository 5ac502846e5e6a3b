//! Configuration: one TOML file, overridable key by key from the environment.
//!
//! Parsing is separate from reading: [`Config::parse`] takes the file's text, the file's name
//! (for error messages) and the environment as a map, and [`Config::load`] reads the file but
//! is handed the environment too — only `main` reads the process environment. Every error
//! names the key and where its value came from — the file, or the `RAILGUARD__SECTION__KEY`
//! variable that overrode it — because a deployer reading a start-up failure should not have
//! to guess which of the two was wrong.
//!
//! Values are typed when they are read (`values`): headers are `HeaderName`s, the rail a
//! parsed [`Upstream`], durations `Duration`s, the lock backend and the database location
//! enums. Each section checks what types alone cannot in its own `validate`; [`Config`] adds
//! the rules that span sections.
//!
//! Environment values are typed by the key they override: a key whose default is an integer
//! takes an integer, a boolean takes `true`/`false`, a string takes the text as it is. An
//! override for a key that does not exist is an error, like an unknown key in the file.

mod listener;
mod rail_lookup;
mod values;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use serde::{Deserialize, Serialize};

pub use listener::{
    ClientAuth, ListenerConfig, ListenerLimits, ListenerSettings, ListenerTls, MIN_HEADER_BYTES,
};
pub use rail_lookup::{LookupPath, LookupTemplate, RailLookupConfig};
pub use values::{AccountPathTemplate, DatabaseUrl, LockBackendKind, LockKeyTemplate, Upstream};
use values::{header, millis, secs};

/// Prefix of environment variables that override config keys: `RAILGUARD__PROXY__LISTEN`.
pub const ENV_PREFIX: &str = "RAILGUARD__";

/// What a section's check returns: the offending key and why.
type Invalid = (&'static str, String);

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
    pub guard: GuardConfig,
    pub auth: AuthConfig,
    pub runtime: RuntimeConfig,
    pub rail_lookup: RailLookupConfig,
}

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
            listener: ListenerConfig::default(),
        }
    }
}

impl ProxyConfig {
    fn validate(&self) -> Result<(), Invalid> {
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
    fn validate(&self) -> Result<(), Invalid> {
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
    fn validate(&self) -> Result<(), Invalid> {
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

/// `[database]`: where the high-water marks (and, for `lock.backend = "postgres"`, the
/// grants) live.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `embedded` to run a private PostgreSQL from the installed server binaries, or a
    /// `postgres://` URL.
    pub url: DatabaseUrl,
    /// Data directory of the embedded PostgreSQL (ignored for a URL).
    pub data_dir: PathBuf,
    /// Connections in the pool. The fence's last look and the idempotency completions have
    /// sessions of their own besides (`db::build_look_pool`, `db::build_completion_pool`):
    /// `fencing.batch_concurrency` each, and room for stalled statements (`db::slots`).
    pub pool_size: usize,
    /// Deadline for opening a connection, and for one statement such as a fence
    /// compare-and-set.
    #[serde(rename = "timeout_ms", with = "millis")]
    pub timeout: Duration,
    /// PEM CA certificate(s) the server's certificate must chain to, for a URL that does not
    /// name its own `sslrootcert`. The URL's `sslmode` says whether TLS is used and what is
    /// checked (libpq's meaning: `verify-full` checks the CA and the host name).
    pub tls_ca_file: String,
    /// What railguard does about replication or durability settings under which PostgreSQL
    /// can lose a commit it acknowledged (`crate::store::replication`).
    pub replication_risk: ReplicationRisk,
}

/// `database.replication_risk`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReplicationRisk {
    /// A loud warning and `railguard_db_replication_risk` 1.
    Warn,
    /// That, and the start fails, and `/readyz` fails while a risk is present.
    Refuse,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: DatabaseUrl::Embedded,
            data_dir: PathBuf::from("/var/tmp/railguard/pg"),
            pool_size: 16,
            timeout: Duration::from_secs(2),
            tls_ca_file: String::new(),
            replication_risk: ReplicationRisk::Warn,
        }
    }
}

/// The longest `database.timeout_ms` accepted.
const MAX_DATABASE_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

impl DatabaseConfig {
    fn validate(&self) -> Result<(), Invalid> {
        nonzero("database.pool_size", self.pool_size as u64)?;
        if self.pool_size > 1024 {
            return Err(("database.pool_size", "must be at most 1024".into()));
        }
        positive("database.timeout_ms", self.timeout)?;
        // Sessions get twice this as their TCP user timeout, which the kernel takes in
        // milliseconds as a 32-bit number; a day is far beyond any useful wait.
        if self.timeout > MAX_DATABASE_TIMEOUT {
            return Err((
                "database.timeout_ms",
                format!(
                    "must be at most {} (one day)",
                    MAX_DATABASE_TIMEOUT.as_millis()
                ),
            ));
        }
        if let DatabaseUrl::Postgres(url) = &self.url
            && let Some(options) = crate::tls::postgres::options_in(url)
        {
            return Err((
                "database.url",
                format!(
                    "must not set options ({options:?}): railguard sets its sessions' options \
                     itself (statement_timeout, lock_timeout and more) and would replace them; \
                     set server settings on the role or the database instead \
                     (ALTER ROLE … SET …)"
                ),
            ));
        }
        if self.url == DatabaseUrl::Embedded && self.data_dir.as_os_str().is_empty() {
            return Err((
                "database.data_dir",
                "must be set when database.url is \"embedded\"".into(),
            ));
        }
        Ok(())
    }
}

/// `[fencing]`: the compare-and-set at the proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FencingConfig {
    /// Kill switch (C5 §5.2). `false` forwards stale requests too and only counts them;
    /// it exists to demonstrate the corruption on purpose.
    pub enforce: bool,
    /// Accounts whose last-known mark is kept in memory to reject stale tokens early (rounded
    /// up to a multiple of 64).
    pub cache_capacity: u64,
    /// Most compare-and-sets grouped into one statement and one commit (and most
    /// idempotency-record completions, grouped the same way).
    pub batch_max: usize,
    /// Fence statements in flight at once (at most `database.pool_size`); completion
    /// statements and last looks too, each separately. Fewer make larger batches, which cost
    /// PostgreSQL less per request (docs/performance.md). A statement that has not answered
    /// within a tenth of `database.timeout_ms` stops counting here (`db::slots`).
    pub batch_concurrency: usize,
    /// Refuse (400) a token without a grant proof. `false` is a migration switch for workers
    /// that cannot send the proof yet: it logs a loud error at start, exports
    /// `railguard_fencing_proof_required 0`, and counts unproven tokens; a proof that is sent
    /// and wrong is still refused.
    pub require_proof: bool,
    /// The lock key whose grants fence an account: `{account}` is replaced by the account id.
    pub lock_key_template: LockKeyTemplate,
    /// Where the rail's request path names the account (`/accounts/{account}/`): a request
    /// whose path does not name its `Fencing-Account` is refused (403). `""`: not checked.
    #[serde(with = "values::account_path")]
    pub account_in_path: Option<AccountPathTemplate>,
    /// Whether a forward another railguard process may still have on its way to the rail holds
    /// back this process's newer tokens for the account (`proxy::fence::handover`). `false`
    /// exists only to show, in the fault harness, what goes wrong without it: it is logged
    /// loudly and `railguard_cross_process_order` is 0.
    pub order_across_processes: bool,
}

impl Default for FencingConfig {
    fn default() -> Self {
        Self {
            enforce: true,
            cache_capacity: 100_000,
            batch_max: 512,
            batch_concurrency: 1,
            require_proof: true,
            lock_key_template: LockKeyTemplate::default(),
            account_in_path: None,
            order_across_processes: true,
        }
    }
}

impl FencingConfig {
    fn validate(&self) -> Result<(), Invalid> {
        nonzero("fencing.cache_capacity", self.cache_capacity)?;
        nonzero("fencing.batch_max", self.batch_max as u64)?;
        if self.batch_max > 10_000 {
            return Err(("fencing.batch_max", "must be at most 10000".into()));
        }
        nonzero("fencing.batch_concurrency", self.batch_concurrency as u64)
    }
}

/// `[idempotency]`: C3 §3.1 at the proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// Refuse (400) requests without an idempotency key.
    pub required: bool,
    /// How long a record is kept; a repeat after that is a new request.
    #[serde(rename = "retention_secs", with = "secs")]
    pub retention: Duration,
    /// Largest response body stored for replay; a larger one is replayed without its body.
    pub max_response_bytes: usize,
    /// How often expired records are removed.
    #[serde(rename = "sweep_interval_secs", with = "secs")]
    pub sweep_interval: Duration,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            required: false,
            retention: Duration::from_secs(86_400),
            max_response_bytes: 65_536,
            sweep_interval: Duration::from_secs(60),
        }
    }
}

impl IdempotencyConfig {
    fn validate(&self) -> Result<(), Invalid> {
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

impl LogConfig {
    fn validate(&self) -> Result<(), Invalid> {
        tracing_subscriber::EnvFilter::try_new(&self.level)
            .map(|_| ())
            .map_err(|e| {
                (
                    "log.level",
                    format!("{:?} is not a tracing filter: {e}", self.level),
                )
            })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

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
    fn validate(&self) -> Result<(), Invalid> {
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

    fn validate(&self) -> Result<(), Invalid> {
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

/// `[shutdown]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// How long in-flight requests may take to finish after SIGTERM/SIGINT.
    #[serde(rename = "grace_ms", with = "millis")]
    pub grace: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(10),
        }
    }
}

/// `[runtime]`: the threads `railguard serve` runs its tasks on.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Worker threads of the async runtime; 0 is one per CPU (as the process may use them:
    /// `available_parallelism`, which honours CPU affinity and cgroup quotas; tokio's
    /// `TOKIO_WORKER_THREADS` is not read). Every task (connections, the
    /// fence's batches, the database and rail clients) runs on these; a task woken from another
    /// thread costs a wake-up across threads, which is why fewer threads can cost less CPU per
    /// request when railguard shares its cores (docs/performance.md).
    pub worker_threads: usize,
}

impl RuntimeConfig {
    /// Most worker threads a configuration may ask for.
    pub const MAX_WORKER_THREADS: usize = 256;

    fn validate(&self) -> Result<(), Invalid> {
        if self.worker_threads > Self::MAX_WORKER_THREADS {
            return Err((
                "runtime.worker_threads",
                format!(
                    "must be at most {} (0 is one per CPU)",
                    Self::MAX_WORKER_THREADS
                ),
            ));
        }
        Ok(())
    }
}

fn nonzero(key: &'static str, value: u64) -> Result<(), Invalid> {
    if value == 0 {
        return Err((key, "must be greater than zero".into()));
    }
    Ok(())
}

fn positive(key: &'static str, value: Duration) -> Result<(), Invalid> {
    if value.is_zero() {
        return Err((key, "must be greater than zero".into()));
    }
    Ok(())
}

impl Config {
    /// Settings that are valid but probably not what was meant, as (key, why): logged at
    /// start and printed by `check-config`.
    pub fn warnings(&self) -> Vec<(&'static str, String)> {
        let mut warnings = Vec::new();
        let concurrency = self.fencing.batch_concurrency;
        let per_batcher = crate::db::slots::most_in_flight(concurrency);
        let wanted = per_batcher + 1;
        if self.database.pool_size < wanted {
            warnings.push((
                "database.pool_size",
                format!(
                    "{} leaves no room for stalled statements: the fence's compare-and-sets may \
                     hold {per_batcher} connections ({} in flight, fencing.batch_concurrency, \
                     and {} stalled), and the lock API and the readiness check need one more; \
                     with fewer, a statement stalled on its connection can leave the next \
                     waiting for one, and its requests refused. Use at least {wanted}",
                    self.database.pool_size,
                    concurrency.max(1),
                    per_batcher - concurrency.max(1),
                ),
            ));
        }
        warnings
    }

    /// The dotted keys (`proxy.upstream`, `log.level`) whose values differ between this
    /// configuration and `other`, sorted. Only names, never values: a
    /// value may be a credential (`database.url`).
    pub fn changed_keys(&self, other: &Config) -> Vec<String> {
        fn walk(
            prefix: &str,
            a: Option<&toml::Value>,
            b: Option<&toml::Value>,
            out: &mut Vec<String>,
        ) {
            match (a, b) {
                (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => {
                    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
                    keys.sort();
                    keys.dedup();
                    for key in keys {
                        let path = if prefix.is_empty() {
                            key.clone()
                        } else {
                            format!("{prefix}.{key}")
                        };
                        walk(&path, a.get(key), b.get(key), out);
                    }
                }
                (a, b) if a == b => {}
                _ => out.push(prefix.to_string()),
            }
        }
        let (a, b) = (toml::Value::try_from(self), toml::Value::try_from(other));
        match (a, b) {
            (Ok(a), Ok(b)) => {
                let mut out = Vec::new();
                walk("", Some(&a), Some(&b), &mut out);
                out
            }
            // Not expected (a parsed configuration always writes back): say what is known.
            _ if self == other => Vec::new(),
            _ => vec!["(the configuration, which cannot be compared key by key)".into()],
        }
    }

    /// Reads and parses `path`, applying the `RAILGUARD__…` overrides found in `env` (the
    /// process environment, as `main` read it).
    pub fn load(path: &Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: path.display().to_string(),
            key: None,
            message: format!("cannot read the file: {e}"),
        })?;
        Config::parse(&text, &path.display().to_string(), env)
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

    /// Each section's own checks, then the rules that span sections.
    fn validate(&self) -> Result<(), Invalid> {
        self.proxy.validate()?;
        self.proxy.listener.validate("proxy")?;
        self.admin.listener.validate("admin")?;
        self.lock.validate()?;
        self.lock.listener.validate("lock")?;
        if self.lock.backend == LockBackendKind::Etcd {
            self.etcd.validate()?;
        }
        self.database.validate()?;
        self.fencing.validate()?;
        self.idempotency.validate()?;
        self.log.validate()?;
        self.guard.validate()?;
        self.auth.validate()?;
        if self.auth.enabled() && !self.fencing.require_proof {
            return Err((
                "fencing.require_proof",
                "must be true when auth.credentials_file is set: only the grant proof ties a \
                 grant to the identity it was issued to"
                    .into(),
            ));
        }
        positive("shutdown.grace_ms", self.shutdown.grace)?;
        self.runtime.validate()?;
        self.rail_lookup.validate()?;
        if self.fencing.batch_concurrency > self.database.pool_size {
            return Err((
                "fencing.batch_concurrency",
                "must be at most database.pool_size".into(),
            ));
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

/// The `RAILGUARD__…` variables of an environment, as `main` hands them to [`Config::load`]:
/// a variable that claims to be ours must be readable text.
pub fn overrides_from(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut env = BTreeMap::new();
    for (name, value) in vars {
        // Variables that are not UTF-8 cannot be ours unless their name says so.
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
    Ok(env)
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
    fn changed_keys_names_each_changed_key_and_nothing_else() {
        let running = parse("[proxy]\nupstream = \"http://10.0.0.1:9090\"\n", &[]).unwrap();
        assert!(running.changed_keys(&running.clone()).is_empty());
        let changed = parse(
            "[proxy]\nupstream = \"http://10.0.0.2:9090\"\n[log]\nlevel = \"debug\"\n\
             [auth]\nlock_requests_per_s = 7\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            running.changed_keys(&changed),
            ["auth.lock_requests_per_s", "log.level", "proxy.upstream"]
        );
    }

    #[test]
    fn a_pool_without_room_for_stalled_statements_is_warned_about() {
        let config = parse("", &[]).unwrap();
        assert!(config.warnings().is_empty(), "{:?}", config.warnings());
        let small = parse("[database]\npool_size = 3\n", &[]).unwrap();
        let warnings = small.warnings();
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].0, "database.pool_size");
        assert!(warnings[0].1.contains("at least 4"), "{}", warnings[0].1);
        let just = parse("[database]\npool_size = 4\n", &[]).unwrap();
        assert!(just.warnings().is_empty(), "{:?}", just.warnings());
        let wide = parse(
            "[fencing]\nbatch_concurrency = 4\n[database]\npool_size = 8\n",
            &[],
        )
        .unwrap();
        assert!(wide.warnings()[0].1.contains("at least 9"));
    }

    #[test]
    fn the_shipped_example_parses_to_the_defaults_it_documents() {
        let text = include_str!("../../config/railguard.toml");
        let config = parse(text, &[]).expect("config/railguard.toml parses");
        assert_eq!(
            config,
            Config::default(),
            "the example documents exactly the defaults"
        );
        assert_eq!(config.database.url, DatabaseUrl::Embedded);
        assert_eq!(
            config.database.data_dir,
            PathBuf::from("/var/tmp/railguard/pg")
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
    fn values_are_typed_when_read() {
        let config = parse(
            "[proxy]\ntoken_header = \"X-Token\"\nrequest_timeout_ms = 1500\n\
             [lock]\nbackend = \"etcd\"\n[database]\nurl = \"postgres://rg@db/rg\"\n",
            &[("RAILGUARD__IDEMPOTENCY__RETENTION_SECS", "60")],
        )
        .unwrap();
        assert_eq!(
            config.proxy.token_header,
            HeaderName::from_static("x-token")
        );
        assert_eq!(config.proxy.request_timeout, Duration::from_millis(1500));
        assert_eq!(config.lock.backend, LockBackendKind::Etcd);
        assert_eq!(
            config.database.url,
            DatabaseUrl::Postgres("postgres://rg@db/rg".into())
        );
        assert_eq!(config.idempotency.retention, Duration::from_secs(60));
        let err = parse("[lock]\nbackend = \"zookeeper\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("lock.backend"));
    }

    #[test]
    fn only_variables_that_claim_to_be_ours_must_be_text() {
        use std::os::unix::ffi::OsStringExt;
        let junk = std::ffi::OsString::from_vec(vec![0xff]);
        let env = overrides_from([
            ("PATH".into(), "/bin".into()),
            ("OTHER".into(), junk.clone()),
            ("RAILGUARD__PROXY__LISTEN".into(), "127.0.0.1:1".into()),
        ])
        .unwrap();
        assert_eq!(env.len(), 1);
        let err = overrides_from([("RAILGUARD__PROXY__LISTEN".into(), junk)]).unwrap_err();
        assert!(err.origin.contains("RAILGUARD__PROXY__LISTEN"), "{err}");
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
        let err = parse("[proxy]\nupstream = \"ftp://rail:443\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.upstream"));
        let err = parse("[proxy]\nupstream = \"https://rail:443\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.upstream_ca_file"));
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
        let err = parse("[runtime]\nworker_threads = 100000\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("runtime.worker_threads"));
        let err = parse("[runtime]\nworker_threads = -1\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("runtime.worker_threads"));
        let err = parse("", &[("RAILGUARD__RUNTIME__WORKER_THREADS", "two")]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("runtime.worker_threads"));
        let config = parse("[runtime]\nworker_threads = 1\n", &[]).unwrap();
        assert_eq!(config.runtime.worker_threads, 1);
    }

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

    #[test]
    fn a_database_timeout_past_a_day_is_refused_with_the_key() {
        let err = parse("[database]\ntimeout_ms = 1073741824\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("database.timeout_ms"));
        assert_eq!(err.origin, "test.toml");
        parse("[database]\ntimeout_ms = 86400000\n", &[]).unwrap();
    }

    #[test]
    fn options_in_the_database_url_are_refused_not_replaced() {
        for url in [
            "postgres://u@127.0.0.1/db?options=-c%20search_path%3Dx",
            "postgresql://u@127.0.0.1/db?sslmode=disable&options=-csearch_path%3Dx",
        ] {
            let text = format!("[database]\nurl = {url:?}\n");
            let err = parse(&text, &[]).unwrap_err();
            assert_eq!(err.key.as_deref(), Some("database.url"), "{url}");
            assert!(err.to_string().contains("search_path"), "{err}");
        }
        parse(
            "[database]\nurl = \"postgres://u@127.0.0.1/db?sslmode=disable\"\n",
            &[],
        )
        .unwrap();
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

/// Properties of the loader over generated files and environments (the fuzz target
/// `config_loader` checks the same on arbitrary text).
#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    /// Some keys of every type, with values the loader must accept.
    #[derive(Debug, Clone)]
    struct Values {
        listen_port: u16,
        max_body_bytes: u64,
        request_timeout_ms: u64,
        token_header: String,
        backend: &'static str,
        enforce: bool,
        pool_size: u64,
        retention_secs: u64,
        level: &'static str,
    }

    fn values() -> impl Strategy<Value = Values> {
        (
            (1..=u16::MAX, 1..=i64::MAX as u64, 1..=i64::MAX as u64),
            "x-[a-z0-9-]{1,20}",
            prop::sample::select(vec!["postgres", "etcd"]),
            (any::<bool>(), 4..=1024u64, 1..=i64::MAX as u64),
            prop::sample::select(vec!["info", "warn", "railguard=debug,info", "off"]),
        )
            .prop_map(
                |(
                    (listen_port, max_body_bytes, request_timeout_ms),
                    token_header,
                    backend,
                    b,
                    level,
                )| {
                    Values {
                        listen_port,
                        max_body_bytes,
                        request_timeout_ms,
                        token_header,
                        backend,
                        enforce: b.0,
                        pool_size: b.1,
                        retention_secs: b.2,
                        level,
                    }
                },
            )
    }

    /// Each value as (section, key, TOML text, environment text).
    fn entries(v: &Values) -> Vec<(&'static str, &'static str, String, String)> {
        let listen = format!("127.0.0.2:{}", v.listen_port);
        vec![
            ("proxy", "listen", format!("{listen:?}"), listen),
            (
                "proxy",
                "max_body_bytes",
                v.max_body_bytes.to_string(),
                v.max_body_bytes.to_string(),
            ),
            (
                "proxy",
                "request_timeout_ms",
                v.request_timeout_ms.to_string(),
                v.request_timeout_ms.to_string(),
            ),
            (
                "proxy",
                "token_header",
                format!("{:?}", v.token_header),
                v.token_header.clone(),
            ),
            (
                "lock",
                "backend",
                format!("{:?}", v.backend),
                v.backend.to_string(),
            ),
            (
                "fencing",
                "enforce",
                v.enforce.to_string(),
                v.enforce.to_string(),
            ),
            (
                "database",
                "pool_size",
                v.pool_size.to_string(),
                v.pool_size.to_string(),
            ),
            (
                "idempotency",
                "retention_secs",
                v.retention_secs.to_string(),
                v.retention_secs.to_string(),
            ),
            (
                "log",
                "level",
                format!("{:?}", v.level),
                v.level.to_string(),
            ),
        ]
    }

    /// The file and environment that set `v`, each entry from the file or the environment
    /// as `from_env` says.
    fn sources(v: &Values, from_env: &[bool]) -> (String, BTreeMap<String, String>) {
        let mut sections: BTreeMap<&str, String> = BTreeMap::new();
        let mut env = BTreeMap::new();
        for ((section, key, toml, raw), env_wins) in entries(v).into_iter().zip(from_env) {
            if *env_wins {
                let var = format!(
                    "{ENV_PREFIX}{}__{}",
                    section.to_uppercase(),
                    key.to_uppercase()
                );
                env.insert(var, raw);
            } else {
                sections
                    .entry(section)
                    .or_default()
                    .push_str(&format!("{key} = {toml}\n"));
            }
        }
        let text = sections
            .iter()
            .map(|(s, body)| format!("[{s}]\n{body}"))
            .collect();
        (text, env)
    }

    fn known(section: &str, key: &str) -> bool {
        let defaults = toml::Table::try_from(Config::default()).unwrap();
        defaults.get(section).and_then(|s| s.get(key)).is_some()
    }

    fn section() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "proxy",
            "admin",
            "database",
            "fencing",
            "log",
            "shutdown",
            "lock",
            "idempotency",
            "etcd",
            "guard",
        ])
    }

    proptest! {
        #[test]
        fn a_generated_valid_config_parses_to_the_generated_values(
            v in values(),
            from_env in prop::collection::vec(any::<bool>(), 9),
        ) {
            let (text, env) = sources(&v, &from_env);
            let config = Config::parse(&text, "gen.toml", &env)
                .map_err(|e| TestCaseError::fail(format!("{e}\n{text}{env:?}")))?;
            prop_assert_eq!(config.proxy.listen, SocketAddr::from(([127, 0, 0, 2], v.listen_port)));
            prop_assert_eq!(config.proxy.max_body_bytes, v.max_body_bytes);
            prop_assert_eq!(config.proxy.request_timeout, Duration::from_millis(v.request_timeout_ms));
            prop_assert_eq!(config.proxy.token_header.as_str(), v.token_header.as_str());
            prop_assert_eq!(config.lock.backend.name(), v.backend);
            prop_assert_eq!(config.fencing.enforce, v.enforce);
            prop_assert_eq!(config.database.pool_size as u64, v.pool_size);
            prop_assert_eq!(config.idempotency.retention, Duration::from_secs(v.retention_secs));
            prop_assert_eq!(config.log.level.as_str(), v.level);
            // What was not set keeps its default.
            prop_assert_eq!(&config.admin, &AdminConfig::default());
            // And the config writes back to a file that reads the same.
            let written = toml::to_string(&config).unwrap();
            prop_assert_eq!(Config::parse(&written, "w.toml", &BTreeMap::new()), Ok(config));
        }

        #[test]
        fn an_unknown_key_in_the_file_is_an_error_naming_the_key_and_the_file(
            section in section(),
            key in "[a-z][a-z_]{0,15}",
        ) {
            prop_assume!(!known(section, &key));
            let text = format!("[{section}]\n{key} = 1\n");
            let error = Config::parse(&text, "deploy/rg.toml", &BTreeMap::new()).unwrap_err();
            let (shown, named) = (error.to_string(), format!("`{key}`"));
            prop_assert_eq!(error.origin.as_str(), "deploy/rg.toml");
            prop_assert!(shown.contains(&named), "{}", shown);
            prop_assert!(shown.contains(section), "{}", shown);
        }

        #[test]
        fn an_unknown_key_in_the_environment_is_an_error_naming_the_key_and_the_variable(
            section in section(),
            key in "[a-z][a-z_]{0,15}".prop_filter("one key", |k| !k.contains("__")),
        ) {
            prop_assume!(!known(section, &key));
            let var = format!("{ENV_PREFIX}{}__{}", section.to_uppercase(), key.to_uppercase());
            let env = BTreeMap::from([(var.clone(), "1".to_string())]);
            let error = Config::parse("", "rg.toml", &env).unwrap_err();
            prop_assert_eq!(error.origin, format!("environment variable {var}"));
            prop_assert_eq!(error.key, Some(format!("{section}.{key}")));
        }

        #[test]
        fn an_integer_key_refuses_any_text_that_is_not_an_integer(
            raw in "[^0-9]{1,10}".prop_filter("not an integer", |r| r.trim().parse::<i64>().is_err()),
        ) {
            let env = BTreeMap::from([(format!("{ENV_PREFIX}PROXY__MAX_BODY_BYTES"), raw)]);
            let error = Config::parse("", "rg.toml", &env).unwrap_err();
            prop_assert_eq!(error.key.as_deref(), Some("proxy.max_body_bytes"));
        }
    }
}
