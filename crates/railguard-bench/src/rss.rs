//! The proxy's memory with many open client connections, measured on a `railguard serve`
//! process of its own (this binary, started with a temporary config), so that nothing of the
//! bench process — load generator, rail simulator, other proxies — is counted.
//!
//! The child proxies to the bench's rail simulator and uses the bench's PostgreSQL. Once it
//! is ready, `connections` keep-alive HTTP/1.1 connections are opened to it at once, each sends
//! one fenced payment (all must be accepted), and all stay open while VmRSS and VmHWM are read
//! from `/proc/<pid>/status`. The child is killed afterwards.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use http::StatusCode;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::bench::{ACCOUNT_PREFIX, TOKEN, proxy_config};
use crate::load::Connection;
use railguard_testkit::free_loopback_port;

const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The target.
pub(crate) const TARGET_BYTES: u64 = 100_000_000;

/// What the child's memory was.
#[derive(Debug, Clone, Default)]
pub(crate) struct RssResult {
    pub connections: usize,
    /// Connections whose payment was accepted (201).
    pub accepted: usize,
    /// VmRSS once ready, before any connection.
    pub idle_kib: u64,
    /// VmRSS with every connection open.
    pub open_kib: u64,
    /// VmHWM at the same moment: the most the process ever had resident.
    pub peak_kib: u64,
    /// The child's open file descriptors at the same moment: shows the connections were
    /// still open on its side (each client connection is one socket there).
    pub open_fds: usize,
    pub problems: Vec<String>,
}

/// Runs the measurement; `Err` when the child could not be started or measured at all.
pub(crate) async fn measure(
    work_dir: &Path,
    rail: SocketAddr,
    database_url: &str,
    pool_size: usize,
    connections: usize,
) -> Result<RssResult, String> {
    let mut config = proxy_config(pool_size);
    let port = || SocketAddr::from((Ipv4Addr::LOCALHOST, free_loopback_port()));
    config.proxy.listen = port();
    config.admin.listen = port();
    config.lock.listen = port();
    config.proxy.upstream = railguard::config::Upstream::parse(&format!("http://{rail}"))?;
    config.database.url = railguard::config::DatabaseUrl::Postgres(database_url.to_string());
    config.log.level = "error".into();
    let text = toml::to_string(&config).map_err(|e| format!("cannot write the config: {e}"))?;
    let config_path = work_dir.join("rss-serve.toml");
    std::fs::write(&config_path, text)
        .map_err(|e| format!("cannot write {}: {e}", config_path.display()))?;
    let log_path = work_dir.join("rss-serve.log");
    let log = std::fs::File::create(&log_path).map_err(|e| format!("serve log: {e}"))?;
    let log_err = log.try_clone().map_err(|e| format!("serve log: {e}"))?;
    let exe = railguard_testkit::railguard_binary();
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start `railguard serve`: {e}"))?;
    let result = with_child(
        &mut child,
        config.admin.listen,
        config.proxy.listen,
        connections,
    )
    .await;
    let _ = child.kill().await;
    result.map_err(|why| {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        format!("{why}; its log ends: {}", tail.join(" | "))
    })
}

async fn with_child(
    child: &mut Child,
    admin: SocketAddr,
    proxy: SocketAddr,
    connections: usize,
) -> Result<RssResult, String> {
    let pid = child.id().ok_or("the child has no pid")?;
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut probe = Connection::new(admin);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "`railguard serve` exited during start-up ({status})"
            ));
        }
        if let Ok((StatusCode::OK, _)) = probe.request("/readyz", None).await {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "`railguard serve` not ready within {READY_TIMEOUT:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(probe);
    let idle_kib = status_kib(pid, "VmRSS:").ok_or("cannot read the child's VmRSS")?;

    // All at once, as a burst of new clients would arrive.
    let workers: Vec<_> = (0..connections)
        .map(|i| {
            tokio::spawn(async move {
                let mut connection = Connection::new(proxy);
                let account = format!("{ACCOUNT_PREFIX}{}", i + 1);
                let outcome = connection.send(&account, TOKEN).await;
                (connection, outcome)
            })
        })
        .collect();
    let mut open = Vec::with_capacity(connections);
    let mut result = RssResult {
        connections,
        idle_kib,
        ..RssResult::default()
    };
    let mut first_problem = None;
    let mut failed = 0;
    for worker in workers {
        match worker.await {
            Ok((connection, Ok(StatusCode::CREATED))) => {
                result.accepted += 1;
                open.push(connection);
            }
            Ok((_, Ok(status))) => {
                failed += 1;
                first_problem.get_or_insert_with(|| format!("status {status}"));
            }
            Ok((_, Err(e))) => {
                failed += 1;
                first_problem.get_or_insert_with(|| e.to_string());
            }
            Err(e) => {
                failed += 1;
                first_problem.get_or_insert_with(|| e.to_string());
            }
        }
    }
    if failed > 0 {
        result.problems.push(format!(
            "{failed} of {connections} connections did not get a 201 (first: {})",
            first_problem.unwrap_or_default()
        ));
    }
    // Let the child finish whatever it does after answering (the last forwards' bookkeeping).
    tokio::time::sleep(Duration::from_millis(500)).await;
    result.open_kib = status_kib(pid, "VmRSS:").ok_or("cannot read the child's VmRSS")?;
    result.peak_kib = status_kib(pid, "VmHWM:").ok_or("cannot read the child's VmHWM")?;
    result.open_fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    if let Ok(Some(status)) = child.try_wait() {
        result.problems.push(format!(
            "`railguard serve` exited during the measurement ({status})"
        ));
    }
    drop(open);
    Ok(result)
}

/// A `kB` field of `/proc/<pid>/status`.
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
