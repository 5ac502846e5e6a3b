//! `perf record` of a proxy process while wrk loads it (`--profile-dir`), for the grouped
//! profiles in `docs/performance.md`.
//!
//! Sampling is on the `cpu-clock` software event (these machines have no hardware counters),
//! with DWARF call graphs (frame-pointer stacks of a release build are broken). The proxy and
//! its children (nginx's workers) are all sampled.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use railguard_testkit::children_of;
use tokio::process::{Child, Command};

/// A running `perf record`.
pub(crate) struct Profile(Child);

/// Starts `perf record` on `pid` and its children for `duration`, writing
/// `<dir>/<phase label>.perf.data`.
pub(crate) fn start(
    dir: &Path,
    label: &str,
    pid: u32,
    duration: Duration,
) -> Result<Profile, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let name: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let pids: Vec<String> = std::iter::once(pid)
        .chain(children_of(pid))
        .map(|p| p.to_string())
        .collect();
    let child = Command::new("perf")
        .args([
            "record",
            "-q",
            "-e",
            "cpu-clock",
            "-F",
            "499",
            "--call-graph",
            "dwarf,16384",
        ])
        .arg("-o")
        .arg(dir.join(format!("{name}.perf.data")))
        .arg("-p")
        .arg(pids.join(","))
        .arg("--")
        .arg("sleep")
        .arg(duration.as_secs().max(1).to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run perf (apt-get install linux-perf): {e}"))?;
    Ok(Profile(child))
}

impl Profile {
    /// Waits for perf to write its file.
    pub(crate) async fn finish(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(120), self.0.wait()).await;
    }
}
