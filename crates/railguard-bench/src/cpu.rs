//! Where the CPU went during a measured run, from `/proc`: how busy the machine was, and CPU
//! time spent by this process (load generator + proxies + rail simulator), by PostgreSQL (the
//! postmaster and all its backends), by reaped children of this process (pgbench) and by
//! everything else on the machine.
//!
//! On a machine with few cores a throughput figure alone cannot say whether a phase waited on
//! disk or ran out of CPU; CPU time per request can, and comparing a proxied phase with the
//! direct one estimates what the proxy itself costs per request.

use std::path::{Path, PathBuf};

use railguard_testkit::children_of;

/// `/proc` reports process times in USER_HZ, which is 100 on every Linux architecture
/// regardless of the kernel's internal tick rate.
const TICKS_PER_SEC: f64 = 100.0;

/// Cumulative counters at one instant.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Snapshot {
    machine_busy: u64,
    machine_total: u64,
    own: u64,
    reaped_children: u64,
    postgres: u64,
    etcd: u64,
}

/// CPU use between two snapshots, in seconds.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuUse {
    /// Fraction of all CPUs' time that was not idle (0.0 to 1.0).
    pub machine_busy: f64,
    pub own_secs: f64,
    pub postgres_secs: f64,
    /// The throwaway etcd member, when one runs.
    pub etcd_secs: f64,
    /// Children of this process that exited and were waited for: pgbench.
    pub reaped_children_secs: f64,
    /// Fraction of all CPUs' time used by everything else on the machine: a repetition with
    /// much of it was measured while something else competed for the CPUs.
    pub others: f64,
}

impl Snapshot {
    /// Reads the counters; `postmaster` is the PostgreSQL server's pid, `etcd` the etcd
    /// member's. Whatever cannot be read counts as zero.
    pub(crate) fn take(postmaster: Option<u32>, etcd: Option<u32>) -> Self {
        let (machine_busy, machine_total) = machine_ticks().unwrap_or_default();
        let own = process_ticks(Path::new("/proc/self/stat")).unwrap_or_default();
        // A backend's time moves into the postmaster's cutime/cstime when it exits, so the
        // postmaster's own and reaped time plus its live children's time only ever grows.
        let postgres = postmaster.map_or(0, |pid| {
            let root = process_ticks(&stat_of(pid));
            let (own, reaped) = root.unwrap_or_default();
            own + reaped
                + children_of(pid)
                    .into_iter()
                    .filter_map(|c| process_ticks(&stat_of(c)))
                    .map(|t| t.0)
                    .sum::<u64>()
        });
        let etcd = etcd.map_or(0, |pid| {
            process_ticks(&stat_of(pid)).map_or(0, |(own, reaped)| own + reaped)
        });
        Self {
            machine_busy,
            machine_total,
            own: own.0,
            reaped_children: own.1,
            postgres,
            etcd,
        }
    }

    /// What was used from `self` until `later`.
    pub(crate) fn until(&self, later: &Snapshot) -> CpuUse {
        let ticks = |a: u64, b: u64| b.saturating_sub(a);
        let secs = |a: u64, b: u64| ticks(a, b) as f64 / TICKS_PER_SEC;
        let total = ticks(self.machine_total, later.machine_total).max(1) as f64;
        let busy = ticks(self.machine_busy, later.machine_busy);
        let ours = ticks(self.own, later.own)
            + ticks(self.postgres, later.postgres)
            + ticks(self.etcd, later.etcd)
            + ticks(self.reaped_children, later.reaped_children);
        CpuUse {
            machine_busy: busy as f64 / total,
            own_secs: secs(self.own, later.own),
            postgres_secs: secs(self.postgres, later.postgres),
            etcd_secs: secs(self.etcd, later.etcd),
            reaped_children_secs: secs(self.reaped_children, later.reaped_children),
            others: busy.saturating_sub(ours) as f64 / total,
        }
    }
}

/// Busy and total ticks of all CPUs, from the `cpu` line of /proc/stat.
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// `/proc/<pid>/stat`.
fn stat_of(pid: u32) -> PathBuf {
    Path::new("/proc").join(pid.to_string()).join("stat")
}

/// (utime + stime, cutime + cstime) of a process, from its `stat` file.
fn process_ticks(stat: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(stat).ok()?;
    // `pid (comm) state ppid ...`; comm may hold spaces, so split after the last ')'.
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    // After the comm: state is field 0, utime 11, stime 12, cutime 13, cstime 14.
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    Some((field(11)? + field(12)?, field(13)? + field(14)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_the_machine() {
        let before = Snapshot::take(Some(std::process::id()), None);
        let mut x = 0u64;
        let started = std::time::Instant::now();
        while started.elapsed().as_millis() < 60 {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        let used = before.until(&Snapshot::take(Some(std::process::id()), None));
        assert!(x > 0);
        assert!(used.own_secs > 0.0, "{used:?}");
        assert!((0.0..=1.0).contains(&used.machine_busy), "{used:?}");
    }
}
