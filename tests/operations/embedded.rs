//! `database.url = "embedded"`: railguard runs its own PostgreSQL, privately, and stops it;
//! a SIGHUP reloads what it can and stops neither.

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

/// A temp dir named with `prefix` that every user may enter: the server may run as another
/// user (when we are root), and must be able to reach its data directory inside.
fn enterable_temp_dir(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

#[tokio::test]
async fn embedded_postgres_is_private_survives_restarts_and_is_stopped_cleanly() {
    init_tracing();
    let dir = enterable_temp_dir("railguard-embedded-");
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
    rail.assert_paid(3, "payments at the rail");
}

/// Whether `pid` is a live process (not gone, not a zombie waiting for its parent).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn worker(name: &str, secret: &str) -> String {
    format!(
        "[[worker]]\nname = \"{name}\"\nsecrets = [\"{}\"]\naccounts = [\"acct-*\"]\n",
        railguard::auth::secret::digest_text(secret)
    )
}

#[tokio::test]
async fn sighup_reloads_credentials_and_log_level_and_leaves_railguard_and_postgres_running() {
    init_tracing();
    let dir = enterable_temp_dir("railguard-sighup-");
    let data_dir = dir.path().join("pg");
    let credentials = dir.path().join("credentials.toml");
    let (first, second) = (
        railguard::auth::secret::generate(),
        railguard::auth::secret::generate(),
    );
    std::fs::write(&credentials, worker("first", &first)).unwrap();
    let (data_dir_text, credentials_text) = (
        data_dir.display().to_string(),
        credentials.display().to_string(),
    );
    let env = [
        ("RAILGUARD__DATABASE__DATA_DIR", data_dir_text.as_str()),
        (
            "RAILGUARD__AUTH__CREDENTIALS_FILE",
            credentials_text.as_str(),
        ),
        // An hour: within this test only a SIGHUP can bring a new version in.
        ("RAILGUARD__AUTH__RELOAD_INTERVAL_MS", "3600000"),
    ];
    let rail = Rail::start().await;
    let mut rg = Railguard::start_process("embedded", &rail.url(), &env).await;
    let pid = rg.pid().expect("a process");
    let postmaster = || -> Option<u32> {
        std::fs::read_to_string(data_dir.join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    };
    let postgres = postmaster().expect("the embedded server runs");
    assert!(alive(postgres));
    let locks = |secret: &str| rg.lock_client().with_bearer(secret).unwrap();
    let refused = locks(&second)
        .acquire("acct-1", "w2", Duration::from_secs(30), Duration::ZERO)
        .await
        .expect_err("a secret the file does not list");
    assert!(
        matches!(refused, railguard::sdk::SdkError::Unauthenticated(_)),
        "{refused:?}"
    );

    // A new identity, a new log level, and a key that only a restart can change.
    std::fs::write(
        &credentials,
        format!("{}{}", worker("first", &first), worker("second", &second)),
    )
    .unwrap();
    let config = std::fs::read_to_string(rg.config_path()).unwrap();
    let changed = config
        .replace("level = \"info\"", "level = \"debug\"")
        .replace("request_timeout_ms = 3000", "request_timeout_ms = 4000");
    assert_ne!(
        config, changed,
        "the test's config has the lines it changes"
    );
    std::fs::write(rg.config_path(), changed).unwrap();
    let before = rg.log().len();
    assert!(support::signal(pid, "HUP").await, "SIGHUP delivered");

    let log = rg.logged_since(before, "SIGHUP: reload done").await;
    assert!(log.contains("SIGHUP received"), "{log}");
    assert!(
        log.contains("credentials file read again (SIGHUP); the new version is in force"),
        "{log}"
    );
    assert!(log.contains("log.level is now \\\"debug\\\""), "{log}");
    assert!(
        log.contains("need a restart to take effect: proxy.request_timeout_ms;"),
        "the key that needs a restart is named, and only it:\n{log}"
    );
    assert!(!log.contains("reload done with errors"), "{log}");

    // It still serves, with the new credentials in force, on the same PostgreSQL.
    let grant = locks(&second)
        .acquire("acct-1", "second", Duration::from_secs(30), Duration::ZERO)
        .await
        .expect("the identity added by the reload may lock");
    let paid = railguard::sdk::RailClient::new(rg.proxy_url(""))
        .with_bearer(&second)
        .unwrap()
        .post(&grant, "acct-1", "/payments", "{}".into(), None)
        .await
        .unwrap();
    assert_eq!(paid.status, StatusCode::CREATED);
    assert!(alive(pid), "railguard is still running:\n{}", rg.log());
    assert_eq!(postmaster(), Some(postgres), "the same embedded PostgreSQL");
    assert!(alive(postgres), "the embedded PostgreSQL is untouched");
    // The new level is in force: debug lines appear from the reload on.
    assert!(
        rg.log()[before..].contains("\"level\":\"DEBUG\""),
        "debug lines after the reload:\n{}",
        &rg.log()[before..]
    );
    assert!(
        !rg.log()[..before].contains("\"level\":\"DEBUG\""),
        "and none before it"
    );

    // Files that cannot be used: said, key and file named, and nothing changes.
    let config = std::fs::read_to_string(rg.config_path()).unwrap();
    let broken = config.replace("request_timeout_ms = 4000", "request_timeout_ms = \"soon\"");
    assert_ne!(config, broken);
    std::fs::write(rg.config_path(), broken).unwrap();
    std::fs::write(&credentials, "[[worker]]\nname = \"nobody\"\n").unwrap();
    let before = rg.log().len();
    assert!(support::signal(pid, "HUP").await, "SIGHUP delivered");
    let log = rg
        .logged_since(before, "SIGHUP: reload done with errors")
        .await;
    assert!(
        log.contains("the configuration cannot be used, nothing in it was applied")
            && log.contains("railguard.toml: key `proxy.request_timeout_ms`"),
        "{log}"
    );
    assert!(
        log.contains(&format!("credentials file {credentials_text}"))
            && log.contains("the version in force stays"),
        "{log}"
    );
    let grant = locks(&second)
        .acquire("acct-2", "second", Duration::from_secs(30), Duration::ZERO)
        .await
        .expect("the credentials in force before the broken file still are");
    assert!(alive(pid) && alive(postgres));
    drop(grant);

    let status = rg.stop().await;
    assert!(status.success(), "{status}");
    assert!(
        processes_in(&data_dir).is_empty(),
        "a stop after the reload still stops PostgreSQL:\n{}",
        rg.log()
    );
    rail.assert_paid(1, "payments at the rail");
}
