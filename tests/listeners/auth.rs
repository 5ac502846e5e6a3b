//! Authentication and authorisation on all three listeners, against a real PostgreSQL, the
//! rail simulator and railguard over real sockets.
//!
//! Unauthenticated → 401, unauthorised → 403, and in each case nothing granted, nothing
//! forwarded, no mark moved, nothing forgotten; a grant is accepted only from the identity it
//! was issued to; the credentials file is reloaded on change; the lock API's per-identity rate
//! limit answers 429; every refusal is counted.

use railguard_testkit as support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use railguard::auth::secret;
use railguard::sdk::{LockClient, RailClient, SdkError};

use crate::identities::{EU, EU2, ONCALL, READER, SLOW, US, call, credentials, mark, setup};
use support::until;

/// How long a change of the credentials file (reloaded every 100 ms) may take to be in force.
const RELOADED: Duration = Duration::from_secs(5);

const LATE: &str = "rgs_late_000000000000000000000000000000000000000000000000000000000007";

fn locks(rg: &support::Railguard, secret: Option<&str>) -> LockClient {
    let client = rg.lock_client();
    match secret {
        Some(secret) => client.with_bearer(secret).unwrap(),
        None => client,
    }
}

fn rail(rg: &support::Railguard, secret: Option<&str>) -> RailClient {
    let client = RailClient::new(rg.proxy_url(""));
    match secret {
        Some(secret) => client.with_bearer(secret).unwrap(),
        None => client,
    }
}

async fn metrics(rg: &support::Railguard) -> String {
    let reply = call(
        Method::GET,
        &format!("http://{}/metrics", rg.admin),
        Some(READER),
        &[],
        "",
    )
    .await;
    reply.assert_status(StatusCode::OK);
    reply.body
}

fn refusals(metrics: &str, listener: &str, reason: &str) -> u64 {
    let series =
        format!("railguard_auth_refusals_total{{listener=\"{listener}\",reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series} in the metrics"))
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn the_lock_api_grants_only_to_identities_on_their_keys_and_holds_them_as_holder() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let ttl = Duration::from_secs(5);

    // No credentials, an unknown secret, a malformed header: 401, with the challenge.
    for (secret, why) in [(None, "none"), (Some("rgs_nobody"), "unknown")] {
        let e = locks(rg, secret)
            .acquire("acct-eu-1", "eu", ttl, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(matches!(e, SdkError::Unauthenticated(_)), "{why}: {e:?}");
    }
    let raw = call(
        Method::POST,
        &format!("{}/v1/locks/acct-eu-1/acquire", rg.lock_url()),
        None,
        &[("authorization", "Basic ZXU6ZXU=")],
        r#"{"ttl_ms":1000}"#,
    )
    .await;
    raw.assert_status(StatusCode::UNAUTHORIZED);
    assert_eq!(raw.json()["error"], "unauthenticated");
    assert!(
        raw.headers["www-authenticate"]
            .to_str()
            .unwrap()
            .starts_with("Bearer")
    );

    // A key outside the identity's patterns, an operator on the lock API, a holder that is
    // not the identity: 403.
    let e = locks(rg, Some(EU))
        .acquire("acct-us-1", "eu", ttl, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, SdkError::Forbidden(_)), "{e:?}");
    let e = locks(rg, Some(ONCALL))
        .acquire("acct-eu-1", "oncall", ttl, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, SdkError::Forbidden(_)), "{e:?}");
    let e = locks(rg, Some(EU))
        .acquire("acct-eu-1", "somebody-else", ttl, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, SdkError::Forbidden(_)), "{e:?}");
    // Inspect is a lock-API call too: another identity's key is not shown.
    let e = locks(rg, Some(US)).inspect("acct-eu-1").await.unwrap_err();
    assert!(matches!(e, SdkError::Forbidden(_)), "{e:?}");

    // Nothing was granted by any of those: the key is free for eu, whose grant names it.
    let status = locks(rg, Some(EU)).inspect("acct-eu-1").await.unwrap();
    assert!(status.holder.is_none(), "nothing granted: {status:?}");
    let grant = locks(rg, Some(EU))
        .acquire("acct-eu-1", "eu", ttl, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(grant.holder(), "eu");
    assert!(
        grant.fencing_proof().starts_with("v2."),
        "bound to its identity"
    );
    // The holder field may be left out: the identity is the holder.
    let raw = call(
        Method::POST,
        &format!("{}/v1/locks/acct-eu-2/acquire", rg.lock_url()),
        Some(EU),
        &[("content-type", "application/json")],
        r#"{"ttl_ms":1000}"#,
    )
    .await;
    raw.assert_status(StatusCode::OK);
    assert_eq!(raw.json()["holder"], "eu");
    locks(rg, Some(EU)).release(grant).await.unwrap();

    let m = metrics(rg).await;
    assert!(refusals(&m, "lock", "unauthenticated") >= 3, "{m}");
    assert!(refusals(&m, "lock", "forbidden") >= 4, "{m}");
}

#[tokio::test]
async fn the_proxy_forwards_only_an_identitys_own_grant_on_its_own_accounts() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let ttl = Duration::from_secs(5);
    let body = || Bytes::from_static(br#"{"amount":100}"#);
    let grant = locks(rg, Some(EU))
        .acquire("acct-eu-7", "eu", ttl, Duration::ZERO)
        .await
        .unwrap();

    // No credentials: 401, not forwarded.
    let reply = rail(rg, None)
        .post(&grant, "acct-eu-7", "/payments", body(), Some("k-1"))
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    // eu2 may pay on acct-eu-*, but this grant is eu's: 403.
    let reply = rail(rg, Some(EU2))
        .post(&grant, "acct-eu-7", "/payments", body(), Some("k-2"))
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    let json: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(json["error"], "forbidden");
    assert!(json["message"].as_str().unwrap().contains("eu2"), "{json}");
    // us may not pay on acct-eu-* at all; an operator on the proxy neither.
    for secret in [US, ONCALL] {
        let reply = rail(rg, Some(secret))
            .post(&grant, "acct-eu-7", "/payments", body(), Some("k-3"))
            .await
            .unwrap();
        assert_eq!(reply.status, StatusCode::FORBIDDEN);
    }
    // A worker presenting its own grant on another account's header: the account check
    // refuses it before any proof is looked at.
    let reply = rail(rg, Some(EU))
        .post(&grant, "acct-us-1", "/payments", body(), Some("k-4"))
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert!(s.rail.ledger().is_empty(), "nothing forwarded");
    assert_eq!(mark(rg, "acct-eu-7").await, 0, "no mark moved");

    // The grant's own identity pays; the rail never sees railguard's credentials.
    let reply = rail(rg, Some(EU))
        .post(&grant, "acct-eu-7", "/payments", body(), Some("k-5"))
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    let ledger = s.rail.ledger();
    assert_eq!(ledger.len(), 1);
    assert!(
        ledger[0].header("authorization").is_none(),
        "{:?}",
        ledger[0].headers
    );
    assert_eq!(mark(rg, "acct-eu-7").await, grant.token().get());

    let m = metrics(rg).await;
    assert_eq!(refusals(&m, "proxy", "unauthenticated"), 1, "{m}");
    assert_eq!(refusals(&m, "proxy", "forbidden"), 4, "{m}");
    assert!(
        m.lines()
            .any(|l| l == "railguard_requests_total{outcome=\"forbidden\"} 4"),
        "{m}"
    );
}

async fn audit_rows(pg: &support::Pg) -> i64 {
    pg.one("SELECT count(*) FROM railguard_audit", &[]).await
}

#[tokio::test]
async fn the_admin_listener_needs_an_operator_and_write_for_actions() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let admin = |path: &str| format!("http://{}{path}", rg.admin);
    let forget = r#"{"account":"acct-eu-1","key":"k-1"}"#;
    let json = [("content-type", "application/json")];

    // Probes stay open: a load balancer asks them without credentials. So does the runbook,
    // which an alert links to and a browser opens without any.
    for path in ["/healthz", "/readyz", "/runbook"] {
        let reply = call(Method::GET, &admin(path), None, &[], "").await;
        assert_eq!(reply.status, StatusCode::OK, "{path}");
    }
    // Without credentials, or with a worker's: nothing is read.
    for (secret, status) in [
        (None, StatusCode::UNAUTHORIZED),
        (Some(EU), StatusCode::FORBIDDEN),
    ] {
        for (method, path) in [
            (Method::GET, "/metrics"),
            (Method::GET, "/openapi.yaml"),
            (Method::POST, "/marks"),
            (Method::POST, "/idempotency/forget"),
            (Method::POST, "/recover"),
            (Method::GET, "/no-such-route"),
        ] {
            let reply = call(method.clone(), &admin(path), secret, &json, forget).await;
            assert_eq!(
                reply.status, status,
                "{method} {path} with {secret:?}: {}",
                reply.body
            );
        }
    }
    // A read-only operator reads, but forgets and recovers nothing.
    let reply = call(Method::GET, &admin("/openapi.yaml"), Some(READER), &[], "").await;
    assert_eq!(reply.status, StatusCode::OK);
    for path in ["/idempotency/forget", "/recover"] {
        let body = if path == "/recover" {
            r#"{"account":"acct-eu-1","reason":"test"}"#
        } else {
            forget
        };
        let reply = call(Method::POST, &admin(path), Some(READER), &json, body).await;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{path}: {}",
            reply.body
        );
    }
    assert_eq!(
        audit_rows(&s.pg).await,
        0,
        "nothing was attempted, so nothing audited"
    );
    // An operator with write reaches the action (no such record: 404), and it is audited.
    let reply = call(
        Method::POST,
        &admin("/idempotency/forget"),
        Some(ONCALL),
        &json,
        forget,
    )
    .await;
    reply.assert_status(StatusCode::NOT_FOUND);

    let m = metrics(rg).await;
    assert_eq!(refusals(&m, "admin", "unauthenticated"), 6, "{m}");
    assert_eq!(refusals(&m, "admin", "forbidden"), 8, "{m}");
}

#[tokio::test]
async fn a_changed_credentials_file_is_in_force_without_a_restart_and_a_broken_one_is_not() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let inspect =
        |secret: &'static str| async move { locks(rg, Some(secret)).inspect("acct-late-1").await };
    assert!(matches!(
        inspect(LATE).await,
        Err(SdkError::Unauthenticated(_))
    ));

    // Add an identity: in force within a few reload intervals.
    let late = format!(
        "[[worker]]\nname = \"late\"\nsecrets = [\"{}\"]\naccounts = [\"acct-late-*\"]\n",
        secret::digest_text(LATE)
    );
    write_atomically(&s.file, &credentials(&late));
    until(RELOADED, "the late identity in force", || async {
        inspect(LATE).await.is_ok()
    })
    .await;

    // A broken version is refused; the last good one stays.
    write_atomically(&s.file, "[[worker]]\nname = \"late\"\n");
    until(RELOADED, "a failed reload counted", || async {
        let m = metrics(rg).await;
        m.contains("railguard_credentials_reloads_total{outcome=\"failed\"} 1")
    })
    .await;
    assert!(
        inspect(LATE).await.is_ok(),
        "the last good version stays in force"
    );
    assert!(locks(rg, Some(EU)).inspect("acct-eu-1").await.is_ok());

    // Rotation's last step: the old secret removed, refused at once after the reload.
    write_atomically(&s.file, &late);
    until(RELOADED, "eu's old secret refused", || async {
        matches!(
            locks(rg, Some(EU)).inspect("acct-eu-1").await,
            Err(SdkError::Unauthenticated(_))
        )
    })
    .await;
    assert!(inspect(LATE).await.is_ok());
}

/// The documented revocation of a leaked secret — remove its digest — for a worker whose only
/// secret it is: the file with `secrets = []` is put in force, and from then on the secret gets
/// 401 on the lock API and on the proxy, while the other identities are unaffected.
#[tokio::test]
async fn removing_the_only_secret_of_a_worker_revokes_it_on_the_lock_api_and_the_proxy() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let body = || Bytes::from_static(br#"{"amount":100}"#);
    let grant = locks(rg, Some(EU))
        .acquire("acct-eu-9", "eu", Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap();
    let reply = rail(rg, Some(EU))
        .post(&grant, "acct-eu-9", "/payments", body(), Some("k-1"))
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);

    let with_eu = format!("secrets = [\"{}\"]", secret::digest_text(EU));
    let revoked = credentials("").replacen(&with_eu, "secrets = []", 1);
    assert_ne!(revoked, credentials(""), "the test removed eu's digest");
    write_atomically(&s.file, &revoked);
    until(RELOADED, "eu's revoked secret refused", || async {
        matches!(
            locks(rg, Some(EU)).inspect("acct-eu-9").await,
            Err(SdkError::Unauthenticated(_))
        )
    })
    .await;
    let m = metrics(rg).await;
    assert!(m.contains("railguard_credentials_stale 0"), "{m}");

    // The proxy refuses the revoked secret, even with a grant it took before.
    let reply = rail(rg, Some(EU))
        .post(&grant, "acct-eu-9", "/payments", body(), Some("k-2"))
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{:?}", reply.body);
    assert_eq!(s.rail.ledger().len(), 1, "nothing more forwarded");
    // Renewing the grant is refused too.
    assert!(matches!(
        locks(rg, Some(EU)).renew(&grant).await,
        Err(SdkError::Unauthenticated(_))
    ));
    // Every other identity is as it was.
    assert!(locks(rg, Some(EU2)).inspect("acct-eu-9").await.is_ok());
}

#[tokio::test]
async fn an_identity_over_its_lock_rate_gets_429_and_others_are_not_slowed() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let slow = locks(rg, Some(SLOW));
    let mut limited = 0;
    for _ in 0..10 {
        match slow.inspect("acct-slow-1").await {
            Ok(_) => {}
            Err(SdkError::RateLimited) => limited += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    // Two per second, a second's worth at once: at most 2 + what refilled meanwhile pass.
    assert!(limited >= 5, "{limited} of 10 limited");
    for _ in 0..10 {
        locks(rg, Some(EU)).inspect("acct-eu-1").await.unwrap();
    }
    let m = metrics(rg).await;
    assert_eq!(refusals(&m, "lock", "rate_limited"), limited, "{m}");
}

/// Acquires `key` for the identity of `secret` over the raw API: (token, lease secret).
async fn raw_acquire(rg: &support::Railguard, secret: &str, key: &str) -> (i64, String) {
    let reply = call(
        Method::POST,
        &format!("{}/v1/locks/{key}/acquire", rg.lock_url()),
        Some(secret),
        &[("content-type", "application/json")],
        r#"{"ttl_ms":10000}"#,
    )
    .await;
    reply.assert_status(StatusCode::OK);
    let grant = reply.json();
    (
        grant["token"].as_i64().unwrap(),
        grant["lease_secret"].as_str().unwrap().to_string(),
    )
}

/// POSTs `body` to the lock action `action` (`renew`, `release`) of `key` as `secret`.
async fn lock_action(
    rg: &support::Railguard,
    secret: &str,
    key: &str,
    action: &str,
    body: &str,
) -> support::Reply {
    call(
        Method::POST,
        &format!("{}/v1/locks/{key}/{action}", rg.lock_url()),
        Some(secret),
        &[("content-type", "application/json")],
        body,
    )
    .await
}

/// A lease secret that leaked to another identity whose patterns cover the key renews and
/// ends nothing: 403, counted; the holder's own renew and release still work.
#[tokio::test]
async fn renew_and_release_of_another_identitys_grant_are_forbidden() {
    let s = setup(&[], false).await;
    another_identitys_grant_is_forbidden(&s.rg).await;
}

/// The etcd backend answers as PostgreSQL does (403 only with the grant's own
/// token and secret, 410 for a wrong secret, the holder unaffected).
#[tokio::test]
async fn etcd_renew_and_release_of_another_identitys_grant_are_forbidden() {
    let etcd = support::EtcdCluster::single().await;
    let endpoints = etcd.endpoints_csv();
    let s = setup(
        &[
            ("RAILGUARD__LOCK__BACKEND", "etcd"),
            ("RAILGUARD__ETCD__ENDPOINTS", &endpoints),
        ],
        false,
    )
    .await;
    another_identitys_grant_is_forbidden(&s.rg).await;
    drop(s);
    drop(etcd);
}

async fn another_identitys_grant_is_forbidden(rg: &support::Railguard) {
    let (token, lease_secret) = raw_acquire(rg, EU, "acct-eu-7").await;
    let body = format!(r#"{{"token":{token},"lease_secret":"{lease_secret}"}}"#);
    let before = refusals(&metrics(rg).await, "lock", "forbidden");
    for action in ["renew", "release"] {
        let reply = lock_action(rg, EU2, "acct-eu-7", action, &body).await;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{action}: {}",
            reply.body
        );
        assert_eq!(reply.json()["error"], "forbidden");
    }
    assert_eq!(
        refusals(&metrics(rg).await, "lock", "forbidden"),
        before + 2
    );
    // Still eu's: inspect names it, and eu renews then releases it.
    let held = call(
        Method::GET,
        &format!("{}/v1/locks/acct-eu-7", rg.lock_url()),
        Some(EU),
        &[],
        "",
    )
    .await;
    assert_eq!(held.json()["holder"], "eu", "{}", held.body);
    for action in ["renew", "release"] {
        let reply = lock_action(rg, EU, "acct-eu-7", action, &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{action}: {}", reply.body);
    }
    // A wrong secret is still `lost` for everyone: the 403 needs the grant's own secret.
    let (token, _) = raw_acquire(rg, EU, "acct-eu-8").await;
    let wrong = format!(r#"{{"token":{token},"lease_secret":"{}"}}"#, "0".repeat(64));
    for who in [EU, EU2] {
        let reply = lock_action(rg, who, "acct-eu-8", "renew", &wrong).await;
        reply.assert_status(StatusCode::GONE);
    }
}

/// The rate limit bounds how often an identity asks, not how many of its
/// requests are open, and a waiting acquire stays open. One worker's waits must not fill the
/// lock listener's `max_in_flight` and starve the others.
#[tokio::test]
async fn one_identitys_waiting_acquires_do_not_starve_other_identities() {
    let s = setup(
        &[
            ("RAILGUARD__LOCK__MAX_IN_FLIGHT", "4"),
            ("RAILGUARD__AUTH__LOCK_IN_FLIGHT_PER_IDENTITY", "3"),
        ],
        false,
    )
    .await;
    let rg = &s.rg;
    raw_acquire(rg, EU, "acct-eu-w").await;
    let url = format!("{}/v1/locks/acct-eu-w/acquire", rg.lock_url());
    let waits: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                call(
                    Method::POST,
                    &url,
                    Some(EU),
                    &[("content-type", "application/json")],
                    r#"{"ttl_ms":1000,"wait_ms":3000}"#,
                )
                .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // eu's fourth open request is refused at once, nothing granted...
    let fourth = call(
        Method::POST,
        &url,
        Some(EU),
        &[("content-type", "application/json")],
        r#"{"ttl_ms":1000,"wait_ms":3000}"#,
    )
    .await;
    fourth.assert_status(StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(fourth.json()["error"], "rate_limited");
    // ...and eu2 is served from the listener's last slot.
    let other = call(
        Method::GET,
        &format!("{}/v1/locks/acct-eu-2", rg.lock_url()),
        Some(EU2),
        &[],
        "",
    )
    .await;
    other.assert_status(StatusCode::OK);
    for wait in waits {
        let reply = wait.await.unwrap();
        reply.assert_status(StatusCode::CONFLICT);
    }
    // The waits' slots came back.
    let again = call(
        Method::GET,
        &format!("{}/v1/locks/acct-eu-w", rg.lock_url()),
        Some(EU),
        &[],
        "",
    )
    .await;
    again.assert_status(StatusCode::OK);
}

/// Account patterns are checked against `Fencing-Account`, which by itself says nothing of the
/// account the payment moves money on. With `fencing.account_in_path` a request whose path
/// names another account is refused before the fence: a grant on one account never carries a
/// payment on another.
#[tokio::test]
async fn the_path_must_name_the_fenced_account_when_account_in_path_is_set() {
    let s = setup(
        &[(
            "RAILGUARD__FENCING__ACCOUNT_IN_PATH",
            "/accounts/{account}/",
        )],
        false,
    )
    .await;
    let rg = &s.rg;
    let body = || Bytes::from_static(br#"{"amount":100}"#);
    let grant = locks(rg, Some(EU))
        .acquire("acct-eu-5", "eu", Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap();
    for (path, key) in [
        ("/accounts/acct-us-1/payments", "k-1"),
        ("/accounts/acct-eu-55/payments", "k-2"),
        ("/payments?account=acct-eu-5", "k-3"),
        ("/accounts/acct%2Deu%2D5/payments", "k-4"),
        // Dot segments after the account, which the rail resolves.
        ("/accounts/acct-eu-5/../acct-us-1/payments", "k-6"),
        ("/accounts/acct-eu-5/%2e%2e/acct-us-1/payments", "k-7"),
        // Encoded twice (a server that decodes again resolves them), and overlong UTF-8
        // (a `.` to a lax decoder).
        ("/accounts/acct-eu-5/%252e%252e/acct-us-1/payments", "k-8"),
        ("/accounts/acct-eu-5/%c0%ae%c0%ae/acct-us-1/payments", "k-9"),
    ] {
        let reply = rail(rg, Some(EU))
            .post(&grant, "acct-eu-5", path, body(), Some(key))
            .await
            .unwrap();
        assert_eq!(reply.status, StatusCode::FORBIDDEN, "{path}");
        let json: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert!(
            json["message"]
                .as_str()
                .unwrap()
                .contains("/accounts/{account}/"),
            "{json}"
        );
    }
    assert!(s.rail.ledger().is_empty(), "nothing forwarded");
    assert_eq!(mark(rg, "acct-eu-5").await, 0, "no mark moved");
    let reply = rail(rg, Some(EU))
        .post(
            &grant,
            "acct-eu-5",
            "/accounts/acct-eu-5/payments",
            body(),
            Some("k-5"),
        )
        .await
        .unwrap();
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    assert_eq!(s.rail.ledger().len(), 1);
    assert_eq!(refusals(&metrics(rg).await, "proxy", "forbidden"), 8);
}

/// Replaces `path` by a rename, as configuration management tools do.
fn write_atomically(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

#[test]
fn check_config_and_serve_refuse_a_broken_credentials_file_naming_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("railguard.toml");
    let creds = dir.path().join("credentials.toml");
    std::fs::write(
        &config,
        format!(
            "[auth]\ncredentials_file = \"{}\"\n[database]\nurl = \"postgres://127.0.0.1:1/x\"\n",
            creds.display()
        ),
    )
    .unwrap();
    std::fs::write(&creds, credentials("")).unwrap();
    let ok = support::railguard_command(&["check-config"], &config, &[]);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(stdout.contains("6 identities"), "{stdout}");

    std::fs::write(
        &creds,
        credentials("[[worker]]\nname = \"x\"\nsecrets = [\"rgs_pasted_by_mistake_0123456789\"]\naccounts = [\"*\"]\n"),
    )
    .unwrap();
    for command in ["check-config", "serve"] {
        let out = support::railguard_command(&[command], &config, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{command}: {stderr}");
        assert!(
            stderr.contains(creds.to_str().unwrap()),
            "{command}: {stderr}"
        );
        assert!(
            stderr.contains("worker[4].secrets[0]"),
            "{command}: {stderr}"
        );
        assert!(
            !stderr.contains("rgs_pasted_by_mistake_0123456789"),
            "{command}: {stderr}"
        );
    }
    // With authentication on, proofs may not be switched off.
    let out = support::railguard_command(
        &["check-config"],
        &config,
        &[("RAILGUARD__FENCING__REQUIRE_PROOF", "false")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("fencing.require_proof"));
}

/// Authentication turned on by a restart while a grant taken without it is live.
/// Its holder is whatever name the worker sent (`worker-7`), not an authenticated identity, so
/// no identity may renew or release it (403: a free-text name proves nothing); the proxy
/// refuses its unbound proof too. The key comes free when the grant's ttl runs out, as
/// docs/operations.md ("Turning authentication on") says.
#[tokio::test]
async fn a_grant_taken_before_authentication_was_on_is_renewed_by_nobody_and_runs_out() {
    support::init_tracing();
    let pg = support::Pg::start().await;
    let rail = support::Rail::start().await;
    let (_dir, file) = crate::identities::credentials_file();
    let mut rg = support::Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let reply = call(
        Method::POST,
        &format!("{}/v1/locks/acct-eu-3/acquire", rg.lock_url()),
        None,
        &[("content-type", "application/json")],
        r#"{"holder":"worker-7","ttl_ms":4000}"#,
    )
    .await;
    reply.assert_status(StatusCode::OK);
    let grant = reply.json();
    let body = format!(
        r#"{{"token":{},"lease_secret":"{}"}}"#,
        grant["token"],
        grant["lease_secret"].as_str().unwrap()
    );
    rg.set_env("RAILGUARD__AUTH__CREDENTIALS_FILE", file.to_str().unwrap());
    rg.restart().await;
    for action in ["renew", "release"] {
        let reply = lock_action(&rg, EU, "acct-eu-3", action, &body).await;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{action}: {}",
            reply.body
        );
    }
    // Its ttl runs out; an identity then takes the key.
    let reply = call(
        Method::POST,
        &format!("{}/v1/locks/acct-eu-3/acquire", rg.lock_url()),
        Some(EU),
        &[("content-type", "application/json")],
        r#"{"ttl_ms":1000,"wait_ms":10000}"#,
    )
    .await;
    reply.assert_status(StatusCode::OK);
    assert_eq!(reply.json()["holder"], "eu");
}

/// Waiting acquires whose clients hang up give their identity's slots back at
/// once, not when their `wait_ms` runs out.
#[tokio::test]
async fn waiting_acquires_whose_clients_hang_up_give_their_slots_back() {
    use tokio::io::AsyncWriteExt as _;
    let s = setup(
        &[("RAILGUARD__AUTH__LOCK_IN_FLIGHT_PER_IDENTITY", "2")],
        false,
    )
    .await;
    let rg = &s.rg;
    raw_acquire(rg, EU, "acct-eu-h").await;
    let body = r#"{"ttl_ms":1000,"wait_ms":20000}"#;
    let request = format!(
        "POST /v1/locks/acct-eu-h/acquire HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {EU}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut waiters = Vec::new();
    for _ in 0..2 {
        let mut c = tokio::net::TcpStream::connect(rg.lock).await.unwrap();
        c.write_all(request.as_bytes()).await.unwrap();
        waiters.push(c);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let url = format!("{}/v1/locks/acct-eu-h", rg.lock_url());
    let inspect = || call(Method::GET, &url, Some(EU), &[], "");
    assert_eq!(
        inspect().await.status,
        StatusCode::TOO_MANY_REQUESTS,
        "both slots are open"
    );
    drop(waiters);
    let started = std::time::Instant::now();
    let status = support::within(Duration::from_secs(8), || async {
        let status = inspect().await.status;
        (status != StatusCode::TOO_MANY_REQUESTS).then_some(status)
    })
    .await
    .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        status,
        StatusCode::OK,
        "the hung-up waits still held eu's slots after {:?}",
        started.elapsed()
    );
}
