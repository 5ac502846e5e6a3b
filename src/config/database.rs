//! `[database]`: where the marks, the grants and the idempotency records live.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::values::millis;
use super::{DatabaseUrl, Invalid, nonzero, positive};

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
    /// `fencing.batch_concurrency` each, and room for stalled statements (`store::batch::slots`).
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
    pub(super) fn validate(&self) -> Result<(), Invalid> {
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

#[cfg(test)]
mod tests {

    use crate::config::load::parse_for_test as parse;

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
}
