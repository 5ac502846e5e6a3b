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
//!
//! One file per section of the TOML (`proxy`, `lock`, `database`, …); `listener` holds the keys
//! every listener section shares, `load` the reading of the file and the environment, and
//! `effective` what `railguard check-config --print` shows: every key's value and where it
//! came from.

mod admin;
mod auth;
mod database;
mod effective;
mod etcd;
mod fencing;
mod guard;
mod idempotency;
mod listener;
mod load;
mod lock;
mod log;
#[cfg(test)]
mod properties;
mod proxy;
mod rail_lookup;
mod runtime;
mod shutdown;
mod values;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use admin::AdminConfig;
pub use auth::AuthConfig;
pub use database::{DatabaseConfig, ReplicationRisk};
pub use effective::{Effective, REDACTED, Source};
pub use etcd::EtcdConfig;
pub use fencing::FencingConfig;
pub use guard::GuardConfig;
pub use idempotency::IdempotencyConfig;
pub use listener::{
    ClientAuth, ListenerConfig, ListenerLimits, ListenerSettings, ListenerTls, MIN_HEADER_BYTES,
};
pub use load::{ConfigError, ENV_PREFIX, overrides_from};
pub use lock::LockConfig;
pub use log::{LogConfig, LogFormat};
pub use proxy::ProxyConfig;
pub use rail_lookup::{LookupPath, LookupTemplate, RailLookupConfig};
pub use runtime::RuntimeConfig;
pub use shutdown::ShutdownConfig;
pub use values::{AccountPathTemplate, DatabaseUrl, LockBackendKind, LockKeyTemplate, Upstream};

/// What a section's check returns: the offending key and why.
type Invalid = (&'static str, String);

/// The whole configuration of one railguard process, its sections in the order of
/// `config/railguard.toml` (`check-config --print` follows it).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub proxy: ProxyConfig,
    pub admin: AdminConfig,
    pub lock: LockConfig,
    pub etcd: EtcdConfig,
    pub database: DatabaseConfig,
    pub fencing: FencingConfig,
    pub idempotency: IdempotencyConfig,
    pub log: LogConfig,
    pub guard: GuardConfig,
    pub auth: AuthConfig,
    pub shutdown: ShutdownConfig,
    pub runtime: RuntimeConfig,
    pub rail_lookup: RailLookupConfig,
}

impl Config {
    /// Settings that are valid but probably not what was meant, as (key, why): logged at
    /// start and printed by `check-config`.
    pub fn warnings(&self) -> Vec<(&'static str, String)> {
        let mut warnings = Vec::new();
        let concurrency = self.fencing.batch_concurrency;
        let per_batcher = crate::store::batch::most_in_flight(concurrency);
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
        if self.proxy.reuse_port && self.database.url == DatabaseUrl::Embedded {
            return Err((
                "proxy.reuse_port",
                "processes sharing the proxy address must share one PostgreSQL database \
                 (database.url = \"postgres://…\"): the embedded database belongs to one \
                 process, and processes on databases of their own would each keep marks of \
                 their own"
                    .into(),
            ));
        }
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    use crate::config::load::parse_for_test as parse;

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
    fn a_shared_proxy_address_needs_a_shared_database() {
        let err = parse("[proxy]\nreuse_port = true\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.reuse_port"));
        let err = parse("", &[("RAILGUARD__PROXY__REUSE_PORT", "true")]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.reuse_port"));
        let config = parse(
            "[proxy]\nreuse_port = true\n[database]\nurl = \"postgres://rg@127.0.0.1/rg\"\n",
            &[],
        )
        .unwrap();
        assert!(config.proxy.reuse_port);
    }
}
