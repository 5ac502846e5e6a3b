//! `database.url = "embedded"`: railguard runs its own PostgreSQL, privately, and stops it.

use railguard_testkit as support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use http::StatusCode;
use support::{Http, Rail, Railguard, init_tracing};

/// Pids of processes whose working directory is `dir` (PostgreSQL chdirs to its data dir).
fn processes_in(dir: &Path) -> Vec<u32> {
    let dir = std::fs::canonicalize(dir).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd == dir))
        .collect()
}

/// `None` once the process is gone (a backend may exit between listing and looking).
fn uid_of(pid: u32) -> Option<u32> {
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

#[tokio::test]
async fn embedded_postgres_is_private_survives_restarts_and_is_stopped_cleanly() {
    init_tracing();
    let dir = tempfile::Builder::new()
        .prefix("railguard-embedded-")
        .tempdir()
        .unwrap();
    // The server may run as another user (when we are root); it must be able to enter.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data_dir = dir.path().join("pg");
    let data_dir_text = data_dir.display().to_string();
    let env = [("RAILGUARD__DATABASE__DATA_DIR", data_dir_text.as_str())];
    let rail = Rail::start().await;
    let mut rg = Railguard::start_process("embedded", &rail.url(), &env).await;
    let http = Http::new();
    assert_eq!(
        http.pay_with(&rg, 57, "k").await.status,
        StatusCode::CREATED
    );

    let server = processes_in(&data_dir);
    assert!(
        !server.is_empty(),
        "the embedded server runs in its data directory"
    );
    let me = std::fs::metadata("/proc/self").unwrap().uid();
    let uids: Vec<u32> = server.iter().filter_map(|pid| uid_of(*pid)).collect();
    assert!(!uids.is_empty(), "the embedded server's processes vanished");
    for uid in uids {
        if me == 0 {
            assert_ne!(uid, 0, "PostgreSQL never runs as root");
        } else {
            assert_eq!(uid, me);
        }
    }
    assert!(
        data_dir.join(".s.PGSQL.5432").exists(),
        "it listens on a socket in its data directory"
    );
    let postmaster = std::fs::read_to_string(data_dir.join("postmaster.pid")).unwrap();
    assert!(
        postmaster
            .lines()
            .nth(5)
            .is_some_and(|addresses| addresses.trim().is_empty()),
        "and on no TCP address: {postmaster}"
    );

    // A second railguard on the same data directory is refused and harms nothing.
    let config = rg.config_path();
    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(["migrate", "--config"])
        .arg(&config)
        .envs(env)
        .output()
        .await
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("in use by another railguard"));
    assert_eq!(
        http.pay_with(&rg, 57, "k").await.status,
        StatusCode::CREATED,
        "the first is unharmed"
    );

    let status = rg.stop().await;
    assert!(status.success(), "{status}");
    assert!(
        processes_in(&data_dir).is_empty(),
        "SIGTERM stopped PostgreSQL too:\n{}",
        rg.log()
    );
    assert!(
        !data_dir.join("postmaster.pid").exists(),
        "a clean shutdown leaves no postmaster.pid"
    );

    rg.start_again().await;
    assert_eq!(
        http.pay_with(&rg, 42, "k").await.status,
        StatusCode::CONFLICT,
        "the mark survived"
    );
    // The embedded server restarted with railguard: a token from before is fenced once, above
    // the mark as below it, and a new grant pays (store::epoch).
    assert_eq!(
        http.pay_with(&rg, 58, "k").await.status,
        StatusCode::CONFLICT,
        "a grant from before the restart is fenced once"
    );
    let grant = rg
        .lock_client()
        .acquire("k", "w", Duration::from_secs(30), Duration::ZERO)
        .await
        .unwrap();
    assert!(grant.token().get() > 58);
    let paid = railguard::sdk::RailClient::new(rg.proxy_url(""))
        .post(&grant, "k", "/payments", "{}".into(), None)
        .await
        .unwrap();
    assert_eq!(paid.status, StatusCode::CREATED);
    assert!(rg.stop().await.success());
    assert_eq!(rail.ledger().len(), 3);
}
