//! Signals and `/proc`, for the launchers that kill and pause the processes they started. The
//! workspace forbids unsafe code, so signals go through the `kill` command.

use std::process::Stdio;

use tokio::process::Command;

/// Sends `SIG<name>` to `pid` with the `kill` command; whether it was delivered.
pub async fn signal(pid: u32, name: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|status| status.success())
}

/// The pids of `/proc` for which `pick` (given the pid and its `/proc/PID` directory) says yes.
pub fn pids_where(mut pick: impl FnMut(u32, &std::path::Path) -> Option<bool>) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            pick(pid, &e.path())?.then_some(pid)
        })
        .collect()
}

/// Pids whose parent is `pid`, from /proc: a PostgreSQL postmaster's backends, say.
pub fn children_of(pid: u32) -> Vec<u32> {
    pids_where(|_, dir| {
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        // `pid (comm) state ppid ...`; comm may hold spaces, so split after the last ')'.
        let after = &stat[stat.rfind(')')? + 1..];
        let ppid: u32 = after.split_whitespace().nth(1)?.parse().ok()?;
        Some(ppid == pid)
    })
}

/// Pids whose command line names `text` (the processes of a data directory, say).
pub fn pids_naming(text: &str) -> Vec<u32> {
    pids_where(|_, dir| {
        let cmdline = std::fs::read(dir.join("cmdline")).ok()?;
        Some(
            String::from_utf8_lossy(&cmdline)
                .replace('\0', " ")
                .contains(text),
        )
    })
}
