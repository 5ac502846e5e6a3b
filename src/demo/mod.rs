//! `railguard demo`: T-042, the stalled survivor, played for real in one process.
//!
//! Why it exists: the claim railguard makes — a worker that stalled past its lease cannot pay
//! after someone else took over — is easiest to believe when you watch it happen on your own
//! machine, with the real lock service, the real proxy and a rail that would happily pay twice.
//! The README's curl walk-through needs three terminals, a rail simulator and jq; this needs
//! only the PostgreSQL server binaries (and etcd for `--backend etcd`).
//!
//! What it does: starts an embedded PostgreSQL in a fresh temp dir, railguard itself
//! ([`server::run`] on free loopback ports, configured in code — nothing is written outside
//! the temp dir), the rail simulator, and for `--backend etcd` a throwaway etcd member. Then
//! two workers use the SDK exactly as real workers do: W1 acquires the account's lock and
//! stalls; its lease expires; W2 takes the lock with a newer token and pays; W1 wakes and
//! submits with its own, stale, grant and is fenced out. Every step is narrated with the time
//! since the start, then the rail's ledger and the relevant metrics are printed.
//!
//! It checks what it narrates: [`Verdict::Passed`] only if the rail holds exactly W2's payment,
//! `lock_fenced_out_total` rose by one and W1's submit came back fenced out. Everything it
//! started is stopped and removed on every path, failure included.

mod etcd;
pub mod ports;
mod scenario;

use std::ffi::OsString;
use std::fmt::Display;
use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::{Config, DatabaseUrl, LockBackendKind, Upstream};
use crate::railsim::{LedgerEntry, RailSim};
use crate::sdk::{LockClient, LockHandle, RailClient, SdkError};
use crate::server::{self, Listeners, ServeError};

use self::scenario::Scenario;

/// The account both workers pay on.
const ACCOUNT: &str = "acct-demo";
/// Idempotency keys of the two payments: each worker's own.
const W2_PAYMENT: &str = "pay-w2-0001";
const W1_PAYMENT: &str = "pay-w1-0001";
/// How long W2 may wait for the lock W1 still holds.
const W2_WAIT: Duration = Duration::from_secs(15);
/// W2's lease: long enough for the rest of the demo; it releases it at the end.
const W2_TTL: Duration = Duration::from_secs(30);
/// How long railguard may take to become ready (initdb, migrations).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The metrics the demo prints (Prometheus names, without labels).
const SHOWN_METRICS: &[&str] = &[
    "lock_fenced_out_total",
    "railguard_requests_total",
    "lock_grants_total",
    "lock_takeovers_total",
    "lock_expiries_total",
    "lock_releases_total",
];
const FENCED_OUT: &str = "lock_fenced_out_total";

/// What `main` hands the demo.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub backend: LockBackendKind,
    /// W1's lease.
    pub ttl: Duration,
    /// The `PATH` to look for `etcd` in (only `main` reads the environment).
    pub search_path: Option<OsString>,
}

/// Why the demo could not be played (as opposed to played and failed its checks).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(
        "--backend etcd needs an `etcd` binary on PATH, and there is none; install it \
         (Debian/Ubuntu: apt-get install etcd-server) or run the demo on the PostgreSQL \
         backend (the default)"
    )]
    EtcdMissing,
    #[error("cannot start etcd: {0}")]
    Etcd(String),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the rail simulator's address does not make an upstream: {0}")]
    Upstream(String),
    #[error("railguard: {0}")]
    Serve(#[from] ServeError),
    #[error("railguard stopped during start-up")]
    Stopped,
    #[error("railguard was not ready within {0:?}: {1}")]
    NotReady(Duration, String),
    #[error("{step}: {source}")]
    Sdk {
        step: &'static str,
        #[source]
        source: SdkError,
    },
    #[error("cannot read {url}: {message}")]
    Http { url: String, message: String },
    #[error("interrupted")]
    Interrupted,
}

impl DemoError {
    /// The process exit code: 2 for what the user must install, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            DemoError::EtcdMissing => 2,
            DemoError::Interrupted => 130,
            _ => 1,
        }
    }
}

/// How the demo ended, once played.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Everything it narrated was checked and held.
    Passed,
    /// What differed from T-042's expected outcome (already printed).
    Failed(Vec<String>),
}

/// Plays T-042 as described in the module docs; narration goes to stdout.
pub async fn run(options: DemoOptions) -> Result<Verdict, DemoError> {
    // Installed first, so that Ctrl-C at any point still ends in the clean-up below (a
    // second one exits at once).
    let interrupted = server::shutdown_signal();
    let mut interrupted = std::pin::pin!(interrupted);
    let say = Narrator::new();
    let http = HttpGet::new();
    say.line(format_args!(
        "railguard demo: T-042, the stalled survivor, on the {} lock backend",
        options.backend.name()
    ));

    // etcd first: without it there is nothing to start, and the user is told what to install.
    let etcd = match options.backend {
        LockBackendKind::Etcd => {
            let binary =
                etcd::find(options.search_path.as_deref()).ok_or(DemoError::EtcdMissing)?;
            let etcd = etcd::Etcd::start(&binary, &http).await?;
            say.line(format_args!(
                "etcd started: {} ({}), a throwaway single member",
                etcd.endpoint(),
                binary.display()
            ));
            Some(etcd)
        }
        LockBackendKind::Postgres => None,
    };
    let played = with_railguard(
        &options,
        etcd.as_ref().map(etcd::Etcd::endpoint),
        &say,
        &http,
        interrupted.as_mut(),
    )
    .await;
    if let Some(etcd) = etcd {
        etcd.stop().await;
        say.line("etcd stopped, its data dir removed");
    }
    played
}

/// Starts the rail simulator and railguard on an embedded PostgreSQL in a temp dir, plays the
/// scenario, and stops and removes all of it whatever the scenario's outcome.
async fn with_railguard(
    options: &DemoOptions,
    etcd: Option<&str>,
    say: &Narrator,
    http: &HttpGet,
    interrupted: Pin<&mut (dyn Future<Output = ()> + Send)>,
) -> Result<Verdict, DemoError> {
    let dir = tempfile::Builder::new()
        .prefix("railguard-demo-")
        .tempdir()
        .map_err(|source| DemoError::Io {
            what: "cannot create the demo's temp dir",
            source,
        })?;
    // When we are root, PostgreSQL runs as `postgres`, which must be able to enter.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).map_err(
        |source| DemoError::Io {
            what: "cannot open the demo's temp dir to the PostgreSQL user",
            source,
        },
    )?;

    let rail = RailSim::new(Duration::ZERO);
    let rail_listener = TcpListener::bind(loopback())
        .await
        .map_err(|source| DemoError::Io {
            what: "cannot listen on loopback for the rail simulator",
            source,
        })?;
    let rail_addr = local_addr(&rail_listener)?;
    let (rail_stop, rail_stopped) = oneshot::channel::<()>();
    let rail_task = tokio::spawn(crate::http::serve(
        rail_listener,
        {
            let rail = rail.clone();
            move |_peer| {
                let rail = rail.clone();
                hyper::service::service_fn(move |request| rail.clone().handle(request))
            }
        },
        async move {
            let _ = rail_stopped.await;
        },
        // Stopped after railguard: nothing is in flight any more, only the proxy's idle
        // keep-alive connections, which need not be waited for.
        Duration::from_millis(200),
    ));

    let played = match demo_config(options, dir.path(), rail_addr, etcd) {
        Ok(config) => {
            serve_and_play(options, config, &rail, rail_addr, say, http, interrupted).await
        }
        Err(e) => Err(e),
    };

    let _ = rail_stop.send(());
    let _ = rail_task.await;
    let data_dir = dir.path().display().to_string();
    match dir.close() {
        Ok(()) => say.line(format_args!("rail simulator stopped, {data_dir} removed")),
        Err(e) => say.line(format_args!("cannot remove {data_dir}: {e}")),
    }
    played
}

/// railguard's configuration for the demo: everything on free loopback ports, the embedded
/// PostgreSQL in `dir`, the rail simulator upstream.
fn demo_config(
    options: &DemoOptions,
    dir: &std::path::Path,
    rail: SocketAddr,
    etcd: Option<&str>,
) -> Result<Config, DemoError> {
    let mut config = Config::default();
    config.proxy.listen = loopback();
    config.admin.listen = loopback();
    config.lock.listen = loopback();
    config.proxy.upstream =
        Upstream::parse(&format!("http://{rail}")).map_err(DemoError::Upstream)?;
    config.proxy.request_timeout = Duration::from_secs(5);
    config.database.url = DatabaseUrl::Embedded;
    config.database.data_dir = dir.join("pg");
    config.database.pool_size = 4;
    config.shutdown.grace = Duration::from_secs(2);
    config.lock.backend = options.backend;
    if let Some(endpoint) = etcd {
        config.etcd.endpoints = vec![endpoint.to_string()];
    }
    Ok(config)
}

/// Runs railguard until the scenario is over, then shuts it down (which stops the embedded
/// PostgreSQL).
async fn serve_and_play(
    options: &DemoOptions,
    config: Config,
    rail: &RailSim,
    rail_addr: SocketAddr,
    say: &Narrator,
    http: &HttpGet,
    interrupted: Pin<&mut (dyn Future<Output = ()> + Send)>,
) -> Result<Verdict, DemoError> {
    let listeners = Listeners::bind(&config).await?;
    let addrs = Addrs {
        proxy: listeners
            .proxy
            .local_addr()
            .map_err(|source| DemoError::Io {
                what: "cannot read a listener's address",
                source,
            })?,
        admin: local_addr(&listeners.admin)?,
        lock: local_addr(&listeners.lock)?,
    };
    let lock_key = format!(
        "{}{ACCOUNT}{}",
        config.fencing.lock_key_template.prefix(),
        config.fencing.lock_key_template.suffix()
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let mut server: Option<JoinHandle<Result<(), ServeError>>> =
        Some(tokio::spawn(server::run(listeners, config, async move {
            let _ = stopped.await;
        })));

    let play = async {
        wait_ready(&mut server, http, addrs.admin).await?;
        say.line(format_args!(
            "railguard is up on an embedded PostgreSQL: lock API http://{}, proxy http://{} \
             in front of the rail simulator at http://{rail_addr}, admin http://{}",
            addrs.lock, addrs.proxy, addrs.admin
        ));
        let scenario = Scenario {
            say,
            http,
            rail,
            addrs: &addrs,
            lock_key: &lock_key,
            ttl: options.ttl,
        };
        scenario.play().await
    };
    let played = tokio::select! {
        played = play => played,
        () = interrupted => Err(DemoError::Interrupted),
    };

    let _ = stop.send(());
    // `None` when it already ended during start-up, and `played` says why.
    let Some(server) = server else {
        return played;
    };
    match server.await {
        Ok(Ok(())) => say.line("railguard stopped (the embedded PostgreSQL with it)"),
        Ok(Err(e)) => {
            say.line(format_args!("railguard stopped with an error: {e}"));
            if played.is_ok() {
                return Err(e.into());
            }
        }
        Err(e) => say.line(format_args!("railguard's task failed: {e}")),
    }
    played
}

/// Waits until the admin listener's `/readyz` answers 200, or railguard exits (then `server`
/// is taken: its task is over).
async fn wait_ready(
    server: &mut Option<JoinHandle<Result<(), ServeError>>>,
    http: &HttpGet,
    admin: SocketAddr,
) -> Result<(), DemoError> {
    let Some(task) = server.as_mut() else {
        return Err(DemoError::Stopped);
    };
    let url = format!("http://{admin}/readyz");
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    let mut last;
    loop {
        tokio::select! {
            exited = &mut *task => {
                *server = None;
                return Err(match exited {
                    Ok(Err(e)) => e.into(),
                    _ => DemoError::Stopped,
                });
            }
            answer = http.get(&url, Duration::from_secs(2)) => match answer {
                Ok((StatusCode::OK, _)) => return Ok(()),
                Ok((status, body)) => last = format!("{status}: {}", body.trim()),
                Err(e) => last = e,
            },
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(DemoError::NotReady(READY_TIMEOUT, last));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where railguard listens.
struct Addrs {
    proxy: SocketAddr,
    admin: SocketAddr,
    lock: SocketAddr,
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn local_addr(listener: &TcpListener) -> Result<SocketAddr, DemoError> {
    listener.local_addr().map_err(|source| DemoError::Io {
        what: "cannot read a listener's address",
        source,
    })
}

/// Timestamped narration on stdout.
struct Narrator {
    start: Instant,
}

impl Narrator {
    fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    fn line(&self, text: impl Display) {
        println!("[+{:.3}s] {text}", self.start.elapsed().as_secs_f64());
    }
}

/// A plain HTTP GET client for `/readyz`, `/metrics` and etcd's `/health`.
pub(crate) struct HttpGet {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl HttpGet {
    fn new() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// GETs `url` and reads the whole answer within `timeout`.
    pub(crate) async fn get(
        &self,
        url: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, String), String> {
        let request = Request::get(url)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
    }
}
