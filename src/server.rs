//! `railguard serve`: wires configuration into running listeners and takes them down again.
//!
//! Start-up order: bind both listeners (an address in use fails before anything else is
//! touched), open the database (start the embedded server, migrate, pool), then serve. On
//! shutdown: stop accepting, drain in-flight requests within `shutdown.grace_ms`, and only then
//! stop the embedded PostgreSQL, so no request loses its database mid-flight.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::admin::Admin;
use crate::config::Config;
use crate::db::{Database, DatabaseError};
use crate::http::serve;
use crate::lock::AnyBackend;
use crate::lock::api::LockApi;
use crate::lock::etcd::{EtcdLocks, EtcdSettings};
use crate::lock::postgres::{PgLocks, listen_for_releases};
use crate::lock::service::{LockLimits, LockService};
use crate::metrics::Metrics;
use crate::proof::ProofKey;
use crate::proxy::extract::{ExtractConfig, GrantCheck};
use crate::proxy::fence::{Batching, HighWaterStore};
use crate::proxy::fence::{FenceLayer, FencePoint};
use crate::proxy::forward::{Forward, Upstream};
use crate::proxy::idempotency::{IdempotencyConfig as IdempotencyLayerConfig, IdempotencyLayer};
use crate::proxy::idempotency::{
    IdempotencyStore, InstanceId, OutcomeMetrics, Records, hold_instance_lock, sweep_forever,
};
use crate::proxy::{self, ClientAddr};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr} (key `{key}`): {source}")]
    Bind {
        key: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Database(#[from] DatabaseError),
    #[error("proxy.upstream: {0}")]
    Upstream(String),
    #[error("cannot take this process's instance lock in PostgreSQL")]
    Instance,
    #[error("cannot read or create the grant proof key in PostgreSQL: {0}")]
    ProofKey(String),
    #[error("the embedded PostgreSQL exited unexpectedly ({0}); see its log in the data directory")]
    EmbeddedDied(String),
}

async fn bind(key: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { key, addr, source })
}

/// Runs railguard until `shutdown` resolves, then drains and stops.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    let metrics = Arc::new(Metrics::new());
    if !config.fencing.enforce {
        tracing::error!(
            "!!! FENCING IS DISABLED (fencing.enforce = false) !!! Stale tokens WILL reach the \
             rail and payments can be duplicated. This switch exists only to demonstrate that \
             corruption. railguard_fencing_enforced is 0."
        );
    }
    let proxy_listener = bind("proxy.listen", config.proxy.listen).await?;
    let admin_listener = bind("admin.listen", config.admin.listen).await?;
    let lock_listener = bind("lock.listen", config.lock.listen).await?;
    let upstream =
        Upstream::parse(&config.proxy.upstream).map_err(|e| ServeError::Upstream(e.to_string()))?;

    let mut shutdown = std::pin::pin!(shutdown);
    let mut database = tokio::select! {
        database = Database::open(&config) => database?,
        () = &mut shutdown => {
            tracing::info!("shutdown requested during start-up");
            return Ok(());
        }
    };
    // This process owns the idempotency records it creates; its session lock says it is alive.
    let instance = InstanceId::generate();
    let (instance_held, instance_ready) = tokio::sync::oneshot::channel();
    let instance_task = tokio::spawn(hold_instance_lock(
        database.url.clone(),
        config.database_timeout(),
        instance,
        instance_held,
    ));
    tokio::select! {
        held = instance_ready => held.map_err(|_| ServeError::Instance)?,
        () = &mut shutdown => {
            tracing::info!("shutdown requested during start-up");
            instance_task.abort();
            database.shutdown().await;
            return Ok(());
        }
    }
    // Grants are signed with the key every railguard on this database shares.
    let proofs = Arc::new(
        load_proof_key(&database.pool)
            .await
            .map_err(ServeError::ProofKey)?,
    );
    if !config.fencing.require_proof {
        tracing::error!(
            "!!! GRANT PROOFS ARE NOT REQUIRED (fencing.require_proof = false) !!! A token \
             granted for any key, or never granted at all, passes the fence when sent without \
             a proof. This switch exists only for migrating workers that cannot send the proof \
             yet. railguard_fencing_proof_required is 0."
        );
    }
    metrics
        .fencing_proof_required
        .set(i64::from(config.fencing.require_proof));
    let idempotency_store = IdempotencyStore::new(
        database.pool.clone(),
        config.database_timeout(),
        OutcomeMetrics {
            pending: metrics.outcomes_pending.clone(),
            lost: metrics.outcomes_lost.clone(),
        },
    );
    let records: Arc<dyn Records> = Arc::new(idempotency_store.clone());
    let store = HighWaterStore::new(
        database.pool.clone(),
        config.database_timeout(),
        Batching {
            max_batch: config.fencing.batch_max as usize,
            concurrency: config.fencing.batch_concurrency as usize,
        },
        metrics.fence_batch_size.clone(),
        instance,
        records.clone(),
    );
    let sweeper = tokio::spawn(sweep_forever(
        idempotency_store.clone(),
        Duration::from_secs(config.idempotency.retention_secs),
        Duration::from_secs(config.idempotency.sweep_interval_secs),
    ));
    let idempotency_store_for_admin = idempotency_store.clone();
    let idempotency = IdempotencyLayer::new(
        records,
        IdempotencyLayerConfig {
            max_response_bytes: config.idempotency.max_response_bytes as usize,
        },
    );
    let fence = FenceLayer::new(Arc::new(FencePoint::new(
        store.clone(),
        config.fencing.cache_capacity,
        metrics.clone(),
        config.fencing.enforce,
    )));
    let forward = Forward::new(
        upstream,
        Duration::from_millis(config.proxy.upstream_connect_timeout_ms),
        metrics.clone(),
    );
    let extract = ExtractConfig {
        token_header: HeaderName::from_bytes(config.proxy.token_header.as_bytes())
            .expect("validated"),
        account_header: HeaderName::from_bytes(config.proxy.account_header.as_bytes())
            .expect("validated"),
        idempotency_header: HeaderName::from_bytes(config.proxy.idempotency_header.as_bytes())
            .expect("validated"),
        idempotency_required: config.idempotency.required,
        max_account_len: config.proxy.max_account_len as usize,
        max_body_bytes: config.proxy.max_body_bytes,
        request_timeout: config.request_timeout(),
        proof_header: HeaderName::from_bytes(config.proxy.proof_header.as_bytes())
            .expect("validated"),
        grants: {
            let (prefix, suffix) = config
                .fencing
                .lock_key_template
                .split_once("{account}")
                .expect("validated");
            GrantCheck {
                proofs: proofs.clone(),
                required: config.fencing.require_proof,
                lock_key_prefix: prefix.to_string(),
                lock_key_suffix: suffix.to_string(),
                unproven: metrics.unproven_tokens.clone(),
            }
        },
    };
    let stack = proxy::stack(extract, fence, idempotency, forward, metrics.clone());
    let backend_name: &'static str = if config.lock.backend == "etcd" {
        "etcd"
    } else {
        "postgres"
    };
    let lock_metrics = metrics.lock_metrics(backend_name);
    let etcd_settings = EtcdSettings {
        endpoints: config.etcd.endpoints.clone(),
        dial_timeout: Duration::from_millis(config.etcd.dial_timeout_ms),
        request_timeout: Duration::from_millis(config.etcd.request_timeout_ms),
        key_prefix: config.etcd.key_prefix.clone(),
        tls_ca_file: config.etcd.tls_ca_file.clone(),
        tls_cert_file: config.etcd.tls_cert_file.clone(),
        tls_key_file: config.etcd.tls_key_file.clone(),
    };
    let backend = match backend_name {
        "etcd" => AnyBackend::Etcd(Box::new(EtcdLocks::new(
            etcd_settings.clone(),
            Some(lock_metrics.clone()),
        ))),
        _ => AnyBackend::Postgres(PgLocks::new(
            database.pool.clone(),
            config.database_timeout(),
            lock_metrics.clone(),
        )),
    };
    let lock_service = Arc::new(LockService::new(
        backend,
        lock_metrics,
        LockLimits {
            max_ttl: Duration::from_millis(config.lock.max_ttl_ms),
            max_wait: Duration::from_millis(config.lock.max_wait_ms),
            max_waiters: config.lock.max_waiters as usize,
            poll_interval: Duration::from_millis(config.lock.poll_interval_ms),
            ..LockLimits::default()
        },
    ));
    // Releases (and, for etcd, expiries) wake this process's waiters at once.
    let queues = lock_service.queues();
    let wake = {
        let queues = queues.clone();
        move |key: &str| queues.wake(key)
    };
    let wake_all = move || queues.wake_all();
    let listener_task = match backend_name {
        "etcd" => tokio::spawn(async move {
            EtcdLocks::new(etcd_settings, None)
                .watch_releases(wake, wake_all)
                .await;
        }),
        _ => tokio::spawn(listen_for_releases(database.url.clone(), wake, wake_all)),
    };
    let lock_api = LockApi::new(lock_service, proofs);
    let admin = Admin {
        metrics,
        store,
        idempotency: idempotency_store_for_admin,
        max_account_len: config.proxy.max_account_len as usize,
    };

    let grace = Duration::from_millis(config.shutdown.grace_ms);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let proxy_task = tokio::spawn(serve(
        proxy_listener,
        move |peer| {
            let stack = stack.clone();
            hyper::service::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ClientAddr(peer));
                stack.clone().oneshot(request)
            })
        },
        stopped(stop_rx.clone()),
        grace,
    ));
    let lock_task = tokio::spawn(serve(
        lock_listener,
        move |_peer| {
            let api = lock_api.clone();
            hyper::service::service_fn(move |request| api.clone().handle(request))
        },
        stopped(stop_rx.clone()),
        grace,
    ));
    let admin_task = tokio::spawn(serve(
        admin_listener,
        move |_peer| {
            let admin = admin.clone();
            hyper::service::service_fn(move |request| admin.clone().handle(request))
        },
        stopped(stop_rx),
        grace,
    ));
    tracing::info!(proxy = %config.proxy.listen, admin = %config.admin.listen, lock = %config.lock.listen,
        upstream = %config.proxy.upstream, enforce = config.fencing.enforce, "railguard serving");

    let died = tokio::select! {
        () = &mut shutdown => None,
        status = database.embedded_exited() => Some(status),
    };
    if let Some(status) = &died {
        tracing::error!(%status, "the embedded PostgreSQL exited on its own; shutting down");
    }
    tracing::info!(?grace, "shutting down");
    let _ = stop_tx.send(true);
    let _ = proxy_task.await;
    let _ = lock_task.await;
    let _ = admin_task.await;
    listener_task.abort();
    sweeper.abort();
    instance_task.abort();
    database.shutdown().await;
    tracing::info!("railguard stopped");
    match died {
        Some(status) => Err(ServeError::EmbeddedDied(status)),
        None => Ok(()),
    }
}

async fn load_proof_key(pool: &deadpool_postgres::Pool) -> Result<ProofKey, String> {
    let client = pool.get().await.map_err(|e| e.to_string())?;
    ProofKey::load_or_create(&**client)
        .await
        .map_err(|e| e.to_string())
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not when
/// the future is first polled, so a signal during start-up is not lost. A second signal while
/// draining exits at once.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second signal: exiting without draining");
            std::process::exit(130);
        });
    }
}
