//! The database-only baseline: `pgbench` running the proxy's own compare-and-set.
//!
//! The script is [`ADVANCE_SQL`] with the account and token written in (pgbench has no string
//! variables, so the account is built in SQL as `'acct-' || :aid`), which makes each pgbench
//! transaction the same durable single-row upsert the proxy commits per request, on the same
//! rows the proxy phases write. Latencies come from pgbench's per-transaction log (`--log`), so
//! p50 and p99 are exact, computed the same way as for the HTTP phases.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::load::percentile;
use railguard::db::server::SUPERUSER;
use railguard::store::marks::ADVANCE_SQL;

/// A pgbench run.
#[derive(Debug, Clone)]
pub(crate) struct Pgbench {
    /// Directory holding the `pgbench` binary (the server's `bin_dir`).
    pub bin_dir: PathBuf,
    pub port: u16,
    pub clients: usize,
    pub duration: Duration,
    /// What each transaction runs (see [`cas_script`] and `locks::pgbench_script`).
    pub script: String,
}

/// What pgbench reported.
#[derive(Debug, Default)]
pub(crate) struct PgbenchResult {
    /// pgbench's own figure, which leaves out connection set-up.
    pub tps: f64,
    pub transactions: u64,
    pub failed: u64,
    /// Latency of every transaction that committed, sorted ascending.
    pub latencies_us: Vec<u32>,
}

impl PgbenchResult {
    pub(crate) fn percentile_us(&self, q: f64) -> u32 {
        percentile(&self.latencies_us, q)
    }
}

/// The compare-and-set script: one [`ADVANCE_SQL`] on a uniformly drawn account of
/// `{prefix}1..={accounts}` at `token`.
pub(crate) fn cas_script(accounts: u64, prefix: &str, token: i64) -> String {
    let sql = ADVANCE_SQL
        .replace("$1", &format!("'{prefix}' || :aid"))
        .replace("$2", &token.to_string());
    format!("\\set aid random(1, {})\n{sql};\n", accounts.max(1))
}

impl Pgbench {
    /// Runs pgbench with its files (script and transaction logs) in `work_dir`, which must
    /// be empty of earlier logs. Bounded by `-T` and, should pgbench hang, by a timeout that
    /// kills it.
    pub(crate) async fn run(&self, work_dir: &Path) -> Result<PgbenchResult, String> {
        let script = work_dir.join("script.sql");
        std::fs::write(&script, &self.script)
            .map_err(|e| format!("cannot write {}: {e}", script.display()))?;
        let log_prefix = work_dir.join("txn");
        let secs = self.duration.as_secs().max(1);
        let mut command = Command::new(self.bin_dir.join("pgbench"));
        command
            .args(["-n", "-M", "prepared"])
            .args(["-c", &self.clients.to_string()])
            .args(["-j", &self.clients.clamp(1, 2).to_string()])
            .args(["-T", &secs.to_string()])
            .arg("-f")
            .arg(&script)
            .arg("--log")
            .arg(format!("--log-prefix={}", log_prefix.display()))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                SUPERUSER,
                "postgres",
            ])
            .current_dir(work_dir)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let limit = Duration::from_secs(secs + 60);
        let output = tokio::time::timeout(limit, command.output())
            .await
            .map_err(|_| format!("pgbench did not finish within {limit:?}"))?
            .map_err(|e| format!("cannot run pgbench: {e}"))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tps = parse_tps(&stdout);
        let (Some(tps), true) = (
            tps,
            output.status.success() || output.status.code() == Some(2),
        ) else {
            return Err(format!(
                "pgbench failed ({}): {}",
                output.status,
                stderr.trim()
            ));
        };
        let mut result = PgbenchResult {
            tps,
            ..Default::default()
        };
        for entry in std::fs::read_dir(work_dir)
            .map_err(|e| e.to_string())?
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with("txn.") {
                let text = std::fs::read_to_string(entry.path()).map_err(|e| e.to_string())?;
                parse_log(&text, &mut result);
                let _ = std::fs::remove_file(entry.path());
            }
        }
        result.latencies_us.sort_unstable();
        if result.transactions == 0 {
            return Err(format!(
                "pgbench logged no transactions; its output: {}",
                stderr.trim()
            ));
        }
        Ok(result)
    }
}

/// `tps = 6523.745612 (without initial connection time)`.
fn parse_tps(stdout: &str) -> Option<f64> {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Per-transaction log lines: `client_id transaction_no time script_no time_epoch time_us ...`
/// where `time` is the latency in microseconds, or a word (`failed`, `skipped`, ...) for a
/// transaction that did not commit.
fn parse_log(text: &str, into: &mut PgbenchResult) {
    for line in text.lines() {
        let Some(time) = line.split_whitespace().nth(2) else {
            continue;
        };
        into.transactions += 1;
        match time.parse::<u64>() {
            Ok(us) => into.latencies_us.push(us.min(u64::from(u32::MAX)) as u32),
            Err(_) => into.failed += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_is_the_proxys_compare_and_set() {
        let script = cas_script(10_000, "acct-", 1_000_000);
        assert!(
            script.starts_with("\\set aid random(1, 10000)\n"),
            "{script}"
        );
        assert!(
            script.contains(
                "SELECT 'acct-' || :aid, 1000000 WHERE 1000000 >= (SELECT floor FROM railguard_store_epoch)"
            ),
            "{script}"
        );
        assert!(
            script.contains("WHERE h.highest_token <= EXCLUDED.highest_token;"),
            "{script}"
        );
        assert!(!script.contains('$'), "{script}");
    }

    #[test]
    fn parses_pgbench_output_and_logs() {
        let stdout =
            "latency average = 9.1 ms\ntps = 6523.745612 (without initial connection time)\n";
        assert_eq!(parse_tps(stdout), Some(6523.745612));
        let mut result = PgbenchResult::default();
        parse_log(
            "0 0 812 0 1700000000 1\n1 0 failed 0 1700000000 5\n0 1 640 0 1700000000 9\n",
            &mut result,
        );
        assert_eq!((result.transactions, result.failed), (3, 1));
        assert_eq!(result.latencies_us, vec![812, 640]);
    }
}
