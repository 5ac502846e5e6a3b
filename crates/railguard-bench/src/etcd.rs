//! A throwaway single-member etcd from Debian's `etcd-server` (3.4) for the etcd lock phases.
//!
//! It listens on free loopback ports and keeps its data under /var/tmp (not a tmpfs), so its
//! writes are fsynced as in production: etcd 3.4 has no switch to turn that off. Timings are
//! the test harness's (25 ms heartbeat, 250 ms election timeout), which makes a lone member
//! its own leader well under a second after start.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use http::StatusCode;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::bench::BenchError;
use crate::load::Connection;
use railguard_testkit::free_loopback_port;

const ETCD: &str = "/usr/bin/etcd";
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running member; killed when stopped or dropped.
pub(crate) struct EtcdNode {
    pub endpoint: String,
    child: Child,
    log: std::path::PathBuf,
}

impl EtcdNode {
    /// Starts a member with its data and log in `dir` and waits until `/health` says so.
    pub(crate) async fn start(dir: &Path) -> Result<Self, BenchError> {
        let client_port = free_loopback_port();
        let peer_port = loop {
            let port = free_loopback_port();
            if port != client_port {
                break port;
            }
        };
        let endpoint = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = dir.join("etcd.log");
        let io = |source| BenchError::Io {
            what: "cannot create the etcd log",
            source,
        };
        let log_file = std::fs::File::create(&log).map_err(io)?;
        let log_err = log_file.try_clone().map_err(io)?;
        let child = Command::new(ETCD)
            .args(["--name", "bench"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("bench={peer}")])
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "25", "--election-timeout", "250"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| BenchError::Io {
                what: "cannot start /usr/bin/etcd (Debian package etcd-server)",
                source,
            })?;
        let mut node = Self {
            endpoint,
            child,
            log,
        };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, client_port));
        let mut connection = Connection::new(addr);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(status)) = node.child.try_wait() {
                return Err(BenchError::Setup(format!(
                    "etcd exited during start-up ({status}); its log: {}",
                    node.log_tail()
                )));
            }
            if let Ok((StatusCode::OK, body)) = connection.request("/health", None).await
                && String::from_utf8_lossy(&body).contains(r#""health":"true""#)
            {
                return Ok(node);
            }
            if Instant::now() > deadline {
                node.stop().await;
                return Err(BenchError::Setup(format!(
                    "etcd was not healthy within {READY_TIMEOUT:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// `3.4.23`, from `etcd --version`.
pub(crate) async fn version() -> String {
    match Command::new(ETCD).arg("--version").output().await {
        Ok(out) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("etcd Version: "))
            .unwrap_or("unknown")
            .trim()
            .to_string(),
        Err(_) => "unknown".into(),
    }
}
