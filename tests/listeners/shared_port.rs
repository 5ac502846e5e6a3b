//! `proxy.reuse_port`: railguard processes that set it share one proxy address, the kernel
//! spreading new connections among them, and every request is fenced whichever process took
//! it; a process still starting takes none of them; a process that does not set it cannot
//! start on an address another holds.

use railguard_testkit as support;

use http::StatusCode;
use support::{Pg, Rail, Railguard, init_tracing};

const FORWARDED: &str = "railguard_requests_total{outcome=\"forwarded\"}";

/// Pays `token` on `account` through `rg`'s proxy address on a connection of its own, so the
/// kernel picks a process for each payment.
async fn pay_on_a_new_connection(rg: &Railguard, token: i64, account: &str) -> support::Reply {
    rg.http().pay_with(rg, token, account).await
}

/// PostgreSQL, a rail, and a first process that sets `proxy.reuse_port`.
async fn first_sharing_process() -> (Pg, Rail, Railguard) {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let a = Railguard::start_process(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__PROXY__REUSE_PORT", "true")],
    )
    .await;
    (pg, rail, a)
}

#[tokio::test]
async fn processes_that_set_reuse_port_share_the_proxy_address_and_fence_as_one() {
    let (pg, rail, a) = first_sharing_process().await;
    let shared = a.proxy.to_string();
    let mut b = Railguard::start_process(
        &pg.url(),
        &rail.url(),
        &[
            ("RAILGUARD__PROXY__REUSE_PORT", "true"),
            ("RAILGUARD__PROXY__LISTEN", &shared),
        ],
    )
    .await;

    // Forty grants of one account, in order, each on a new connection to the one address.
    for token in 1..=40 {
        pay_on_a_new_connection(&a, token, "acct-shared")
            .await
            .assert_status(StatusCode::CREATED);
    }
    let (by_a, by_b) = (
        a.metrics().await.get(FORWARDED),
        b.metrics().await.get(FORWARDED),
    );
    assert_eq!(
        by_a + by_b,
        40.0,
        "every forward was counted by one of them"
    );
    assert!(
        by_a > 0.0 && by_b > 0.0,
        "the kernel gave every one of forty connections to one process (a: {by_a}, b: {by_b}): \
         the address is not shared"
    );
    // A stale token is refused by whichever process takes it: the mark is the database's.
    for _ in 0..10 {
        pay_on_a_new_connection(&a, 39, "acct-shared")
            .await
            .assert_status(StatusCode::CONFLICT);
    }
    assert_eq!(rail.tokens(), (1..=40).collect::<Vec<i64>>());

    // One process gone: the other takes every new connection to the address.
    b.kill().await;
    for token in 41..=50 {
        pay_on_a_new_connection(&a, token, "acct-shared")
            .await
            .assert_status(StatusCode::CREATED);
    }
    assert_eq!(a.metrics().await.get(FORWARDED), by_a + 10.0);
    assert_eq!(rail.tokens(), (1..=50).collect::<Vec<i64>>());
}

#[tokio::test]
async fn a_process_without_reuse_port_cannot_start_on_an_address_another_shares() {
    let (_pg, _rail, a) = first_sharing_process().await;
    let dir = tempfile::tempdir().unwrap();
    let config = support::config_without_a_database(dir.path(), "");
    let shared = a.proxy.to_string();
    let out = support::railguard_command(
        &["serve"],
        &config,
        &[("RAILGUARD__PROXY__LISTEN", shared.as_str())],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    assert!(
        stderr.contains(&shared)
            && stderr.contains("proxy.listen")
            && stderr.contains("the environment variable RAILGUARD__PROXY__LISTEN"),
        "the error names the address, the key and the variable that set it: {stderr}"
    );
    // Variable names are read whatever their case; the error names the one that was set.
    let out = support::railguard_command(
        &["serve"],
        &config,
        &[("RAILGUARD__proxy__listen", shared.as_str())],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("the environment variable RAILGUARD__proxy__listen"),
        "the error names the variable as it was set: {stderr}"
    );
    // Set in the file, the error names the file.
    let text = std::fs::read_to_string(&config).unwrap();
    let own = text.lines().find(|l| l.starts_with("listen = ")).unwrap();
    let text = text.replacen(own, &format!("listen = \"{shared}\""), 1);
    std::fs::write(&config, text).unwrap();
    let out = support::railguard_command(&["serve"], &config, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    assert!(
        stderr.contains(&shared)
            && stderr.contains("proxy.listen")
            && stderr.contains(&format!("config file {}", config.display())),
        "the error names the address, the key and the file: {stderr}"
    );
    // The process that holds the address still serves.
    pay_on_a_new_connection(&a, 3, "acct-held")
        .await
        .assert_status(StatusCode::CREATED);
}

#[tokio::test]
async fn a_process_still_starting_takes_none_of_the_shared_addresses_connections() {
    let (_pg, _rail, a) = first_sharing_process().await;
    // A "database" that accepts connections and never answers: the joining process stays in
    // its start-up until its connection's limit (`database.timeout_ms`, here a minute).
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let (reached, mut reached_rx) = tokio::sync::mpsc::unbounded_channel();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
            let _ = reached.send(());
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let config = support::config_without_a_database(dir.path(), "");
    let mut joining = tokio::process::Command::new(support::railguard_binary())
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .env("RAILGUARD__PROXY__LISTEN", a.proxy.to_string())
        .env("RAILGUARD__PROXY__REUSE_PORT", "true")
        .env(
            "RAILGUARD__DATABASE__URL",
            format!("postgres://rg:pw@{silent_addr}/rg"),
        )
        .env("RAILGUARD__DATABASE__TIMEOUT_MS", "60000")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start railguard");
    tokio::time::timeout(std::time::Duration::from_secs(10), reached_rx.recv())
        .await
        .expect("the joining process reached for its database");
    for token in 1..=30 {
        let paid = tokio::time::timeout(
            std::time::Duration::from_secs(3),
            pay_on_a_new_connection(&a, token, "acct-join"),
        )
        .await
        .unwrap_or_else(|_| {
            panic!("payment {token} got no answer: the process still starting took its connection")
        });
        paid.assert_status(StatusCode::CREATED);
    }
    assert!(
        joining.try_wait().unwrap().is_none(),
        "the joining process was still starting throughout"
    );
    assert_eq!(a.metrics().await.get(FORWARDED), 30.0);
    let _ = joining.kill().await;
    holding.abort();
}
