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
        proxy: local_addr(&listeners.proxy)?,
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

/// T-042 itself, against a running railguard.
struct Scenario<'a> {
    say: &'a Narrator,
    http: &'a HttpGet,
    rail: &'a RailSim,
    addrs: &'a Addrs,
    lock_key: &'a str,
    ttl: Duration,
}

/// What happened, for the checks.
struct Observed {
    t1: i64,
    t2: i64,
    w2_status: StatusCode,
    stale: Result<StatusCode, SdkError>,
    ledger: Vec<LedgerEntry>,
    fenced_before: Option<f64>,
    fenced_after: Option<f64>,
}

impl Scenario<'_> {
    async fn play(&self) -> Result<Verdict, DemoError> {
        let say = self.say;
        let key = self.lock_key;
        let locks = LockClient::new(format!("http://{}", self.addrs.lock));
        let proxy = RailClient::new(format!("http://{}", self.addrs.proxy));
        let sdk = |step| move |source| DemoError::Sdk { step, source };
        let fenced_before = self.fenced_out_total().await?;

        let w1 = locks
            .acquire(key, "W1", self.ttl, Duration::ZERO)
            .await
            .map_err(sdk("W1's acquire"))?;
        let t1 = w1.token().get();
        say.line(format_args!(
            "W1 acquires {key} → token {t1} (lease {})",
            secs(w1.ttl())
        ));
        say.line("W1 stalls (a long GC pause, a SIGSTOP): it stops renewing its lease");

        say.line(format_args!(
            "W2 asks for {key}, waiting up to {}: W1 still holds it",
            secs(W2_WAIT)
        ));
        let expiry = async {
            tokio::time::sleep_until(w1.lease_floor()).await;
            say.line(format_args!(
                "W1's lease expires: {} without a renewal; the lock service may grant {key} again",
                secs(w1.ttl())
            ));
        };
        let (w2, ()) = tokio::join!(locks.acquire(key, "W2", W2_TTL, W2_WAIT), expiry);
        let w2 = w2.map_err(sdk("W2's acquire"))?;
        let t2 = w2.token().get();
        say.line(format_args!(
            "W2 acquires {key} → token {t2} (a newer grant: {t2} > {t1})"
        ));

        let paid = proxy
            .post(
                &w2,
                ACCOUNT,
                "/payments",
                Bytes::from_static(b"{\"amount\":100,\"to\":\"merchant-1\"}"),
                Some(W2_PAYMENT),
            )
            .await
            .map_err(sdk("W2's payment"))?;
        say.line(format_args!(
            "W2 pays 100 on {ACCOUNT} through the proxy (Fencing-Token {t2}, Idempotency-Key \
             {W2_PAYMENT}) → {} {}",
            paid.status,
            String::from_utf8_lossy(&paid.body).trim()
        ));
        match self
            .rail
            .ledger()
            .iter()
            .find(|entry| entry.idempotency_key.as_deref() == Some(W2_PAYMENT))
        {
            Some(entry) => say.line(format_args!(
                "the rail records it as payment {} (token seen: {}); the proxy raised {ACCOUNT}'s \
                 high-water mark to {t2}",
                entry.seq,
                entry.token.as_deref().unwrap_or("none")
            )),
            None => say.line("the rail has no record of W2's payment"),
        }

        say.line(format_args!(
            "W1 wakes up, unaware that its lease expired, and submits its payment with its own \
             handle (Fencing-Token {t1}, Idempotency-Key {W1_PAYMENT})"
        ));
        let stale = self.stale_submit(&proxy, &w1).await;

        match locks.release(w2).await {
            Ok(()) => say.line(format_args!("W2 releases {key}")),
            Err(e) => say.line(format_args!("W2's release failed: {e}")),
        }

        let ledger = self.rail.ledger();
        print_ledger(&ledger);
        let metrics = self.metrics_text().await?;
        print_metrics(&metrics, self.addrs.admin);

        let observed = Observed {
            t1,
            t2,
            w2_status: paid.status,
            stale,
            ledger,
            fenced_before,
            fenced_after: metric(&metrics, FENCED_OUT),
        };
        Ok(check(&observed))
    }

    /// W1's submit with its own handle; narrates the answer.
    async fn stale_submit(
        &self,
        proxy: &RailClient,
        w1: &LockHandle,
    ) -> Result<StatusCode, SdkError> {
        let answer = proxy
            .post(
                w1,
                ACCOUNT,
                "/payments",
                Bytes::from_static(b"{\"amount\":100,\"to\":\"merchant-1\"}"),
                Some(W1_PAYMENT),
            )
            .await;
        match &answer {
            Err(SdkError::FencedOut {
                account,
                token,
                body,
            }) => {
                self.say.line(format_args!(
                    "→ 409 FencedOut: the proxy refused token {token} on {account}; the rail \
                     never saw it"
                ));
                self.say.line(format_args!("  409 body: {}", body.trim()));
            }
            Err(e) => self.say.line(format_args!("→ {e}")),
            Ok(response) => self.say.line(format_args!(
                "→ {} {}  (NOT fenced out)",
                response.status,
                String::from_utf8_lossy(&response.body).trim()
            )),
        }
        answer.map(|response| response.status)
    }

    async fn metrics_text(&self) -> Result<String, DemoError> {
        let url = format!("http://{}/metrics", self.addrs.admin);
        match self.http.get(&url, Duration::from_secs(5)).await {
            Ok((StatusCode::OK, text)) => Ok(text),
            Ok((status, body)) => Err(DemoError::Http {
                url,
                message: format!("{status}: {}", body.trim()),
            }),
            Err(message) => Err(DemoError::Http { url, message }),
        }
    }

    async fn fenced_out_total(&self) -> Result<Option<f64>, DemoError> {
        Ok(metric(&self.metrics_text().await?, FENCED_OUT))
    }
}

/// Compares what happened with T-042's expected outcome; prints each check.
fn check(o: &Observed) -> Verdict {
    let mut failed = Vec::new();
    let mut check = |ok: bool, what: String, otherwise: String| {
        if ok {
            println!("  ok      {what}");
        } else {
            println!("  FAILED  {what}: {otherwise}");
            failed.push(format!("{what}: {otherwise}"));
        }
    };
    println!("checks:");
    check(
        o.t2 > o.t1,
        format!("W2's token is above W1's ({} > {})", o.t2, o.t1),
        "it is not".into(),
    );
    check(
        o.w2_status.is_success(),
        "W2's payment was forwarded and accepted".into(),
        format!("the proxy answered {}", o.w2_status),
    );
    let fenced = match &o.stale {
        Err(SdkError::FencedOut {
            account,
            token,
            body,
        }) if account == ACCOUNT && *token == o.t1 => Ok(body),
        Err(e) => Err(format!("it got {e}")),
        Ok(status) => Err(format!("it got {status}")),
    };
    check(
        fenced.is_ok(),
        format!("W1's stale submit (token {}) was fenced out", o.t1),
        fenced.as_ref().err().cloned().unwrap_or_default(),
    );
    if let Ok(body) = fenced {
        let names = names_account_and_token(body, o.t1);
        let reveals = reveals_mark(body, o.t2);
        check(
            names && !reveals,
            "the 409 names the account and the presented token, and not the mark".into(),
            format!("body {body}"),
        );
    }
    let ledger: Vec<String> = o.ledger.iter().map(ledger_line).collect();
    let only_w2 = matches!(o.ledger.as_slice(), [entry]
        if entry.account.as_deref() == Some(ACCOUNT)
            && entry.token.as_deref() == Some(o.t2.to_string().as_str())
            && entry.idempotency_key.as_deref() == Some(W2_PAYMENT));
    check(
        only_w2,
        format!("the rail holds exactly W2's payment (token {})", o.t2),
        format!("its ledger: [{}]", ledger.join("; ")),
    );
    let rose = match (o.fenced_before, o.fenced_after) {
        (Some(before), Some(after)) => after - before,
        _ => f64::NAN,
    };
    check(
        rose == 1.0,
        format!("{FENCED_OUT} rose by 1"),
        format!(
            "it went from {} to {}",
            show(o.fenced_before),
            show(o.fenced_after)
        ),
    );
    if failed.is_empty() {
        println!("T-042 holds: the stalled survivor was fenced out and the rail paid once.");
        Verdict::Passed
    } else {
        println!("T-042 FAILED: {} check(s) did not hold.", failed.len());
        Verdict::Failed(failed)
    }
}

fn show(value: Option<f64>) -> String {
    value.map_or_else(|| "(absent)".into(), |v| v.to_string())
}

/// Whether the 409 body is `fenced_out` for [`ACCOUNT`] and `token`.
fn names_account_and_token(body: &str, token: i64) -> bool {
    serde_json::from_str::<serde_json::Value>(body)
        .is_ok_and(|v| v["error"] == "fenced_out" && v["account"] == ACCOUNT && v["token"] == token)
}

/// Whether any field of the 409 body is the mark, as a number or a string, or a message
/// mentions it.
fn reveals_mark(body: &str, mark: i64) -> bool {
    let Ok(serde_json::Value::Object(fields)) = serde_json::from_str(body) else {
        return false;
    };
    let text = mark.to_string();
    let spoken = format!(" {text}");
    fields.values().any(|value| {
        *value == mark
            || value
                .as_str()
                .is_some_and(|s| s == text || s.contains(&spoken))
    })
}

fn ledger_line(entry: &LedgerEntry) -> String {
    let or_none = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    format!(
        "seq {}  account {}  token {}  idempotency-key {}",
        entry.seq,
        or_none(&entry.account),
        or_none(&entry.token),
        or_none(&entry.idempotency_key)
    )
}

fn print_ledger(ledger: &[LedgerEntry]) {
    println!(
        "rail ledger ({} entr{}):",
        ledger.len(),
        if ledger.len() == 1 { "y" } else { "ies" }
    );
    for entry in ledger {
        println!("  {}", ledger_line(entry));
    }
}

/// The samples of [`SHOWN_METRICS`]; request outcomes that never happened are left out.
fn print_metrics(text: &str, admin: SocketAddr) {
    println!("metrics (http://{admin}/metrics):");
    for (series, value) in samples(text) {
        let name = series.split('{').next().unwrap_or(series);
        if !SHOWN_METRICS.contains(&name) {
            continue;
        }
        if name == "railguard_requests_total" && value == 0.0 {
            continue;
        }
        println!("  {series} {value}");
    }
}

/// `(series, value)` of every sample line of a Prometheus text exposition.
fn samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.trim(), value.trim().parse().ok()?))
        })
}

/// The value of the unlabelled series `name`.
fn metric(text: &str, name: &str) -> Option<f64> {
    samples(text)
        .find(|(series, _)| *series == name)
        .map(|(_, v)| v)
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, token: i64, key: &str) -> LedgerEntry {
        LedgerEntry {
            seq,
            method: "POST".into(),
            path: "/payments".into(),
            account: Some(ACCOUNT.into()),
            token: Some(token.to_string()),
            idempotency_key: Some(key.into()),
            body_sha256: String::new(),
            forwarded_for: None,
            headers: Vec::new(),
            received_unix_ms: 0,
        }
    }

    fn fenced(token: i64) -> Result<StatusCode, SdkError> {
        Err(SdkError::FencedOut {
            account: ACCOUNT.into(),
            token,
            body: format!(
                "{{\"error\":\"fenced_out\",\"message\":\"below the mark\",\"origin\":\"client\",\
                 \"account\":\"{ACCOUNT}\",\"token\":{token},\"request_id\":\"0a5-2\"}}"
            ),
        })
    }

    fn t042() -> Observed {
        Observed {
            t1: 3,
            t2: 5,
            w2_status: StatusCode::CREATED,
            stale: fenced(3),
            ledger: vec![entry(1, 5, W2_PAYMENT)],
            fenced_before: Some(0.0),
            fenced_after: Some(1.0),
        }
    }

    #[test]
    fn the_expected_outcome_passes() {
        assert_eq!(check(&t042()), Verdict::Passed);
    }

    #[test]
    fn a_duplicate_payment_an_unfenced_submit_and_a_silent_counter_each_fail() {
        let observed = Observed {
            stale: Ok(StatusCode::CREATED),
            ledger: vec![entry(1, 5, W2_PAYMENT), entry(2, 3, W1_PAYMENT)],
            fenced_after: Some(0.0),
            ..t042()
        };
        let Verdict::Failed(why) = check(&observed) else {
            panic!("a duplicate payment must fail the demo");
        };
        assert_eq!(why.len(), 3, "{why:?}");
        assert!(
            why[0].contains("fenced out") && why[0].contains("201"),
            "{why:?}"
        );
        assert!(why[1].contains("seq 2"), "{why:?}");
        assert!(why[2].contains("from 0 to 0"), "{why:?}");
    }

    #[test]
    fn a_missing_counter_or_a_wrong_token_fails() {
        let observed = Observed {
            stale: fenced(4),
            fenced_after: None,
            ..t042()
        };
        assert!(matches!(check(&observed), Verdict::Failed(why) if why.len() == 2));
    }

    #[test]
    fn a_409_that_reveals_the_mark_fails() {
        let body = format!(
            "{{\"error\":\"fenced_out\",\"account\":\"{ACCOUNT}\",\"token\":3,\"mark\":5}}"
        );
        assert!(reveals_mark(&body, 5));
        assert!(reveals_mark("{\"message\":\"the mark is 5\"}", 5));
        assert!(!reveals_mark("{\"token\":3,\"request_id\":\"5a-5\"}", 5));
        let observed = Observed {
            stale: Err(SdkError::FencedOut {
                account: ACCOUNT.into(),
                token: 3,
                body,
            }),
            ..t042()
        };
        assert!(matches!(check(&observed), Verdict::Failed(why) if why.len() == 1));
    }

    #[test]
    fn metrics_are_read_from_prometheus_text() {
        let text = "# HELP lock_fenced_out_total x\n# TYPE lock_fenced_out_total counter\n\
                    lock_fenced_out_total 2\n\
                    railguard_requests_total{outcome=\"forwarded\"} 7\n";
        assert_eq!(metric(text, FENCED_OUT), Some(2.0));
        assert_eq!(metric(text, "railguard_requests_total"), None);
        assert_eq!(samples(text).count(), 2);
    }
}
