//! `perf record` of a proxy process while wrk loads it (`--profile-dir`), for the grouped
//! profiles in `docs/performance.md`; and `perf stat` of its system calls (`--count-syscalls`).
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
    let out = dir.join(format!("{name}.perf.data"));
    let record = [
        "record",
        "-q",
        "-e",
        "cpu-clock",
        "-F",
        "499",
        "--call-graph",
        "dwarf,16384",
    ];
    Ok(Profile(perf(&record, &out, pid, duration)?))
}

/// `perf <args> -o <out> -p <pid and its children> -- sleep <duration>`, started.
fn perf(args: &[&str], out: &Path, pid: u32, duration: Duration) -> Result<Child, String> {
    let pids: Vec<String> = std::iter::once(pid)
        .chain(children_of(pid))
        .map(|p| p.to_string())
        .collect();
    Command::new("perf")
        .args(args)
        .arg("-o")
        .arg(out)
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
        .map_err(|e| format!("cannot run perf (apt-get install linux-perf): {e}"))
}

impl Profile {
    /// Waits for perf to write its file.
    pub(crate) async fn finish(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(120), self.0.wait()).await;
    }
}

/// The system calls a proxy process made in a phase, counted by `perf stat` on the kernel's
/// syscall tracepoints.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Syscalls {
    pub all: f64,
    /// `writev`, `write` and `sendto`: what reaches a socket (or a log file).
    pub writes: f64,
    /// `recvfrom` and `read`.
    pub reads: f64,
    pub epoll_wait: f64,
    pub futex: f64,
}

/// Which field of [`Syscalls`] a tracepoint's count adds to.
type Field = fn(&mut Syscalls) -> &mut f64;

/// The tracepoints counted, and which field each adds to.
const TRACEPOINTS: [(&str, Field); 8] = [
    ("raw_syscalls:sys_enter", |s| &mut s.all),
    ("syscalls:sys_enter_writev", |s| &mut s.writes),
    ("syscalls:sys_enter_write", |s| &mut s.writes),
    ("syscalls:sys_enter_sendto", |s| &mut s.writes),
    ("syscalls:sys_enter_recvfrom", |s| &mut s.reads),
    ("syscalls:sys_enter_read", |s| &mut s.reads),
    ("syscalls:sys_enter_epoll_wait", |s| &mut s.epoll_wait),
    ("syscalls:sys_enter_futex", |s| &mut s.futex),
];

/// A running `perf stat`.
pub(crate) struct Count {
    child: Child,
    out: std::path::PathBuf,
}

/// Starts `perf stat` of `pid`'s and its children's system calls for `duration`, writing its
/// report to `out`.
pub(crate) fn count_syscalls(out: &Path, pid: u32, duration: Duration) -> Result<Count, String> {
    let events: Vec<&str> = TRACEPOINTS.iter().map(|(name, _)| *name).collect();
    let events = events.join(",");
    let child = perf(&["stat", "-x,", "-e", &events], out, pid, duration)?;
    Ok(Count {
        child,
        out: out.to_path_buf(),
    })
}

impl Count {
    /// Waits for perf and reads its counts; `None` if it wrote none (no tracepoints here).
    pub(crate) async fn finish(mut self) -> Option<Syscalls> {
        let _ = tokio::time::timeout(Duration::from_secs(120), self.child.wait()).await;
        parse_stat(&std::fs::read_to_string(&self.out).ok()?)
    }
}

/// `perf stat -x,`'s report: one `count,unit,event,…` line per event; `<not counted>` and
/// `<not supported>` count as missing.
fn parse_stat(report: &str) -> Option<Syscalls> {
    let mut counts = Syscalls::default();
    let mut found = 0;
    for line in report.lines().filter(|l| !l.starts_with('#')) {
        let fields: Vec<&str> = line.split(',').collect();
        let (Some(count), Some(event)) = (fields.first(), fields.get(2)) else {
            continue;
        };
        let Ok(count) = count.trim().parse::<f64>() else {
            continue;
        };
        for (name, field) in TRACEPOINTS {
            if event.trim() == name {
                *field(&mut counts) += count;
                found += 1;
            }
        }
    }
    (found > 0).then_some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_report_adds_each_tracepoint_to_its_kind() {
        let report = "# started on Mon Dec  7 10:00:00 2026\n\n\
            4220,,raw_syscalls:sys_enter,5002061386,100.00,,\n\
            1990,,syscalls:sys_enter_writev,5002061386,100.00,,\n\
            10,,syscalls:sys_enter_write,5002061386,100.00,,\n\
            <not supported>,,syscalls:sys_enter_sendto,0,100.00,,\n\
            1990,,syscalls:sys_enter_recvfrom,5002061386,100.00,,\n\
            110,,syscalls:sys_enter_epoll_wait,5002061386,100.00,,\n";
        let counts = parse_stat(report).unwrap();
        assert_eq!(
            counts,
            Syscalls {
                all: 4220.0,
                writes: 2000.0,
                reads: 1990.0,
                epoll_wait: 110.0,
                futex: 0.0,
            }
        );
        assert_eq!(parse_stat("# nothing counted\n"), None);
    }
}
