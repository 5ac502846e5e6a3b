//! `railguard serve`: wires configuration into running listeners and takes them down again.
//!
//! The shape is mini-redis's: [`run`] takes listeners that are already bound, the validated
//! configuration, and a shutdown future. `main` binds the configured addresses
//! ([`Listeners::bind`], so an address in use fails before anything else is touched; a shared
//! proxy address, `proxy.reuse_port`, is bound then and listened on once railguard serves); tests
//! bind `127.0.0.1:0` and run the server in their own process.
//!
//! Start-up order: open the database (start the embedded server, migrate, pool), take this
//! process's instance lock, load the grant proof key, then serve. On shutdown: stop accepting,
//! drain in-flight requests within `shutdown.grace_ms`, and only then stop the embedded
//! PostgreSQL, so no request loses its database mid-flight.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tower::ServiceExt;

use crate::admin::Admin;
use crate::auth::{AuthMetrics, Authenticator, LockKeyShape};
use crate::config::Config;
use crate::config::ListenerConfig;
use crate::config::ReplicationRisk;
use crate::db::{self, Database, DatabaseError};
use crate::http::{Listener, serve};
use crate::lock::api::LockApi;
use crate::lock::guard::SourceGuard;
use crate::lock::{LockDatabase, Locks};
use crate::metrics::Metrics;
use crate::proof::ProofKey;
use crate::proxy;
use crate::proxy::extract::{ExtractConfig, ExtractLayer, GrantCheck};
use crate::proxy::fence::{FenceLayer, FencePoint};
use crate::proxy::forward::Forward;
use crate::proxy::idempotency::{IdempotencyConfig, IdempotencyLayer, Resolver};
use crate::reload::{Reload, Reloadable};
use crate::store::batch::Batching;
use crate::store::handover::Handover;
use crate::store::instance::{InstanceId, hold_instance_lock};
use crate::store::marks::{HighWaterStore, ThisProcess};
use crate::store::records::{IdempotencyStore, OutcomeMetrics, Records, sweep_forever};
use crate::store::replication::{ReplicationCheck, ReplicationError};
use crate::work::{Work, WorkTracker};

mod shutdown;

use self::shutdown::Outstanding;
pub use self::shutdown::{hangup_requests, shutdown_signal};

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
    #[error("TLS to the rail: {0}")]
    RailTls(#[from] crate::tls::client::TlsFileError),
    #[error("cannot take this process's instance lock in PostgreSQL")]
    Instance,
    #[error("cannot read or create the grant proof key in PostgreSQL: {0}")]
    ProofKey(String),
    #[error("credentials (key `auth.credentials_file`): {0}")]
    Credentials(#[from] crate::auth::CredentialsError),
    #[error("key `{key}`: {source}")]
    Tls {
        key: &'static str,
        #[source]
        source: crate::tls::server::TlsError,
    },
    #[error("the embedded PostgreSQL exited unexpectedly ({0}); see its log in the data directory")]
    EmbeddedDied(String),
    #[error("{0}")]
    Replication(String),
    #[error(
        "cannot write which forwards this railguard has on their way (table railguard_forwarder): {0}"
    )]
    Handover(crate::db::DbError),
}

/// The three listeners railguard serves on.
pub struct Listeners {
    pub proxy: ProxySocket,
    pub admin: TcpListener,
    pub lock: TcpListener,
}

/// The proxy's socket: listening from the start, or — sharing its address with other
/// processes (`proxy.reuse_port`) — bound, and listening only once railguard serves. A
/// listening socket joins the address's share at once, and the kernel hands it new
/// connections; one of a process still starting would wait for its start (its database, its
/// migrations) or be reset if the start fails, where another process would have served them.
pub enum ProxySocket {
    Listening(TcpListener),
    Shared { socket: TcpSocket, addr: SocketAddr },
}

/// A shared proxy socket's `step` failed: the error says which, beside the address and key
/// (the kind of error is kept).
fn shared_step_failed(
    key: &'static str,
    addr: SocketAddr,
    step: &str,
    source: std::io::Error,
) -> ServeError {
    ServeError::Bind {
        key,
        addr,
        source: std::io::Error::new(source.kind(), format!("{step}: {source}")),
    }
}

impl From<TcpListener> for ProxySocket {
    fn from(listener: TcpListener) -> Self {
        Self::Listening(listener)
    }
}

impl ProxySocket {
    /// The address it is bound to.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            Self::Listening(listener) => listener.local_addr(),
            Self::Shared { socket, .. } => socket.local_addr(),
        }
    }

    /// The listener, listening from now on.
    fn listen(self) -> Result<TcpListener, ServeError> {
        match self {
            Self::Listening(listener) => Ok(listener),
            Self::Shared { socket, addr } => socket.listen(Listeners::BACKLOG).map_err(|source| {
                shared_step_failed(
                    "proxy.listen",
                    addr,
                    "listening on it with SO_REUSEPORT (proxy.reuse_port = true)",
                    source,
                )
            }),
        }
    }
}

impl Listeners {
    /// Binds `proxy.listen`, `admin.listen` and `lock.listen`; an error names the key.
    pub async fn bind(config: &Config) -> Result<Self, ServeError> {
        async fn bind(key: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { key, addr, source })
        }
        let proxy = match config.proxy.reuse_port {
            true => Self::shared("proxy.listen", config.proxy.listen)?,
            false => bind("proxy.listen", config.proxy.listen).await?.into(),
        };
        Ok(Self {
            proxy,
            admin: bind("admin.listen", config.admin.listen).await?,
            lock: bind("lock.listen", config.lock.listen).await?,
        })
    }

    /// A socket bound to `addr` with `SO_REUSEPORT` (`proxy.reuse_port`), not listening yet:
    /// other sockets with it on the same address and of the same user share it, and the kernel
    /// spreads new connections among those listening by a hash of the client's address and
    /// port. Bound now, so that an address another process holds alone fails the start at
    /// once, and no process can take it alone meanwhile.
    fn shared(key: &'static str, addr: SocketAddr) -> Result<ProxySocket, ServeError> {
        let error = |step| move |source| shared_step_failed(key, addr, step, source);
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .map_err(error("opening a socket for it"))?;
        // Without SO_REUSEADDR: with it, a socket bound and not listening yet lets a socket
        // that sets it too (`TcpListener::bind`'s) bind the address and listen first. The
        // connections of an earlier process on the address left in TIME_WAIT carry
        // SO_REUSEPORT too, so a restart binds at once all the same.
        socket
            .set_reuseport(true)
            .map_err(error("setting SO_REUSEPORT (proxy.reuse_port = true)"))?;
        socket.bind(addr).map_err(error(
            "binding it with SO_REUSEPORT (proxy.reuse_port = true)",
        ))?;
        Ok(ProxySocket::Shared { socket, addr })
    }

    /// Connections the kernel queues for a shared listener before it accepts them, as many as
    /// `TcpListener::bind` asks for (the kernel caps it at `net.core.somaxconn`).
    const BACKLOG: u32 = 1024;

    fn addr(listener: &Listener) -> String {
        listener
            .local_addr()
            .map_or_else(|e| e.to_string(), |a| a.to_string())
    }
}

/// Runs railguard on `listeners` until `shutdown` resolves, then drains and stops.
pub async fn run(
    listeners: Listeners,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    run_reloading(listeners, config, shutdown, None).await
}

/// [`run`], also reloading what can be reloaded on each of `reload`'s requests (SIGHUP,
/// [`crate::reload`]) once it serves.
pub async fn run_reloading(
    listeners: Listeners,
    config: Config,
    shutdown: impl Future<Output = ()>,
    reload: Option<Reload>,
) -> Result<(), ServeError> {
    let metrics = Arc::new(Metrics::new());
    // Credentials first: a broken file fails the start before anything is opened.
    let auth = load_credentials(&config, &metrics)?;
    // TLS files are read before anything else starts: a listener that cannot serve its
    // certificate stops railguard at start with the key named.
    let proxy_tls = tls_server("proxy", &config.proxy.listener, &metrics)?;
    let lock_tls = tls_server("lock", &config.lock.listener, &metrics)?;
    let admin_tls = tls_server("admin", &config.admin.listener, &metrics)?;
    let reloadable = Reloadable {
        credentials: auth.clone(),
        tls: [
            ("proxy", &proxy_tls),
            ("lock", &lock_tls),
            ("admin", &admin_tls),
        ]
        .into_iter()
        .filter_map(|(name, tls)| tls.clone().map(|tls| (name, tls)))
        .collect(),
    };
    let lock_listener = listener(
        listeners.lock,
        "lock",
        &config.lock.listener,
        &metrics,
        lock_tls,
    );
    let admin_listener = listener(
        listeners.admin,
        "admin",
        &config.admin.listener,
        &metrics,
        admin_tls,
    );
    // A shared proxy address is listened on only once everything else has started (below).
    let (proxy_socket, proxy_metrics) = (listeners.proxy, metrics.clone());
    if !config.fencing.enforce {
        tracing::error!(
            "!!! FENCING IS DISABLED (fencing.enforce = false) !!! Stale tokens WILL reach the \
             rail and payments can be duplicated. This switch exists only to demonstrate that \
             corruption. railguard_fencing_enforced is 0."
        );
    }
    let mut shutdown = std::pin::pin!(shutdown);
    // The rail's TLS files are read once, now: a bad one stops the start, naming its key.
    let rail_tls = crate::tls::client::rail_tls(&config.proxy)?;
    let mut database = tokio::select! {
        database = Database::open(&config.database) => database?,
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
        config.database.timeout,
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
    // An operator resolving a record in doubt after a PostgreSQL restart finds its owner here.
    tracing::info!(
        instance = instance.get(),
        "holding this process's instance lock as instance {instance}: the idempotency records it \
         creates name it as their owner"
    );
    // The statements' own sessions: the fence's last look and the idempotency completions.
    let sessions = crate::store::batch::most_in_flight(config.fencing.batch_concurrency);
    let looks = database.look_pool(sessions, config.database.timeout)?;
    let completion_sessions = database.completion_pool(sessions, config.database.timeout)?;
    // A session whose settings did not take (a pooler that drops startup options, commits that
    // are not durable) stops the start here, before anything else has started; the embedded
    // server, if any, is stopped cleanly.
    let opened = async {
        db::open_one(&database.pool, "the database pool's sessions").await?;
        db::open_one(&looks, "the fence's last-look database sessions").await?;
        db::open_one(
            &completion_sessions,
            "the idempotency completions' database sessions",
        )
        .await
    }
    .await;
    if let Err(e) = opened {
        instance_task.abort();
        database.shutdown().await;
        return Err(e.into());
    }
    // Replication that can lose an accepted compare-and-set is said loudly, or refused
    // (`database.replication_risk`, store::replication).
    let replication = Arc::new(ReplicationCheck::new(
        config.database.replication_risk == ReplicationRisk::Refuse,
        config.database.timeout,
        metrics.registry(),
    ));
    if let Err(e) = check_replication(&replication, &database.pool).await {
        instance_task.abort();
        database.shutdown().await;
        return Err(e);
    }
    // Grants are signed with the key every railguard on this database shares.
    let proofs = match load_proof_key(&database.pool).await {
        Ok(key) => Arc::new(key),
        Err(e) => {
            instance_task.abort();
            database.shutdown().await;
            return Err(ServeError::ProofKey(e));
        }
    };
    for (key, why) in config.warnings() {
        tracing::warn!(key, "configuration: {key}: {why}");
    }
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
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    metrics
        .runtime_worker_threads
        .set(i64::try_from(workers).unwrap_or(i64::MAX));

    let mut locks = Locks::start(
        &config.lock,
        &config.etcd,
        &config.guard,
        &config.fencing.lock_key_template,
        LockDatabase {
            pool: &database.pool,
            url: &database.url,
            timeout: config.database.timeout,
        },
        metrics.registry(),
    );
    // Every session is checked against the server the database was acknowledged on before it
    // is used (store::epoch); the sessions opened so far are let go so that none escapes it.
    let epoch = locks
        .guard
        .epoch()
        .expect("the guard has the store epoch")
        .clone();
    if !config.guard.detect_store_changes {
        tracing::error!(
            "!!! STORE CHANGE DETECTION IS OFF (guard.detect_store_changes = false) !!! A \
             PostgreSQL failover or rewind, or a restored etcd, can make the rail pay twice. This \
             switch exists only to demonstrate that corruption. \
             railguard_store_change_detection is 0."
        );
    }
    database.gate.install(epoch.clone());
    for pool in [&database.pool, &looks, &completion_sessions] {
        pool.retain(|_, _| false);
    }
    match database.pool.get().await {
        Ok(mut session) => {
            if let Err(e) = epoch.check_session(&mut session).await {
                tracing::error!(error = %e, "could not check the database's server at start");
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "could not check the database's server at start")
        }
    }
    // The token source is compared with the fencing marks before the first grant (C1 §1.7):
    // until a check has found it ahead, the lock API grants nothing.
    if let Err(e) = locks.guard.check().await {
        tracing::error!(error = %e,
            "could not check the token source at start; no grants until a check succeeds");
    }
    locks.check_periodically(config.guard.interval);
    let replication_task = tokio::spawn(
        replication
            .clone()
            .run(database.pool.clone(), config.guard.interval),
    );

    // Everything a stop waits for, in one tracker (crate::work).
    let work = WorkTracker::default();
    let batching = Batching {
        max_batch: config.fencing.batch_max,
        concurrency: config.fencing.batch_concurrency,
        stalled: metrics.db_statements_stalled.clone(),
        unanswered: work.of(Work::Statement),
        held: Arc::default(),
        notices: database.notices.clone(),
    };
    let idempotency_store = IdempotencyStore::new(
        database.pool.clone(),
        completion_sessions,
        config.database.timeout,
        batching.clone(),
        OutcomeMetrics {
            pending: metrics.outcomes_pending.clone(),
            lost: metrics.outcomes_lost.clone(),
            batch_sizes: metrics.completion_batch_size.clone(),
        },
    )
    .with_rail_transit(config.proxy.rail_transit);
    let records: Arc<dyn Records> = Arc::new(idempotency_store.clone());
    // Index changes that must not block writes, in the background (db::maintenance).
    let maintenance = tokio::spawn(db::maintenance::until_done(
        database.url.clone(),
        config.database.timeout,
    ));
    // Several processes on one database keep each account's tokens in order at the rail
    // (store::handover).
    metrics
        .cross_process_order
        .set(i64::from(config.fencing.order_across_processes));
    let handover = if config.fencing.order_across_processes {
        Some(
            Handover::start(
                database.pool.clone(),
                database.url.clone(),
                instance.get(),
                config.proxy.rail_transit,
                config.database.timeout,
                database.server.is_some(),
            )
            .await
            .map_err(ServeError::Handover)?,
        )
    } else {
        tracing::error!(
            "!!! CROSS-PROCESS ORDER IS OFF (fencing.order_across_processes = false) !!! With \
             several railguard processes on one database, a request of an older grant can reach \
             the rail after a newer grant's. This switch exists only to demonstrate that. \
             railguard_cross_process_order is 0."
        );
        None
    };
    let marks = HighWaterStore::new(
        database.pool.clone(),
        looks,
        config.database.timeout,
        batching,
        metrics.fence_batch_size.clone(),
        ThisProcess {
            instance,
            handover: handover.clone(),
        },
        records.clone(),
    );
    let sweeper = tokio::spawn(sweep_forever(
        idempotency_store.clone(),
        config.idempotency.retention,
        config.idempotency.sweep_interval,
    ));
    let forward = Forward::new(
        config.proxy.upstream.clone(),
        rail_tls,
        config.proxy.upstream_connect_timeout,
        config.proxy.late_answer_wait,
        metrics.clone(),
    )
    .counting_in(work.of(Work::Forward));
    let late_forwards = forward.late_forwards();
    // Retries of payments in doubt ask the rail by idempotency key ([rail_lookup]).
    let resolver = config.rail_lookup.template().map(|template| {
        Arc::new(Resolver::new(
            Arc::new(forward.clone()),
            template.clone(),
            config.rail_lookup.timeout,
            config.rail_lookup.max_concurrent,
            config.idempotency.max_response_bytes,
            Resolver::register(metrics.registry()),
        ))
    });
    let stack = proxy::stack(
        ExtractLayer::new(extract_config(
            &config,
            proofs.clone(),
            locks.guard.clone(),
            &metrics,
            auth.clone(),
        )),
        FenceLayer::new(Arc::new(
            FencePoint::new(
                marks.clone(),
                config.fencing.cache_capacity,
                metrics.clone(),
                config.fencing.enforce,
            )
            .counting_into(late_forwards.clone())
            .with_floor(epoch.clone())
            .ordered_across_processes(handover.clone())
            .answering_own_repeats(records.clone())
            .asking_the_rail(resolver.clone()),
        )),
        IdempotencyLayer::new(
            records,
            IdempotencyConfig {
                max_response_bytes: config.idempotency.max_response_bytes,
            },
        )
        .resolving_with(resolver),
        forward,
        metrics.clone(),
    );
    let lock_api = LockApi::new(locks.service.clone(), proofs, auth.clone());
    let credentials_watch = auth
        .as_ref()
        .map(|auth| auth.watch(config.auth.reload_interval));
    let outstanding = Outstanding {
        late_forwards: late_forwards.clone(),
        work: work.clone(),
        outcomes_pending: metrics.outcomes_pending.clone(),
    };
    let admin = Admin {
        metrics,
        guard: locks.guard.clone(),
        store: marks,
        idempotency: idempotency_store,
        max_account_len: config.proxy.max_account_len,
        lock_key_template: config.fencing.lock_key_template.clone(),
        auth: auth.clone(),
        replication,
    };

    let grace = config.shutdown.grace;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let proxy_listener = listener(
        proxy_socket.listen()?,
        "proxy",
        &config.proxy.listener,
        &proxy_metrics,
        proxy_tls,
    )
    .answering_overload_with(proxy::error::overloaded);
    tracing::info!(
        proxy = %Listeners::addr(&proxy_listener),
        admin = %Listeners::addr(&admin_listener),
        lock = %Listeners::addr(&lock_listener),
        proxy.tls = config.proxy.listener.settings().tls.is_some(),
        admin.tls = config.admin.listener.settings().tls.is_some(),
        lock.tls = config.lock.listener.settings().tls.is_some(),
        upstream = %config.proxy.upstream,
        backend = config.lock.backend.name(),
        enforce = config.fencing.enforce,
        "railguard serving"
    );
    let proxy_task = tokio::spawn(serve(
        proxy_listener,
        move |_peer: crate::http::Peer| {
            let stack = stack.clone();
            hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
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

    let reloads =
        reload.map(|reload| tokio::spawn(crate::reload::serve(reload, config.clone(), reloadable)));
    let died = tokio::select! {
        () = &mut shutdown => None,
        status = database.embedded_exited() => Some(status),
    };
    if let Some(status) = &died {
        tracing::error!(%status, "the embedded PostgreSQL exited on its own; shutting down");
    }
    // One deadline for the whole stop: the listeners' drain, then every piece of work still
    // outstanding (`shutdown::Outstanding`), all within `shutdown.grace_ms` of the signal.
    let deadline = tokio::time::Instant::now() + grace;
    tracing::info!(?grace, "shutting down");
    if let Some(reloads) = reloads {
        reloads.abort();
    }
    let _ = stop_tx.send(true);
    let _ = proxy_task.await;
    outstanding.settle(deadline).await;
    // The other processes take this one's answered forwards as settled at once, not when its
    // row goes quiet (store::handover).
    if let Some(handover) = &handover {
        handover.publish_last().await;
    }
    outstanding
        .record_stop(&database.pool, instance, &config)
        .await;
    let _ = lock_task.await;
    let _ = admin_task.await;
    locks.stop();
    if let Some(watch) = credentials_watch {
        watch.abort();
    }
    sweeper.abort();
    replication_task.abort();
    // A build under way goes on in its server session and is picked up by the next start.
    maintenance.abort();
    instance_task.abort();
    database.shutdown().await;
    tracing::info!("railguard stopped");
    match died {
        Some(status) => Err(ServeError::EmbeddedDied(status)),
        None => Ok(()),
    }
}

/// The TLS files of listener `name`, read (none for plain TCP): a file that cannot serve
/// stops railguard at start with its key named.
fn tls_server(
    name: &'static str,
    config: &ListenerConfig,
    metrics: &Metrics,
) -> Result<Option<Arc<crate::tls::server::TlsServer>>, ServeError> {
    let Some(files) = config.settings().tls else {
        return Ok(None);
    };
    let key = match name {
        "proxy" => "proxy.tls_cert_file",
        "admin" => "admin.tls_cert_file",
        _ => "lock.tls_cert_file",
    };
    let tls =
        crate::tls::server::TlsServer::load(files, name, metrics.listener_tls_reloads.clone())
            .map_err(|source| ServeError::Tls { key, source })?;
    Ok(Some(Arc::new(tls)))
}

/// A bound listener with its section's limits and TLS (`name` is also the section).
fn listener(
    tcp: TcpListener,
    name: &'static str,
    config: &ListenerConfig,
    metrics: &Metrics,
    tls: Option<Arc<crate::tls::server::TlsServer>>,
) -> Listener {
    let listener = Listener::new(tcp, name)
        .with_limits(config.settings().limits)
        .counting_refusals_in(metrics.listener_refusals.clone());
    match tls {
        Some(tls) => listener.with_tls(tls),
        None => listener,
    }
}

/// The `[proxy]` and `[fencing]` settings the extract layer needs.
fn extract_config(
    config: &Config,
    proofs: Arc<ProofKey>,
    source: Arc<SourceGuard>,
    metrics: &Metrics,
    auth: Option<Arc<Authenticator>>,
) -> ExtractConfig {
    ExtractConfig {
        token_header: config.proxy.token_header.clone(),
        account_header: config.proxy.account_header.clone(),
        idempotency_header: config.proxy.idempotency_header.clone(),
        first_token_header: config.proxy.first_token_header.clone(),
        proof_header: config.proxy.proof_header.clone(),
        idempotency_required: config.idempotency.required,
        max_account_len: config.proxy.max_account_len,
        max_body_bytes: config.proxy.max_body_bytes,
        request_timeout: config.proxy.request_timeout,
        grants: GrantCheck {
            proofs,
            required: config.fencing.require_proof,
            lock_key_prefix: config.fencing.lock_key_template.prefix().to_string(),
            lock_key_suffix: config.fencing.lock_key_template.suffix().to_string(),
            unproven: metrics.unproven_tokens.clone(),
            source,
        },
        auth,
        account_in_path: config.fencing.account_in_path.clone(),
    }
}

/// The credentials file in force, if `auth.credentials_file` names one.
fn load_credentials(
    config: &Config,
    metrics: &Metrics,
) -> Result<Option<Arc<Authenticator>>, ServeError> {
    let auth_metrics = AuthMetrics::register(metrics.registry());
    if !config.auth.enabled() {
        tracing::warn!(
            "authentication is off (auth.credentials_file is empty): anyone who can reach the \
             lock listener can take any lock, anyone who can reach the proxy can pay on any \
             account with a grant, and the admin listener's operator actions are open"
        );
        return Ok(None);
    }
    let template = &config.fencing.lock_key_template;
    let auth = Authenticator::load(
        &config.auth.credentials_file,
        LockKeyShape {
            prefix: template.prefix().to_string(),
            suffix: template.suffix().to_string(),
        },
        config.auth.lock_requests_per_s,
        config.auth.lock_in_flight_per_identity,
        auth_metrics,
    )?;
    tracing::info!(file = %config.auth.credentials_file.display(),
        "authentication is on for the lock, proxy and admin listeners");
    Ok(Some(auth))
}

/// The replication check at start, on a session of the main pool: with
/// `database.replication_risk = "refuse"` a risk stops the start. A check that cannot be made
/// now is made again every `guard.interval_ms` (until then, a refusing railguard is not ready).
async fn check_replication(
    check: &ReplicationCheck,
    pool: &deadpool_postgres::Pool,
) -> Result<(), ServeError> {
    let found = async {
        let client = pool
            .get()
            .await
            .map_err(|e| ReplicationError(db::DbError::from(e).to_string()))?;
        check.check(&client).await
    };
    match found.await {
        Ok(found) => match check.refusal(&found) {
            Some(why) => Err(ServeError::Replication(why)),
            None => Ok(()),
        },
        Err(e) => {
            tracing::warn!(error = %e,
                "could not check PostgreSQL's replication settings at start; trying again \
                 every guard.interval_ms");
            Ok(())
        }
    }
}

async fn load_proof_key(pool: &deadpool_postgres::Pool) -> Result<ProofKey, String> {
    let client = pool.get().await.map_err(|e| e.to_string())?;
    ProofKey::load_or_create(&**client)
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_shared_proxy_socket_that_cannot_bind_says_so_reuse_port_was_asked_for() {
        // Held alone (no SO_REUSEPORT): a shared socket cannot bind beside it.
        let alone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = alone.local_addr().unwrap();
        let Err(error) = Listeners::shared("proxy.listen", addr) else {
            panic!("bound beside a listener that holds {addr} alone");
        };
        let text = error.to_string();
        assert!(
            text.contains(&addr.to_string())
                && text.contains("`proxy.listen`")
                && text.contains("binding it with SO_REUSEPORT (proxy.reuse_port = true)"),
            "{text}"
        );
        let ServeError::Bind { source, .. } = error else {
            panic!("not a bind error: {error}");
        };
        assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
    }
}
