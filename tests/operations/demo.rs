//! `railguard demo`: the real binary plays T-042 on each lock backend and checks it.
//!
//! Each run starts its own embedded PostgreSQL in its own temp dir, on free ports, so these
//! run in parallel with each other and with every other test.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use tokio::process::Command;

/// Far more than a run takes (a few seconds), so a hang fails instead of blocking CI.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

async fn demo(args: &[&str], path: Option<&str>) -> Output {
    let mut command = Command::new(railguard_testkit::railguard_binary());
    command.arg("demo").args(args).env_remove("RUST_LOG");
    if let Some(path) = path {
        command.env("PATH", path);
    }
    command.kill_on_drop(true);
    tokio::time::timeout(RUN_TIMEOUT, command.output())
        .await
        .unwrap_or_else(|_| panic!("railguard demo {args:?} finished within {RUN_TIMEOUT:?}"))
        .expect("run railguard demo")
}

/// The narration, 409 and ledger of a passing run; returns W2's token.
fn assert_played(output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    for step in [
        "W1 acquires acct-demo → token ",
        "W1 stalls",
        "W1's lease expires",
        "W2 acquires acct-demo → token ",
        "W2 pays 100 on acct-demo through the proxy",
        "→ 201 Created",
        "W1 wakes up",
        "→ 409 FencedOut",
        "409 body: {\"error\":\"fenced_out\"",
        "rail ledger (1 entry):",
        "lock_fenced_out_total 1",
        "railguard_requests_total{outcome=\"forwarded\"} 1",
        "T-042 holds",
        "railguard stopped",
    ] {
        assert!(stdout.contains(step), "no {step:?} in:\n{stdout}");
    }
    // Every narration line is timestamped.
    assert!(
        stdout
            .lines()
            .filter(|l| l.contains("W1 ") || l.contains("W2 "))
            .all(|l| l.starts_with("[+")),
        "{stdout}"
    );
    let t2 = token_of(&stdout, "W2");
    let t1 = token_of(&stdout, "W1");
    let ledger_line = format!("seq 1  account acct-demo  token {t2}  idempotency-key pay-w2-0001");
    assert!(
        stdout.contains(&ledger_line),
        "no {ledger_line:?} in:\n{stdout}"
    );
    let body = stdout
        .lines()
        .find_map(|l| l.split("409 body: ").nth(1))
        .expect("the 409 body");
    let body: serde_json::Value = serde_json::from_str(body).expect("the 409 body is JSON");
    assert_eq!(body["account"], "acct-demo");
    assert_eq!(body["token"].to_string(), t1, "the presented token");
    assert!(
        !body.to_string().contains(&format!(":{t2},")),
        "never the mark: {body}"
    );
    t2
}

/// The temp dir the run said it removed is gone.
fn assert_cleaned_up(output: &Output) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let dir = stdout
        .lines()
        .find_map(|l| l.split("rail simulator stopped, ").nth(1))
        .and_then(|rest| rest.strip_suffix(" removed"))
        .unwrap_or_else(|| panic!("the run names its temp dir:\n{stdout}"));
    assert!(!Path::new(dir).exists(), "{dir} was removed");
}

/// The token the demo's narration says `worker` acquired acct-demo with.
fn token_of(stdout: &str, worker: &str) -> String {
    let said = format!("{worker} acquires acct-demo → token ");
    stdout
        .lines()
        .find_map(|l| l.split(said.as_str()).nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{worker}'s token in the narration"))
        .to_string()
}

#[tokio::test]
async fn demo_on_postgres_fences_out_the_stalled_survivor() {
    let output = demo(&[], None).await;
    assert_played(&output);
    assert_cleaned_up(&output);
}

#[tokio::test]
async fn demo_on_etcd_fences_out_the_stalled_survivor() {
    let output = demo(&["--backend", "etcd"], None).await;
    assert_played(&output);
    assert_cleaned_up(&output);
    assert!(String::from_utf8_lossy(&output.stdout).contains("etcd stopped"));
}

#[tokio::test]
async fn demo_on_etcd_without_etcd_says_what_to_install() {
    let empty = tempfile::tempdir().unwrap();
    let output = demo(&["--backend", "etcd"], Some(empty.path().to_str().unwrap())).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("etcd-server"), "{stderr}");
}

#[tokio::test]
async fn demo_refuses_a_bad_ttl_without_starting_anything() {
    let output = demo(&["--ttl-ms", "nope"], None).await;
    assert_eq!(output.status.code(), Some(2), "clap's usage error");
    let output = demo(&["--ttl-ms", "5"], None).await;
    assert_eq!(output.status.code(), Some(2));
}
