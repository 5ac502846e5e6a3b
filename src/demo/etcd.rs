//! A throwaway single-member etcd for `railguard demo --backend etcd`: its own temp dir, free
//! loopback client and peer ports, killed and removed when the demo ends.
//!
//! The test kit has a richer launcher (`railguard-testkit`'s `EtcdCluster`), but the test kit
//! depends on this crate, so the demo cannot use it; this is the small part it needs.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};

use super::ports::{LoopbackPort, claim_loopback_port};
use super::{DemoError, HttpGet};

/// How long a fresh member may take to report healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts with fresh ports, should a port be taken between claiming it and etcd's bind.
const ATTEMPTS: usize = 3;

/// A running etcd member.
pub(crate) struct Etcd {
    // Dropped before `dir`: kill_on_drop ends the process, then the data dir is removed.
    child: Child,
    endpoint: String,
    dir: TempDir,
    /// Its client and peer ports, claimed for as long as it runs.
    _ports: [LoopbackPort; 2],
}

/// The first executable `etcd` in `search_path` (a `PATH` value).
pub(crate) fn find(search_path: Option<&OsStr>) -> Option<PathBuf> {
    std::env::split_paths(search_path?)
        .map(|dir| dir.join("etcd"))
        .find(|path| {
            std::fs::metadata(path)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

impl Etcd {
    /// Starts `binary` as a one-member cluster and waits until it reports healthy.
    pub(crate) async fn start(binary: &Path, http: &HttpGet) -> Result<Etcd, DemoError> {
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let mut etcd = Self::spawn(binary)?;
            match etcd.wait_healthy(http).await {
                Ok(()) => return Ok(etcd),
                Err(why) => {
                    last = why;
                    etcd.stop().await;
                }
            }
        }
        Err(DemoError::Etcd(last))
    }

    fn spawn(binary: &Path) -> Result<Etcd, DemoError> {
        let io = |what: &str, e: std::io::Error| DemoError::Etcd(format!("{what}: {e}"));
        let dir = tempfile::Builder::new()
            .prefix("railguard-demo-etcd-")
            .tempdir()
            .map_err(|e| io("cannot create its temp dir", e))?;
        let port = || claim_loopback_port().map_err(|e| io("no loopback port for it", e));
        let ports = [port()?, port()?];
        let (client_port, peer_port) = (ports[0].number(), ports[1].number());
        let endpoint = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))
            .map_err(|e| io("cannot create its log file", e))?;
        let log_err = log.try_clone().map_err(|e| io("its log file", e))?;
        let child = Command::new(binary)
            .args(["--name", "demo"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("demo={peer}")])
            .args(["--initial-cluster-state", "new"])
            .args([
                "--initial-cluster-token",
                &format!("railguard-demo-{}-{client_port}", std::process::id()),
            ])
            // Quick elections; the shortest lease is then one second (1.5 election timeouts,
            // rounded up), so a short demo ttl is not stretched.
            .args(["--heartbeat-interval", "25", "--election-timeout", "250"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| io(&format!("cannot run {}", binary.display()), e))?;
        Ok(Etcd {
            child,
            endpoint,
            dir,
            _ports: ports,
        })
    }

    async fn wait_healthy(&mut self, http: &HttpGet) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let url = format!("{}/health", self.endpoint);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "etcd exited during start-up ({status}); its log:\n{}",
                    self.log_tail()
                ));
            }
            if let Ok((status, body)) = http.get(&url, Duration::from_secs(1)).await
                && status.is_success()
                && body.contains("\"health\":\"true\"")
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "etcd not healthy after {READY_TIMEOUT:?}; its log:\n{}",
                    self.log_tail()
                ));
            }
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// The client URL.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Kills the member, waits for it, and removes its data dir.
    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
        if let Err(e) = self.dir.close() {
            tracing::warn!(error = %e, "cannot remove the demo etcd's temp dir");
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}
