//! A throwaway Prometheus server from Debian's `prometheus` package, for tests that check the
//! alerting rules against a real railguard: it scrapes the targets a test names every second,
//! evaluates the rule files every second, keeps its TSDB and its log in a temp dir, and is
//! killed when dropped.
//!
//! Tests read it through its HTTP API (`/api/v1/...`), as an operator's tools would.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use http::StatusCode;
use serde_json::Value;
use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep};

use crate::{Http, free_loopback_port};

const PROMETHEUS: &str = "/usr/bin/prometheus";
/// How long it may take to report ready (it replays an empty TSDB: well under a second).
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Ports taken between the check and Prometheus's bind are retried this many times.
const BIND_ATTEMPTS: usize = 5;

/// A running Prometheus; see the module docs.
pub struct Prometheus {
    // Dropped before `dir`: kill_on_drop sends SIGKILL, then the TSDB is removed.
    child: Child,
    addr: SocketAddr,
    http: Http,
    dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` in a job named `job` and evaluating `rule_files`,
    /// both every second, and waits until it is ready. Panics, saying how to install it, when
    /// the binary is missing.
    pub async fn start(job: &str, targets: &[SocketAddr], rule_files: &[PathBuf]) -> Prometheus {
        assert!(
            Path::new(PROMETHEUS).is_file(),
            "{PROMETHEUS} is missing: run scripts/deps.sh --test (it installs Debian's \
             prometheus package)"
        );
        let mut dir = tempfile::Builder::new()
            .prefix("railguard-prometheus-")
            .tempdir()
            .expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, config_text(job, targets, rule_files)).unwrap();
        let log = dir.path().join("prometheus.log");
        for _ in 0..BIND_ATTEMPTS {
            let addr = SocketAddr::from(([127, 0, 0, 1], free_loopback_port()));
            let child = Command::new(PROMETHEUS)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .kill_on_drop(true)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {PROMETHEUS}: {e}"));
            let mut prometheus = Prometheus {
                child,
                addr,
                http: Http::new(),
                dir,
            };
            match prometheus.wait_ready().await {
                Ok(()) => return prometheus,
                Err(exited) => {
                    let log = prometheus.log();
                    if exited && log.contains("address already in use") {
                        dir = prometheus.into_dir();
                        continue;
                    }
                    panic!("Prometheus did not become ready:\n{log}");
                }
            }
        }
        panic!("Prometheus found no free port in {BIND_ATTEMPTS} attempts");
    }

    /// Polls `/-/ready`; `Err(true)` if the process exited, `Err(false)` on the timeout.
    async fn wait_ready(&mut self) -> Result<(), bool> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return Err(true);
            }
            if let Ok((StatusCode::OK, _)) = self.http.get(&self.url("/-/ready")).await {
                return Ok(());
            }
            sleep(Duration::from_millis(100)).await;
        }
        Err(false)
    }

    fn into_dir(self) -> TempDir {
        let Prometheus { child, dir, .. } = self;
        drop(child);
        dir
    }

    /// Its log (stderr), for a failing test's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// GET `path` (with its query string) from the HTTP API: the `data` of a `success`
    /// answer, or the error Prometheus gave.
    pub async fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = self.http.get(&self.url(path)).await?;
        let answer: Value =
            serde_json::from_str(&body).map_err(|e| format!("{status}, not JSON ({e}): {body}"))?;
        if status == StatusCode::OK && answer["status"] == "success" {
            Ok(answer["data"].clone())
        } else {
            Err(format!("{status}: {body}"))
        }
    }

    /// An instant query: the samples of its result (a vector), or Prometheus's error.
    pub async fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let data = self
            .api(&format!("/api/v1/query?query={}", percent_encode(promql)))
            .await?;
        match data["result"].as_array() {
            Some(samples) if data["resultType"] == "vector" => Ok(samples.clone()),
            _ => Ok(vec![data["result"].clone()]),
        }
    }

    /// Every pending and firing alert (`/api/v1/alerts`).
    pub async fn alerts(&self) -> Vec<Value> {
        let data = self.api("/api/v1/alerts").await.expect("/api/v1/alerts");
        data["alerts"].as_array().cloned().unwrap_or_default()
    }

    /// Every alerting rule of the loaded rule files with its health and last evaluation
    /// (`/api/v1/rules?type=alert`).
    pub async fn alerting_rules(&self) -> Vec<Value> {
        let data = self
            .api("/api/v1/rules?type=alert")
            .await
            .expect("/api/v1/rules");
        data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect()
    }
}

fn config_text(job: &str, targets: &[SocketAddr], rule_files: &[PathBuf]) -> String {
    // JSON strings are YAML strings: no quoting rules of our own.
    let quoted = |s: String| Value::String(s).to_string();
    let rules: Vec<String> = rule_files
        .iter()
        .map(|p| format!("  - {}\n", quoted(p.display().to_string())))
        .collect();
    let targets: Vec<String> = targets.iter().map(|t| quoted(t.to_string())).collect();
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n{}\
         scrape_configs:\n  - job_name: {}\n    static_configs:\n      - targets: [{}]\n",
        rules.concat(),
        quoted(job.to_string()),
        targets.join(", ")
    )
}

/// Percent-encodes everything but RFC 3986's unreserved characters, for a query string.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_percent_encoded() {
        assert_eq!(
            percent_encode("up{job=\"railguard\"} == 0"),
            "up%7Bjob%3D%22railguard%22%7D%20%3D%3D%200"
        );
    }

    #[test]
    fn the_config_scrapes_the_targets_and_loads_the_rules() {
        let text = config_text(
            "railguard",
            &["127.0.0.1:9100".parse().unwrap()],
            &[PathBuf::from("/r/railguard.rules.yml")],
        );
        assert_eq!(
            text,
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - \"/r/railguard.rules.yml\"\n\
             scrape_configs:\n  - job_name: \"railguard\"\n    static_configs:\n      \
             - targets: [\"127.0.0.1:9100\"]\n"
        );
    }
}
