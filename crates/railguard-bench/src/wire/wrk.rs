//! Load from `wrk`, a process of its own: the requests real payment workers send, and wrk's own
//! figures read back from its report.
//!
//! Every request is what a worker sends: `POST /payments` with a JSON body, the fencing token,
//! the account (uniform over the phase's accounts) and the grant proof for that pair, and — in
//! the phases that say so — an `Idempotency-Key` unique across the whole run (`<run>-<thread>-
//! <n>`). The proofs are computed here, once, and written into the Lua script as a table, so
//! wrk spends no time on HMACs and every proxy sees exactly the bytes a worker would send.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use crate::load::BODY;

/// The requests of one phase.
#[derive(Debug, Clone)]
pub(crate) struct Requests {
    /// Accounts `{prefix}1..={count}`.
    pub prefix: &'static str,
    pub count: u64,
    pub token: i64,
    /// Send an `Idempotency-Key` with every request.
    pub keys: bool,
}

impl Requests {
    /// Writes the Lua script for these requests into `dir`; returns its path.
    pub(crate) fn script(&self, dir: &Path, name: &str) -> Result<PathBuf, String> {
        let proofs = railguard::proof::ProofKey::from_bytes(&crate::load::BENCH_PROOF_KEY);
        let token = railguard::token::FencingToken::new(self.token)
            .ok_or_else(|| format!("token {} is not a fencing token", self.token))?;
        let mut lua = String::from("local accounts = {\n");
        for n in 1..=self.count.max(1) {
            let account = format!("{}{n}", self.prefix);
            let proof = proofs.sign(&account, token);
            let _ = writeln!(lua, "  {{\"{account}\", \"{proof}\"}},");
        }
        let body = std::str::from_utf8(BODY).map_err(|e| e.to_string())?;
        let _ = write!(
            lua,
            r#"}}
local token = "{token}"
local keys = {keys}
local body = '{body}'
local counter = 0
local prefix = ""
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function init(args)
  prefix = (args[1] or "run") .. "-" .. tostring(tid) .. "-"
  math.randomseed(tid * 7919 + os.time())
end

function request()
  counter = counter + 1
  local a = accounts[math.random(#accounts)]
  local headers = {{
    ["Content-Type"] = "application/json",
    ["Fencing-Token"] = token,
    ["Fencing-Account"] = a[1],
    ["Fencing-Proof"] = a[2],
  }}
  if keys then
    headers["Idempotency-Key"] = prefix .. counter
  end
  return wrk.format("POST", "/payments", headers, body)
end
"#,
            token = self.token,
            keys = self.keys,
        );
        let path = dir.join(format!("{name}.lua"));
        std::fs::write(&path, lua).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(path)
    }
}

/// One wrk run.
#[derive(Debug, Clone)]
pub(crate) struct Wrk {
    pub target: SocketAddr,
    pub script: PathBuf,
    pub connections: usize,
    pub duration: Duration,
    /// Makes this run's idempotency keys its own.
    pub run_id: String,
}

/// What wrk reported.
#[derive(Debug, Clone, Default)]
pub(crate) struct WrkResult {
    pub requests: u64,
    pub rate: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Answers outside 2xx and 3xx.
    pub non_2xx: u64,
    /// Connect, read, write and timeout errors.
    pub socket_errors: u64,
}

impl Wrk {
    /// Runs wrk to its end; killed if it overstays its duration by 30 s.
    pub(crate) async fn run(&self) -> Result<WrkResult, String> {
        let threads = self.connections.clamp(1, 2);
        let secs = self.duration.as_secs().max(1);
        let mut command = Command::new("wrk");
        command
            .args(["-t", &threads.to_string()])
            .args(["-c", &self.connections.to_string()])
            .args(["-d", &format!("{secs}s")])
            .args(["--timeout", "10s", "--latency", "-s"])
            .arg(&self.script)
            .arg(format!("http://{}/payments", self.target))
            .arg("--")
            .arg(&self.run_id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot run wrk (apt-get install wrk): {e}"))?;
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let finished = tokio::time::timeout(Duration::from_secs(secs + 30), async {
            let (out, err) = tokio::try_join!(read_all(stdout), read_all(stderr))?;
            Ok::<_, std::io::Error>((child.wait().await?, out, err))
        })
        .await;
        let Ok(finished) = finished else {
            // Killed and waited for here: a wrk reaped later would add its CPU time to whatever
            // phase is being measured then (the wire suite reads wrk's time from reaped children).
            let _ = child.kill().await;
            return Err(format!("wrk did not end within {}s", secs + 30));
        };
        let (status, stdout, stderr) =
            finished.map_err(|e| format!("reading wrk's output: {e}"))?;
        let output = std::process::Output {
            status,
            stdout,
            stderr,
        };
        let text = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(format!(
                "wrk failed ({}): {}{}",
                output.status,
                text.trim(),
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        parse(&text)
    }
}

/// Everything a child's pipe gives until it closes.
async fn read_all(pipe: Option<impl AsyncRead + Unpin>) -> std::io::Result<Vec<u8>> {
    let mut all = Vec::new();
    if let Some(mut pipe) = pipe {
        pipe.read_to_end(&mut all).await?;
    }
    Ok(all)
}

/// Reads wrk's report (with `--latency`).
pub(crate) fn parse(text: &str) -> Result<WrkResult, String> {
    let mut result = WrkResult::default();
    let mut saw_rate = false;
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["50%", value] => result.p50_us = duration_us(value)?,
            ["99%", value] => result.p99_us = duration_us(value)?,
            [n, "requests", "in", ..] => {
                result.requests = n.parse().map_err(|_| format!("bad count in {line:?}"))?;
            }
            ["Requests/sec:", value] => {
                result.rate = value.parse().map_err(|_| format!("bad rate in {line:?}"))?;
                saw_rate = true;
            }
            ["Non-2xx", "or", "3xx", "responses:", n] => {
                result.non_2xx = n.parse().map_err(|_| format!("bad count in {line:?}"))?;
            }
            ["Socket", "errors:", rest @ ..] => {
                result.socket_errors = rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
            }
            _ => {}
        }
    }
    if !saw_rate {
        return Err(format!("no Requests/sec in wrk's report: {}", text.trim()));
    }
    Ok(result)
}

/// `635.00us`, `1.23ms`, `2.00s` → microseconds.
fn duration_us(value: &str) -> Result<f64, String> {
    let split = value
        .find(|c: char| c.is_ascii_alphabetic())
        .ok_or_else(|| format!("no unit in {value:?}"))?;
    let (number, unit) = value.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("bad number {value:?}"))?;
    let scale = match unit {
        "us" => 1.0,
        "ms" => 1_000.0,
        "s" => 1_000_000.0,
        "m" => 60_000_000.0,
        _ => return Err(format!("unknown unit in {value:?}")),
    };
    Ok(number * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "Running 5s test @ http://127.0.0.1:8080/payments
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.10ms    1.01ms  30.00ms   90.00%
    Req/Sec    15.00k     1.00k   17.00k    70.00%
  Latency Distribution
     50%  635.00us
     75%    1.20ms
     90%    2.50ms
     99%    1.02s
  150123 requests in 5.00s, 20.00MB read
  Socket errors: connect 0, read 2, write 1, timeout 4
  Non-2xx or 3xx responses: 17
Requests/sec:  30024.60
Transfer/sec:      4.00MB
";

    #[test]
    fn reads_wrks_report() {
        let r = parse(REPORT).unwrap();
        assert_eq!(r.requests, 150_123);
        assert!((r.rate - 30_024.6).abs() < 1e-6);
        assert!((r.p50_us - 635.0).abs() < 1e-6);
        assert!((r.p99_us - 1_020_000.0).abs() < 1e-6);
        assert_eq!(r.non_2xx, 17);
        assert_eq!(r.socket_errors, 7);
    }

    #[test]
    fn a_report_without_a_rate_is_an_error() {
        assert!(parse("unable to connect to 127.0.0.1:1 Connection refused").is_err());
    }

    #[test]
    fn the_script_carries_a_proof_per_account_and_keys_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let requests = Requests {
            prefix: "acct-",
            count: 3,
            token: 7,
            keys: false,
        };
        let text = std::fs::read_to_string(requests.script(dir.path(), "a").unwrap()).unwrap();
        assert_eq!(text.matches("{\"acct-").count(), 3);
        assert!(text.contains("local keys = false"));
        let keyed = Requests {
            keys: true,
            ..requests
        };
        let text = std::fs::read_to_string(keyed.script(dir.path(), "b").unwrap()).unwrap();
        assert!(text.contains("local keys = true"));
    }
}
