//! The harness itself, run as CI runs it: a short run per backend under every fault must find
//! no violation, and each negative control must make the checker fail, on each backend, with
//! idempotency keys on (INV-05 seen directly) and off (the duplicate at the rail, INV-02).
//! A harness that cannot see the bug proves nothing. The same for the stores going back:
//! lockdb rewound and etcd restored must violate nothing, and must be caught with railguard's
//! detection of it turned off; so must a superseded grant held across lockdb going back on
//! the etcd lock backend, where only the marks go back.

use std::path::Path;
use std::process::Command;

struct Run {
    code: i32,
    stdout: String,
    report: serde_json::Value,
}

fn harness(out: &Path, args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_railguard-harness"))
        .arg("--out")
        .arg(out)
        .args(args)
        .env("CI", "1")
        .output()
        .expect("the harness runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let code = output.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 1,
        "the run could not be made (exit {code}):\n{stdout}\n{stderr}"
    );
    let report = std::fs::read_to_string(out.join("report.json"))
        .map(|t| serde_json::from_str(&t).expect("report.json parses"))
        .unwrap_or_else(|e| panic!("no report.json ({e}):\n{stdout}\n{stderr}"));
    Run {
        code,
        stdout,
        report,
    }
}

fn out_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("railguard-harness-")
        .tempdir()
        .unwrap()
}

fn violations(run: &Run, invariant: &str) -> u64 {
    run.report["violations_by_invariant"][invariant]
        .as_u64()
        .unwrap_or(0)
}

fn clean_run(backend: &str, seconds: &str) {
    let dir = out_dir();
    let out = dir.path().join("run");
    let run = harness(
        &out,
        &[
            "--backend",
            backend,
            "--duration-s",
            seconds,
            "--faults",
            "all",
            "--seed",
            "7",
        ],
    );
    assert_eq!(run.code, 0, "no violation expected:\n{}", run.stdout);
    let faults = run.report["faults"].as_object().unwrap();
    assert!(faults.len() >= 5, "faults were injected: {faults:?}");
    assert!(
        run.report["counts"]["completed"].as_u64().unwrap() > 0,
        "payments were made:\n{}",
        run.stdout
    );
    // The saved run checks the same offline, and a duplicate slipped into its rail ledger
    // is caught: the checker reads the files, nothing else.
    let again = Command::new(env!("CARGO_BIN_EXE_railguard-harness"))
        .arg("check")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(0));
    let ledger_path = out.join("rail-ledger.json");
    let mut ledger: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&ledger_path).unwrap()).unwrap();
    let mut copy = ledger[0].clone();
    copy["seq"] = serde_json::json!(ledger.len() as u64 + 1);
    ledger.push(copy);
    std::fs::write(&ledger_path, serde_json::to_string(&ledger).unwrap()).unwrap();
    let tampered = Command::new(env!("CARGO_BIN_EXE_railguard-harness"))
        .arg("check")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(tampered.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&tampered.stdout).contains("INV-02"));
}

#[test]
fn a_short_run_under_every_fault_violates_nothing_postgres() {
    clean_run("postgres", "25");
}

#[test]
fn a_short_run_under_every_fault_violates_nothing_etcd() {
    clean_run("etcd", "30");
}

/// A negative control's run: stalled workers only, so that every violation comes from the bug.
fn control(backend: &str, control: &str, keys: bool) -> Run {
    let dir = out_dir();
    let seconds = if backend == "etcd" { "40" } else { "18" };
    let keys = keys.to_string();
    harness(
        &dir.path().join("run"),
        &[
            "--backend",
            backend,
            "--negative-control",
            control,
            "--idempotency-keys",
            &keys,
            "--accounts",
            "2",
            "--duration-s",
            seconds,
            "--faults",
            "worker-pause",
            "--seed",
            "3",
        ],
    )
}

/// The control's run fails and names at least one of `invariants`. Without idempotency keys a
/// stale submit is a duplicate payment (INV-02) when a newer holder has already paid the same
/// payment, and only out of order (INV-05) when it has not: which of the two a run meets
/// depends on how its stalls fall, so those controls accept either.
fn assert_caught(run: &Run, invariants: &[&str]) {
    assert_eq!(run.code, 1, "the checker must fail:\n{}", run.stdout);
    let named: Vec<&str> = invariants
        .iter()
        .copied()
        .filter(|inv| violations(run, inv) > 0 && run.stdout.contains(inv))
        .collect();
    assert!(
        !named.is_empty(),
        "one of {invariants:?} named:\n{}",
        run.stdout
    );
}

macro_rules! negative_controls {
    ($($name:ident => $backend:literal, $control:literal, $keys:literal, [$($inv:literal),+];)*) => {
        $(
            #[test]
            fn $name() {
                assert_caught(&control($backend, $control, $keys), &[$($inv),+]);
            }
        )*
    };
}

negative_controls! {
    reread_with_keys_is_caught_postgres => "postgres", "reread", true, ["INV-05"];
    reread_without_keys_is_caught_postgres => "postgres", "reread", false, ["INV-02", "INV-05"];
    kill_switch_with_keys_is_caught_postgres => "postgres", "kill-switch", true, ["INV-05"];
    kill_switch_without_keys_is_caught_postgres => "postgres", "kill-switch", false, ["INV-02", "INV-05"];
    reread_with_keys_is_caught_etcd => "etcd", "reread", true, ["INV-05"];
    reread_without_keys_is_caught_etcd => "etcd", "reread", false, ["INV-02", "INV-05"];
    kill_switch_with_keys_is_caught_etcd => "etcd", "kill-switch", true, ["INV-05"];
    kill_switch_without_keys_is_caught_etcd => "etcd", "kill-switch", false, ["INV-02", "INV-05"];
}

/// The operator of `--operator-forgets` follows the in-doubt procedure: under railguard
/// processes killed while their forwards are at a slow rail, it leaves the payments the rail
/// has in doubt and forgets the others, and nothing is paid twice. The same run with the
/// operator skipping the dry run's wait and the rail (`operator-skips-the-wait`) forgets
/// payments the rail has, and their retries are caught as INV-02. Both runs at once.
#[test]
fn the_operator_following_the_in_doubt_procedure_pays_nothing_twice_and_skipping_it_is_caught() {
    let args = |control: bool| {
        let mut args = vec![
            "--proxies",
            "2",
            "--faults",
            "proxy-kill",
            "--operator-forgets",
            "--rail-latency-ms",
            "200",
            "--workers",
            "8",
            "--accounts",
            "8",
            "--duration-s",
            "25",
        ];
        if control {
            args.extend(["--negative-control", "operator-skips-the-wait"]);
        }
        args
    };
    let (real_dir, control_dir) = (out_dir(), out_dir());
    let (real, control) = std::thread::scope(|s| {
        let real = s.spawn(|| harness(&real_dir.path().join("run"), &args(false)));
        let control = s.spawn(|| harness(&control_dir.path().join("run"), &args(true)));
        (real.join().unwrap(), control.join().unwrap())
    });
    let count = |run: &Run, name: &str| run.report["counts"][name].as_u64().unwrap_or(0);
    assert_eq!(real.code, 0, "the procedure as written:\n{}", real.stdout);
    assert!(
        count(&real, "forgotten") + count(&real, "paid_per_the_rail") > 0,
        "the operator resolved records:\n{}",
        real.stdout
    );
    assert_caught(&control, &["INV-02"]);
    assert_eq!(
        count(&control, "paid_per_the_rail"),
        0,
        "the control never asks the rail:\n{}",
        control.stdout
    );
}

/// The same stalls without a bug: nothing to report (so what the controls find is the bug's).
#[test]
fn the_controls_runs_without_the_bug_violate_nothing() {
    for keys in [true, false] {
        let dir = out_dir();
        let run = harness(
            &dir.path().join("run"),
            &[
                "--idempotency-keys",
                &keys.to_string(),
                "--accounts",
                "2",
                "--duration-s",
                "18",
                "--faults",
                "worker-pause",
                "--seed",
                "3",
            ],
        );
        assert_eq!(run.code, 0, "keys {keys}:\n{}", run.stdout);
        assert!(
            run.report["counts"]["fenced_out"].as_u64().unwrap() > 0,
            "the stalled workers were fenced out:\n{}",
            run.stdout
        );
    }
}

/// A run in which a store railguard fences against goes back under load, `fault` being
/// `pg-rewind-data` (lockdb put back to a copy taken 2–3 s earlier: an asynchronous standby
/// promoted) or `etcd-restore` (etcd restored from a snapshot taken 2–3 s earlier). Four
/// workers on few keys: every key is granted many times between the copy and the rewind, so
/// a source that went back repeats tokens on every key at once.
///
/// On etcd, the accounts' fencing marks live in PostgreSQL, which did not go back: the first
/// grant of an account after the restore is at or below its mark, and the token-source guard
/// stops granting even without store change detection. What only the detection sees are keys
/// no mark covers, so the etcd runs lock mostly such keys (`--lock-only-keys`).
///
/// `pg-failover` (lockdb a Patroni cluster, asynchronous replication) makes the same loss the
/// production way: its first failover kills the primary after a second of commits its standby
/// never received; then a switchover and a hard failover follow when the run is long enough.
fn store_goes_back(backend: &str, fault: &str, control: Option<&str>) -> (Run, Vec<String>) {
    let dir = out_dir();
    let out = dir.path().join("run");
    let (seconds, accounts, lock_only) = match (backend, fault, control) {
        ("etcd", ..) => ("20", "1", "15"),
        (_, "pg-failover", None) => ("30", "2", "2"),
        (_, "pg-failover", Some(_)) => ("16", "2", "2"),
        _ => ("12", "2", "2"),
    };
    let mut args = vec![];
    if fault == "pg-failover" {
        args.extend(["--pg", "patroni", "--pg-sync", "off"]);
    }
    args.extend([
        "--backend",
        backend,
        "--accounts",
        accounts,
        "--lock-only-keys",
        lock_only,
        "--workers",
        "4",
        "--duration-s",
        seconds,
        "--faults",
        fault,
        "--seed",
        "5",
    ]);
    if let Some(control) = control {
        args.extend(["--negative-control", control]);
    }
    let run = harness(&out, &args);
    let faults = std::fs::read_to_string(out.join("faults.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["kind"], fault);
            v["target"].as_str().unwrap().to_string()
        })
        .collect::<Vec<_>>();
    assert!(!faults.is_empty(), "{fault} was injected:\n{}", run.stdout);
    (run, faults)
}

/// railguard notices the store went back: no token is granted twice, no stale write lands,
/// and grants resume (the fault's record says after what) and payments are made.
fn store_goes_back_and_nothing_is_violated(backend: &str, fault: &str) {
    let (run, faults) = store_goes_back(backend, fault, None);
    assert_eq!(run.code, 0, "no violation expected:\n{}", run.stdout);
    for target in &faults {
        assert!(target.contains("granting again"), "{target}");
    }
    assert!(
        run.report["counts"]["completed"].as_u64().unwrap() > 0,
        "payments were made:\n{}",
        run.stdout
    );
}

#[test]
fn lockdb_put_back_to_an_earlier_copy_violates_nothing() {
    store_goes_back_and_nothing_is_violated("postgres", "pg-rewind-data");
}

#[test]
fn etcd_restored_from_an_earlier_snapshot_violates_nothing() {
    store_goes_back_and_nothing_is_violated("etcd", "etcd-restore");
}

#[test]
fn lockdb_failing_over_violates_nothing() {
    store_goes_back_and_nothing_is_violated("postgres", "pg-failover");
}

/// The same runs with railguard's detection of a store that went back turned off: the
/// checker must see tokens repeat (INV-04) or what they let through (INV-05, INV-02).
#[test]
fn lockdb_put_back_without_detection_is_caught() {
    let (run, _) = store_goes_back(
        "postgres",
        "pg-rewind-data",
        Some("no-store-change-detection"),
    );
    assert_caught(&run, &["INV-04", "INV-05", "INV-02"]);
}

#[test]
fn lockdb_failing_over_after_lost_commits_without_detection_is_caught() {
    let (run, _) = store_goes_back("postgres", "pg-failover", Some("no-store-change-detection"));
    assert_caught(&run, &["INV-04", "INV-05", "INV-02"]);
}

#[test]
fn etcd_restored_without_detection_is_caught() {
    let (run, _) = store_goes_back("etcd", "etcd-restore", Some("no-store-change-detection"));
    assert_caught(&run, &["INV-04", "INV-05", "INV-02"]);
}

/// A superseded grant across a store that goes back, the interleaving forced
/// (`pg-rewind-takeover`, `pg-failover-takeover`): a worker held before its submit, its account
/// taken over and paid, the data put back, every railguard restarted, the held worker
/// continued. On the etcd lock backend the tokens do not go back, only the marks and records
/// in PostgreSQL do; workers fence only at the proxy (`--proxy-only`), so that nothing but
/// railguard stands between the old grant and the rail. Returns the run and each injection's
/// record.
fn superseded_grant(fault: &str, control: Option<&str>) -> (Run, Vec<String>) {
    let dir = out_dir();
    let out = dir.path().join("run");
    let mut args = vec![];
    let seconds = if fault == "pg-failover-takeover" {
        args.extend(["--pg", "patroni", "--pg-sync", "off"]);
        "20"
    } else {
        "16"
    };
    args.extend([
        "--backend",
        "etcd",
        "--proxy-only",
        "--workers",
        "4",
        "--accounts",
        "4",
        "--duration-s",
        seconds,
        "--faults",
        fault,
        "--seed",
        "5",
    ]);
    if let Some(control) = control {
        args.extend(["--negative-control", control]);
    }
    let run = harness(&out, &args);
    let records = std::fs::read_to_string(out.join("faults.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["kind"], fault);
            v["target"].as_str().unwrap().to_string()
        })
        .collect::<Vec<_>>();
    assert!(!records.is_empty(), "{fault} was injected:\n{}", run.stdout);
    (run, records)
}

/// With the detection, the held worker's old grant is fenced out every time.
fn superseded_grant_is_fenced(fault: &str) {
    let (run, records) = superseded_grant(fault, None);
    assert_eq!(run.code, 0, "no violation expected:\n{}", run.stdout);
    assert!(
        records
            .iter()
            .any(|r| r.contains("was refused (fenced_out)")),
        "the interleaving was made and the old grant refused: {records:#?}"
    );
    assert!(
        records.iter().all(|r| !r.contains("was paid (")),
        "{records:#?}"
    );
}

/// Without it, the old grant pays after the newer one: the checker sees it.
fn superseded_grant_without_detection_is_caught(fault: &str) {
    let (run, records) = superseded_grant(fault, Some("no-store-change-detection"));
    assert!(
        records.iter().any(|r| r.contains("was paid (")),
        "the old grant paid: {records:#?}"
    );
    assert_caught(&run, &["INV-05", "INV-02"]);
}

#[test]
fn a_superseded_grant_across_a_rewind_is_fenced_etcd() {
    superseded_grant_is_fenced("pg-rewind-takeover");
}

#[test]
fn a_superseded_grant_across_a_rewind_without_detection_is_caught_etcd() {
    superseded_grant_without_detection_is_caught("pg-rewind-takeover");
}

#[test]
fn a_superseded_grant_across_an_async_failover_is_fenced_etcd() {
    superseded_grant_is_fenced("pg-failover-takeover");
}

#[test]
fn a_superseded_grant_across_an_async_failover_without_detection_is_caught_etcd() {
    superseded_grant_without_detection_is_caught("pg-failover-takeover");
}

/// Every cleanup (workers' `kill_on_drop`, PostgreSQL, etcd, `railguard serve`, temp dirs)
/// lives in `Drop`, which an unhandled signal never runs. The coordinator handles
/// SIGTERM/SIGINT by dropping the run: a run stopped after a few seconds leaves no process
/// running (not even a worker caught stopped by `worker-sigstop`).
#[tokio::test]
async fn a_run_stopped_by_sigterm_leaves_no_process_behind() {
    fn children() -> Vec<(u32, u32, String)> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
                continue;
            };
            let ppid: u32 = rest.split(' ').nth(1).unwrap().parse().unwrap();
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            all.push((pid, ppid, cmd));
        }
        all
    }
    fn descendants(root: u32) -> Vec<(u32, String)> {
        let all = children();
        let mut out = Vec::new();
        let mut stack = vec![root];
        while let Some(p) = stack.pop() {
            for (pid, ppid, cmd) in &all {
                if *ppid == p {
                    out.push((*pid, cmd.clone()));
                    stack.push(*pid);
                }
            }
        }
        out
    }
    let dir = out_dir();
    let mut child = Command::new(env!("CARGO_BIN_EXE_railguard-harness"))
        .arg("--out")
        .arg(dir.path().join("run"))
        .args(["--faults", "worker-sigstop", "--duration-s", "30"])
        .args(["--workers", "2", "--accounts", "2"])
        .env("CI", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    let started = descendants(child.id());
    assert!(!started.is_empty(), "the run started its processes");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let left: Vec<_> = started
        .iter()
        .filter(|(pid, _)| Path::new(&format!("/proc/{pid}")).exists())
        .cloned()
        .collect();
    // Tidy up what this test started, whatever the verdict.
    for (pid, cmd) in &left {
        let _ = Command::new("kill")
            .args(["-CONT", &pid.to_string()])
            .status();
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        for flag in ["-D", "--config"] {
            if let Some(path) = cmd.split(' ').skip_while(|a| *a != flag).nth(1) {
                let _ = std::fs::remove_dir_all(Path::new(path).parent().unwrap());
            }
        }
    }
    assert!(
        left.is_empty(),
        "still running 3 s after the harness got SIGTERM: {:#?}",
        left.iter()
            .map(|(pid, cmd)| format!("{pid} {}", cmd.chars().take(80).collect::<String>()))
            .collect::<Vec<_>>()
    );
}
