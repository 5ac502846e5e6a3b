//! railguard itself, as a test starts it, with a config file written for the test and
//! `RAILGUARD__…` overrides on top — in one of two forms:
//!
//! - [`Railguard::start`]: in this process, through `railguard::server::run` on listeners
//!   bound to `127.0.0.1:0` — no free-port guessing, no binary to find, quick to start;
//! - [`Railguard::start_process`]: the real `railguard serve` binary as a child process, for
//!   what needs a process — SIGTERM draining, a crash (SIGKILL), the embedded PostgreSQL,
//!   signals, and its log.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use railguard::config::Config;
use railguard::proof::ProofKey;
use railguard::server::{self, Listeners, ServeError};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::process::{Child, Command};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::{Http, Metrics, free_loopback_port};

/// How this railguard runs.
enum Running {
    Process(Child),
    InProcess {
        stop: oneshot::Sender<()>,
        task: JoinHandle<Result<(), ServeError>>,
    },
}

/// A railguard for a test; see the module docs.
pub struct Railguard {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub lock: SocketAddr,
    running: Option<Running>,
    /// Whether it runs as a child process (and restarts as one).
    process: bool,
    dir: TempDir,
    upstream: String,
    env: BTreeMap<String, String>,
    database_url: String,
    /// The database's grant-proof key, so that a test can present tokens as the lock service
    /// would have granted them (the proxy's tests send tokens they choose).
    proofs: Option<Arc<ProofKey>>,
    /// What a start waits for: `/readyz`, or `/healthz` for a start expected not to be ready.
    wait_for: &'static str,
}

impl Railguard {
    /// Starts railguard in this process against `database_url` and `upstream`, with extra
    /// `RAILGUARD__…` overrides, and waits until /readyz says ready.
    pub async fn start(database_url: &str, upstream: &str, env: &[(&str, &str)]) -> Railguard {
        Self::launch(database_url, upstream, env, false).await
    }

    /// The same, as a `railguard serve` child process.
    pub async fn start_process(
        database_url: &str,
        upstream: &str,
        env: &[(&str, &str)],
    ) -> Railguard {
        Self::launch(database_url, upstream, env, true).await
    }

    async fn launch(
        database_url: &str,
        upstream: &str,
        env: &[(&str, &str)],
        process: bool,
    ) -> Railguard {
        let dir = tempfile::Builder::new()
            .prefix("railguard-rg-")
            .tempdir()
            .expect("temp dir");
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let unbound = SocketAddr::from(([127, 0, 0, 1], 0));
        let mut rg = Railguard {
            proxy: unbound,
            admin: unbound,
            lock: unbound,
            running: None,
            process,
            dir,
            upstream: upstream.to_string(),
            env,
            database_url: database_url.to_string(),
            proofs: None,
            wait_for: "/readyz",
        };
        rg.cover_made_up_tokens().await;
        rg.run().await;
        rg.proofs = rg.read_proof_key().await;
        rg
    }

    /// Writes the config for the current addresses. The rail is on loopback (or behind a test's
    /// relay, whose delays the test knows): a request's transit to it is taken as a second.
    fn write_config(&self) {
        let (proxy, admin, lock) = (self.proxy, self.admin, self.lock);
        let (upstream, database_url) = (&self.upstream, &self.database_url);
        let config = format!(
            "[proxy]\nlisten = \"{proxy}\"\nupstream = \"{upstream}\"\nrequest_timeout_ms = 3000\n\
             rail_transit_ms = 1000\n\
             [admin]\nlisten = \"{admin}\"\n\
             [lock]\nlisten = \"{lock}\"\n\
             [database]\nurl = \"{database_url}\"\ntimeout_ms = 1000\npool_size = 8\n\
             [log]\nformat = \"json\"\nlevel = \"info\"\n\
             [shutdown]\ngrace_ms = 3000\n"
        );
        std::fs::write(self.config_path(), config).unwrap();
    }

    /// Starts it (again): a child process keeps its ports; in this process, new listeners on
    /// port 0 are bound each time.
    async fn run(&mut self) {
        if self.process {
            if self.proxy.port() == 0 {
                // Three different ports: each is free when picked, and two picks may still
                // land on the same one.
                let mut ports: Vec<u16> = Vec::with_capacity(3);
                while ports.len() < 3 {
                    let port = free_loopback_port();
                    if !ports.contains(&port) {
                        ports.push(port);
                    }
                }
                let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
                (self.proxy, self.admin, self.lock) = (at(ports[0]), at(ports[1]), at(ports[2]));
            }
            self.write_config();
            self.spawn().await;
        } else {
            self.serve_in_process().await;
        }
    }

    async fn serve_in_process(&mut self) {
        let bind = || TcpListener::bind("127.0.0.1:0");
        let listeners = Listeners {
            proxy: bind().await.expect("bind proxy").into(),
            admin: bind().await.expect("bind admin"),
            lock: bind().await.expect("bind lock"),
        };
        self.proxy = listeners.proxy.local_addr().unwrap();
        self.admin = listeners.admin.local_addr().unwrap();
        self.lock = listeners.lock.local_addr().unwrap();
        self.write_config();
        let text = std::fs::read_to_string(self.config_path()).unwrap();
        let config = Config::parse(&text, "railguard.toml", &self.env)
            .unwrap_or_else(|e| panic!("the test's config is invalid: {e}"));
        let (stop, stopped) = oneshot::channel::<()>();
        let mut task = tokio::spawn(server::run(listeners, config, async move {
            let _ = stopped.await;
        }));
        let http = Http::new();
        for _ in 0..300 {
            if task.is_finished() {
                let result = (&mut task).await;
                panic!("railguard stopped during start-up: {result:?}");
            }
            if let Ok((StatusCode::OK, _)) = http
                .get(&format!("http://{}{}", self.admin, self.wait_for))
                .await
            {
                self.running = Some(Running::InProcess { stop, task });
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("railguard did not become ready");
    }

    /// A connection to railguard's database, if the test can reach it: made as railguard
    /// makes its own (TLS as the URL asks, each server a URL names tried in turn).
    async fn database(
        &self,
    ) -> Option<Result<tokio_postgres::Client, railguard::db::ConnectError>> {
        // The embedded server listens on a socket in its data directory only.
        let url = match (
            self.database_url.as_str(),
            self.env.get("RAILGUARD__DATABASE__DATA_DIR"),
        ) {
            ("embedded", Some(dir)) => {
                format!("host='{dir}' port=5432 user=railguard dbname=postgres")
            }
            ("embedded", None) => return None,
            (url, _) => url.to_string(),
        };
        let mut connect = railguard::tls::postgres::connect_config(&url)
            .unwrap_or_else(|e| panic!("the test's database URL: {e}"));
        connect
            .config
            .connect_timeout(std::time::Duration::from_secs(10));
        let connected = railguard::db::establish(&connect.config, connect.tls).await;
        Some(connected.map(|(client, conn)| {
            tokio::spawn(conn);
            client
        }))
    }

    /// Tests that present made-up tokens with proofs (`pay_with`) model grants that were
    /// issued, but the token source never drew them. Before a restart, the sequence is moved
    /// past the marks they left, as `railguard fast-forward` would; otherwise the guard would
    /// rightly refuse to start granting. `start_again_unready` does not do this.
    async fn cover_made_up_tokens(&self) {
        // A database that is down (an embedded one after stop) was covered before the stop.
        let Some(Ok(client)) = self.database().await else {
            return;
        };
        let moved = client
            .query(
                "SELECT setval('fencing_token_seq', m.mark, true) \
                 FROM (SELECT COALESCE(max(highest_token), 0) AS mark FROM rail_high_water) m, \
                      fencing_token_seq s \
                 WHERE m.mark > CASE WHEN s.is_called THEN s.last_value ELSE s.last_value - 1 END",
                &[],
            )
            .await;
        if let Err(e) = moved {
            // A database railguard has not migrated yet has nothing to cover.
            if e.code() != Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
                panic!("cannot move the token source past the test's marks: {e}");
            }
        }
    }

    async fn read_proof_key(&self) -> Option<Arc<ProofKey>> {
        let client = self
            .database()
            .await?
            .expect("the test reaches railguard's database");
        let row = client
            .query_one(
                "SELECT value FROM railguard_secret WHERE name = 'grant_proof'",
                &[],
            )
            .await
            .expect("railguard created its proof key");
        Some(Arc::new(ProofKey::from_bytes(&row.get::<_, Vec<u8>>(0))))
    }

    /// Pays `token` on `account` through this railguard, with its grant's proof, in a task of
    /// its own: a request the test lets travel (held in a relay, say) while it goes on.
    pub fn pay_in_background(&self, token: i64, account: &str) -> JoinHandle<crate::Reply> {
        self.payment(account, token).body("{}").spawn()
    }

    /// A payment of `token` on `account` through this railguard's proxy, with the grant's
    /// proof: a builder the test adds a key, a body, headers and the status it must get to.
    pub fn payment(&self, account: &str, token: i64) -> crate::payment::Payment {
        crate::payment::Payment::new(self, account, token)
    }

    /// [`proof`](Self::proof), or none when the test cannot read railguard's proof key (an
    /// embedded database it does not reach).
    pub(crate) fn proof_if_known(&self, account: &str, token: i64) -> Option<String> {
        let token = railguard::token::FencingToken::new(token)?;
        Some(self.proofs.as_ref()?.sign(account, token))
    }

    /// The proof a grant of lock key `account` (the default mapping) with `token` carries.
    pub fn proof(&self, account: &str, token: i64) -> String {
        let token = railguard::token::FencingToken::new(token).expect("a valid token");
        self.proofs
            .as_ref()
            .expect("a railguard on a postgres:// database")
            .sign(account, token)
    }

    /// An HTTP/1.1 client that adds the grant proof to payments, like a worker with a grant.
    pub fn http(&self) -> Http {
        Http::new().with_proofs(self.proofs.clone())
    }

    /// The same over HTTP/2.
    pub fn http2(&self) -> Http {
        Http::http2().with_proofs(self.proofs.clone())
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("railguard.toml")
    }

    /// Where the child process's log is written (see [`Railguard::log`]): readable while the
    /// railguard itself is busy elsewhere (stopping in a task of its own, say).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("railguard.log")
    }

    /// The child process's log (stdout and stderr, JSON lines). A railguard in this process
    /// logs into the test's own output instead, and has none of its own.
    pub fn log(&self) -> String {
        if !self.process {
            return "(railguard ran in the test process: its log is the test's output; a test \
                    that reads the log needs start_process)"
                .into();
        }
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Waits (10 s at most) until the child process's log, from byte `from` on (an earlier
    /// `log().len()`), holds `text`; that part of the log. Fails the test, showing it, if not.
    pub async fn logged_since(&self, from: usize, text: &str) -> String {
        let found = crate::within(Duration::from_secs(10), || async {
            let log = self.log();
            log.get(from..)
                .filter(|since| since.contains(text))
                .map(str::to_string)
        })
        .await;
        found.unwrap_or_else(|_| {
            let log = self.log();
            panic!(
                "railguard did not log {text:?}:\n{}",
                log.get(from..).unwrap_or(&log)
            )
        })
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let child = Command::new(binary())
            .arg("serve")
            .arg("--config")
            .arg(self.config_path())
            .envs(&self.env)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn railguard");
        self.running = Some(Running::Process(child));
        let http = Http::new();
        for _ in 0..300 {
            let Some(Running::Process(child)) = self.running.as_mut() else {
                unreachable!("just spawned")
            };
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "railguard exited during start-up ({status}):\n{}",
                    self.log()
                );
            }
            if let Ok((StatusCode::OK, _)) = http
                .get(&format!("http://{}{}", self.admin, self.wait_for))
                .await
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("railguard did not become ready:\n{}", self.log());
    }

    /// Stops it as an operator would: SIGTERM for a process (then waits for its exit), the
    /// shutdown future in this process. Either way in-flight requests drain first.
    pub async fn stop(&mut self) -> ExitStatus {
        self.cover_made_up_tokens().await;
        match self.running.take().expect("running") {
            Running::Process(mut child) => {
                let pid = child.id().unwrap();
                Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status()
                    .await
                    .unwrap();
                tokio::time::timeout(Duration::from_secs(20), child.wait())
                    .await
                    .expect("railguard exits after SIGTERM")
                    .unwrap()
            }
            Running::InProcess { stop, task } => {
                let _ = stop.send(());
                let result = tokio::time::timeout(Duration::from_secs(20), task)
                    .await
                    .expect("railguard stops after shutdown")
                    .expect("the server task did not panic");
                match result {
                    Ok(()) => ExitStatus::from_raw(0),
                    Err(e) => {
                        tracing::warn!(error = %e, "railguard stopped with an error");
                        ExitStatus::from_raw(1 << 8)
                    }
                }
            }
        }
    }

    /// Stops cleanly and starts again.
    pub async fn restart(&mut self) {
        let status = self.stop().await;
        assert!(status.success(), "railguard stopped cleanly: {status}");
        self.cover_made_up_tokens().await;
        self.run().await;
    }

    /// SIGKILL: a crash, no draining. Only a process can crash.
    pub async fn kill(&mut self) {
        assert!(self.process, "a crash needs start_process");
        if let Some(Running::Process(mut child)) = self.running.take() {
            let _ = child.kill().await;
        }
    }

    /// Starts again after `stop` or `kill`, with the same config.
    pub async fn start_again(&mut self) {
        assert!(self.running.is_none(), "railguard is still running");
        self.cover_made_up_tokens().await;
        self.run().await;
    }

    /// Starts again after `stop` or `kill` and waits only until it answers (`/healthz`), for a
    /// start that is expected not to become ready (a token source behind the marks, say).
    pub async fn start_again_unready(&mut self) {
        assert!(self.running.is_none(), "railguard is still running");
        self.wait_for = "/healthz";
        self.run().await;
        self.wait_for = "/readyz";
    }

    /// The process id while it runs as a process (for SIGSTOP/SIGCONT).
    pub fn pid(&self) -> Option<u32> {
        match &self.running {
            Some(Running::Process(child)) => child.id(),
            _ => None,
        }
    }

    /// Changes one `RAILGUARD__…` override for the next start (a config change rolled out by
    /// a restart).
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.insert(key.to_string(), value.to_string());
    }

    /// `railguard idempotency-forget` against this railguard, as an operator runs it.
    pub async fn forget(&self, account: &str, key: &str) -> std::process::Output {
        self.forget_with(account, key, &[]).await
    }

    /// `railguard idempotency-forget` with more arguments (`--owner-stopped N`).
    pub async fn forget_with(
        &self,
        account: &str,
        key: &str,
        more: &[&str],
    ) -> std::process::Output {
        Command::new(binary())
            .args([
                "idempotency-forget",
                "--account",
                account,
                "--key",
                key,
                "--config",
            ])
            .arg(self.config_path())
            .args(more)
            .output()
            .await
            .unwrap()
    }

    /// The instance the latest start of this process logged as the owner of its idempotency
    /// records, as an operator finds it in the log.
    pub fn instance(&self) -> Option<i64> {
        self.log()
            .lines()
            .rev()
            .filter(|line| line.contains("holding this process's instance lock as instance"))
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find_map(|v| v["fields"]["instance"].as_i64().or(v["instance"].as_i64()))
    }

    pub fn lock_url(&self) -> String {
        format!("http://{}", self.lock)
    }

    pub fn lock_client(&self) -> railguard::sdk::LockClient {
        railguard::sdk::LockClient::new(self.lock_url()).with_timeout(Duration::from_secs(3))
    }

    pub fn proxy_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    /// Waits (10 s at most) until the series `series` of the admin listener's metrics is at
    /// least `value`, and returns what it is then (a test checks it did not pass `value`).
    pub async fn metric_reaches(&self, series: &str, value: f64) -> f64 {
        let _ = crate::within(Duration::from_secs(10), || async {
            (self.metrics().await.get(series) >= value).then_some(())
        })
        .await;
        self.metrics().await.get(series)
    }

    pub async fn metrics(&self) -> Metrics {
        let (status, text) = Http::new()
            .get(&format!("http://{}/metrics", self.admin))
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        Metrics::parse(&text)
    }
}

/// The `railguard` binary next to the running executable: an integration test runs from
/// `target/<profile>/deps/`, the benchmark from `target/<profile>/`, and cargo builds the
/// binary into `target/<profile>/` for both. `RAILGUARD_BIN` overrides.
/// `railguard ARGS --config CONFIG` with `env`, as an operator runs it (RUST_LOG unset).
pub fn run_command(args: &[&str], config: &Path, env: &[(&str, &str)]) -> std::process::Output {
    std::process::Command::new(binary())
        .args(args)
        .arg("--config")
        .arg(config)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .output()
        .expect("run the railguard binary")
}

#[allow(clippy::disallowed_methods)] // a test harness finds the binary it runs
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("RAILGUARD_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the running executable's path");
    let mut dir = exe
        .parent()
        .expect("the executable's directory")
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let binary = dir.join("railguard");
    assert!(
        binary.is_file(),
        "no railguard binary at {} (build it, or set RAILGUARD_BIN)",
        binary.display()
    );
    binary
}
