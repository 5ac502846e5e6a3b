//! railguard itself, as a test starts it: `railguard serve` with a config file written for the
//! test and `RAILGUARD__…` overrides on top.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use railguard::proof::ProofKey;
use tempfile::TempDir;
use tokio::process::{Child, Command};

use crate::{Http, Metrics, free_loopback_port};

/// `railguard serve`, as a child process.
pub struct Railguard {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub lock: SocketAddr,
    child: Option<Child>,
    dir: TempDir,
    env: BTreeMap<String, String>,
    database_url: String,
    /// The database's grant-proof key, so that a test can present tokens as the lock service
    /// would have granted them (the proxy's tests send tokens they choose).
    proofs: Option<Arc<ProofKey>>,
}

impl Railguard {
    /// Starts railguard against `database_url` and `upstream`, with extra `RAILGUARD__…`
    /// overrides, and waits until /readyz says ready.
    pub async fn start(database_url: &str, upstream: &str, env: &[(&str, &str)]) -> Railguard {
        let dir = tempfile::Builder::new()
            .prefix("railguard-rg-")
            .tempdir()
            .expect("temp dir");
        let proxy: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let lock: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let config = format!(
            "[proxy]\nlisten = \"{proxy}\"\nupstream = \"{upstream}\"\nrequest_timeout_ms = 3000\n\
             [admin]\nlisten = \"{admin}\"\n\
             [lock]\nlisten = \"{lock}\"\n\
             [database]\nurl = \"{database_url}\"\ntimeout_ms = 1000\npool_size = 8\n\
             [log]\nformat = \"json\"\nlevel = \"info\"\n\
             [shutdown]\ngrace_ms = 3000\n"
        );
        std::fs::write(dir.path().join("railguard.toml"), config).unwrap();
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut rg = Railguard {
            proxy,
            admin,
            lock,
            child: None,
            dir,
            env,
            database_url: database_url.to_string(),
            proofs: None,
        };
        rg.spawn().await;
        rg.proofs = rg.read_proof_key().await;
        rg
    }

    async fn read_proof_key(&self) -> Option<Arc<ProofKey>> {
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
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("the test reaches railguard's database");
        tokio::spawn(conn);
        let row = client
            .query_one(
                "SELECT value FROM railguard_secret WHERE name = 'grant_proof'",
                &[],
            )
            .await
            .expect("railguard created its proof key");
        Some(Arc::new(ProofKey::from_bytes(&row.get::<_, Vec<u8>>(0))))
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

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("railguard.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
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
        self.child = Some(child);
        let http = Http::new();
        for _ in 0..300 {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "railguard exited during start-up ({status}):\n{}",
                    self.log()
                );
            }
            if let Ok((StatusCode::OK, _)) =
                http.get(&format!("http://{}/readyz", self.admin)).await
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("railguard did not become ready:\n{}", self.log());
    }

    /// SIGTERM, then wait for a clean exit.
    pub async fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
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

    pub async fn restart(&mut self) {
        let status = self.stop().await;
        assert!(
            status.success(),
            "railguard stopped cleanly: {status}\n{}",
            self.log()
        );
        self.spawn().await;
    }

    /// SIGKILL: a crash, no draining.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Starts again after `stop` or `kill`, on the same ports and config.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "railguard is still running");
        self.spawn().await;
    }

    /// `railguard idempotency-forget` against this railguard, as an operator runs it.
    pub async fn forget(&self, account: &str, key: &str) -> std::process::Output {
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
            .output()
            .await
            .unwrap()
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
