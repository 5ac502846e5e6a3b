//! The lock service as the configuration asks for it: which backend (`lock.backend`), its
//! limits, its metrics, and the watcher that wakes this process's waiters the moment a key is
//! released (PostgreSQL's LISTEN/NOTIFY, or an etcd watch on the key prefix). The server asks
//! for "the lock service" and never matches on the backend itself.

use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::task::JoinHandle;

use super::AnyBackend;
use super::etcd::{EtcdLocks, EtcdSettings};
use super::guard::SourceGuard;
use super::postgres::{PgLocks, listen_for_releases};
use super::service::{LockLimits, LockMetrics, LockService};
use super::source::TokenSource;
use crate::config::{EtcdConfig, GuardConfig, LockBackendKind, LockConfig, LockKeyTemplate};
use crate::store::epoch::{StoreEpoch, TokenJump};

/// A running lock service, its release watcher and its token-source guard.
pub struct Locks {
    pub service: Arc<LockService<AnyBackend>>,
    /// Checked once by the caller before serving ([`SourceGuard::check`]), then periodically.
    pub guard: Arc<SourceGuard>,
    watcher: JoinHandle<()>,
    checker: Option<JoinHandle<()>>,
}

/// What the PostgreSQL backend needs: the pool, and the URL for its LISTEN connection.
pub struct LockDatabase<'a> {
    pub pool: &'a deadpool_postgres::Pool,
    pub url: &'a str,
    pub timeout: Duration,
}

impl Locks {
    /// Builds the configured backend and starts its release watcher.
    pub fn start(
        config: &LockConfig,
        etcd: &EtcdConfig,
        guard: &GuardConfig,
        lock_key_template: &LockKeyTemplate,
        database: LockDatabase<'_>,
        registry: &Registry,
    ) -> Self {
        let metrics = LockMetrics::register(registry, config.backend.name());
        let limits = LockLimits {
            max_ttl: config.max_ttl,
            max_wait: config.max_wait,
            max_waiters: config.max_waiters,
            poll_interval: config.poll_interval,
            ..LockLimits::default()
        };
        let (backend, watch, source): (AnyBackend, Watch, TokenSource) = match config.backend {
            LockBackendKind::Postgres => (
                AnyBackend::Postgres(PgLocks::new(
                    database.pool.clone(),
                    database.timeout,
                    metrics.clone(),
                )),
                Watch::Postgres(database.url.to_string()),
                TokenSource::Postgres {
                    pool: database.pool.clone(),
                    timeout: database.timeout,
                },
            ),
            LockBackendKind::Etcd => {
                let locks = Arc::new(EtcdLocks::new(
                    EtcdSettings::from(etcd),
                    Some(metrics.clone()),
                ));
                let source = TokenSource::Etcd {
                    scratch_key: locks.scratch_key(),
                    locks: locks.clone(),
                    concurrency: guard.fast_forward_concurrency,
                };
                (AnyBackend::Etcd(locks.clone()), Watch::Etcd(locks), source)
            }
        };
        let epoch = Arc::new(StoreEpoch::new(
            token_jump(&source),
            guard.detect_store_changes,
            database.timeout,
            registry,
        ));
        let source_guard = Arc::new(
            SourceGuard::new(source, database.pool.clone(), database.timeout, registry)
                .with_lock_key_template(lock_key_template.prefix(), lock_key_template.suffix())
                .with_epoch(epoch),
        );
        let service =
            Arc::new(LockService::new(backend, metrics, limits).with_guard(source_guard.clone()));
        // Releases (and, for etcd, expiries) wake this process's waiters at once; a watcher
        // that reconnects wakes them all, since events may have been missed meanwhile.
        let queues = service.queues();
        let wake = {
            let queues = queues.clone();
            move |key: &str| queues.wake(key)
        };
        let wake_all = move || queues.wake_all();
        let watcher = match watch {
            Watch::Postgres(url) => {
                tokio::spawn(listen_for_releases(url, database.timeout, wake, wake_all))
            }
            Watch::Etcd(locks) => tokio::spawn(async move {
                locks.watch_releases(wake, wake_all).await;
            }),
        };
        Self {
            service,
            guard: source_guard,
            watcher,
            checker: None,
        }
    }

    /// Starts the periodic check of the token source, every `interval`.
    pub fn check_periodically(&mut self, interval: std::time::Duration) {
        let guard = self.guard.clone();
        self.checker = Some(tokio::spawn(async move { guard.run(interval).await }));
    }

    /// Stops the release watcher and the guard's checks (the service itself ends with its
    /// last user).
    pub fn stop(self) {
        self.watcher.abort();
        if let Some(checker) = self.checker {
            checker.abort();
        }
    }
}

impl From<&EtcdConfig> for EtcdSettings {
    fn from(etcd: &EtcdConfig) -> Self {
        EtcdSettings {
            endpoints: etcd.endpoints.clone(),
            dial_timeout: etcd.dial_timeout,
            request_timeout: etcd.request_timeout,
            key_prefix: etcd.key_prefix.clone(),
            tls_ca_file: etcd.tls_ca_file.clone(),
            tls_cert_file: etcd.tls_cert_file.clone(),
            tls_key_file: etcd.tls_key_file.clone(),
        }
    }
}

/// The token source `lock.backend` names, for tools that do not run the lock service
/// (`railguard fast-forward`).
pub fn token_source(
    config: &LockConfig,
    etcd: &EtcdConfig,
    guard: &GuardConfig,
    database: &LockDatabase<'_>,
) -> TokenSource {
    match config.backend {
        LockBackendKind::Postgres => TokenSource::Postgres {
            pool: database.pool.clone(),
            timeout: database.timeout,
        },
        LockBackendKind::Etcd => {
            let locks = Arc::new(EtcdLocks::new(EtcdSettings::from(etcd), None));
            TokenSource::Etcd {
                scratch_key: locks.scratch_key(),
                locks,
                concurrency: guard.fast_forward_concurrency,
            }
        }
    }
}

enum Watch {
    Postgres(String),
    Etcd(Arc<EtcdLocks>),
}

/// How a change of the database's server moves the lock backend's token source
/// (`store::epoch`): PostgreSQL's sequence went back with it and is set past it; etcd's revision
/// did not, and is read.
fn token_jump(source: &TokenSource) -> TokenJump {
    match source {
        TokenSource::Postgres { .. } => TokenJump::Sequence,
        etcd @ TokenSource::Etcd { .. } => {
            let etcd = etcd.clone();
            TokenJump::Revision(Arc::new(move || {
                let etcd = etcd.clone();
                Box::pin(async move { etcd.position().await.map_err(|e| e.to_string()) })
            }))
        }
    }
}
