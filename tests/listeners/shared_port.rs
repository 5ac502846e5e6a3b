//! `proxy.reuse_port`: railguard processes that set it share one proxy address, the kernel
//! spreading new connections among them, and every request is fenced whichever process took
//! it; a process that does not set it cannot start on an address another holds.

use railguard_testkit as support;

use http::StatusCode;
use support::{Pg, Rail, Railguard, init_tracing};

const FORWARDED: &str = "railguard_requests_total{outcome=\"forwarded\"}";

/// Pays `token` on `account` through `rg`'s proxy address on a connection of its own, so the
/// kernel picks a process for each payment.
async fn pay_on_a_new_connection(rg: &Railguard, token: i64, account: &str) -> support::Reply {
    rg.http().pay_with(rg, token, account).await
}

#[tokio::test]
async fn processes_that_set_reuse_port_share_the_proxy_address_and_fence_as_one() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let a = Railguard::start_process(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__PROXY__REUSE_PORT", "true")],
    )
    .await;
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
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let a = Railguard::start_process(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__PROXY__REUSE_PORT", "true")],
    )
    .await;
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
        stderr.contains(&shared) && stderr.contains("proxy.listen"),
        "the error names the address and the key: {stderr}"
    );
    // The process that holds the address still serves.
    pay_on_a_new_connection(&a, 3, "acct-held")
        .await
        .assert_status(StatusCode::CREATED);
}
