//! The lock service's behavioural suite, over its HTTP API and the worker SDK, against real
//! backends. Every case is a function of a [`World`]; the `suite!` macro instantiates all
//! of them once per backend, so each backend must pass the same suite unchanged.

use railguard_testkit as support;

use std::collections::BTreeSet;
use std::time::Duration;

use http::StatusCode;
use railguard::sdk::{LeaseLost, LockClient, SdkError};
use support::etcd::EtcdCluster;
use support::{Backend, Http, World};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(10);
const NOW: Duration = Duration::ZERO;

async fn inv04_tokens_strictly_increase_across_cycles_restarts_and_recreation(mut w: World) {
    let lock = w.client();
    let mut last = 0;
    let mut check = |token: i64, when: &str| {
        assert!(token > last, "{when}: token {token} after {last}");
        last = token;
    };
    for i in 0..1000 {
        let handle = lock.acquire("inv04", "w", TTL, NOW).await.unwrap();
        check(handle.token().get(), &format!("cycle {i}"));
        lock.release(handle).await.unwrap();
    }
    // Other keys draw from the same source; this key's tokens still only grow.
    let other = lock.acquire("inv04-other", "w", TTL, NOW).await.unwrap();
    lock.release(other).await.unwrap();
    let handle = lock.acquire("inv04", "w", TTL, NOW).await.unwrap();
    check(handle.token().get(), "after another key");
    lock.release(handle).await.unwrap();

    if matches!(w.backend, Backend::Postgres) {
        // The key's row deleted outright (an operator cleaning up): the next grant still gets
        // a larger token, because tokens come from one global sequence, not from the row.
        w.pg.client()
            .await
            .execute("DELETE FROM lock_entry WHERE key = 'inv04'", &[])
            .await
            .unwrap();
        let handle = lock.acquire("inv04", "w", TTL, NOW).await.unwrap();
        check(handle.token().get(), "after the row was deleted");
        lock.release(handle).await.unwrap();
    }

    w.rg.restart().await;
    let lock = w.client();
    let handle = lock.acquire("inv04", "w", TTL, NOW).await.unwrap();
    check(handle.token().get(), "after a railguard restart");
    lock.release(handle).await.unwrap();

    w.restart_backend().await;
    let handle = retry_acquire(&lock, "inv04", TTL).await;
    check(handle.token().get(), "after a backend restart");
    lock.release(handle).await.unwrap();
}

/// Acquires, retrying while the backend is coming back.
async fn retry_acquire(lock: &LockClient, key: &str, ttl: Duration) -> railguard::sdk::LockHandle {
    let back = "a grant once the backend is back";
    support::eventually(Duration::from_secs(10), back, || async {
        match lock.acquire(key, "w", ttl, NOW).await {
            Ok(handle) => Some(handle),
            Err(SdkError::Unavailable(_)) => None,
            Err(e) => panic!("acquire failed: {e}"),
        }
    })
    .await
}

/// One grant's life, in the backend's clock: from `granted` to when it ended.
#[derive(Debug, Clone, Copy)]
struct Held {
    token: i64,
    granted_us: i64,
    ended_us: i64,
}

async fn inv06_concurrent_acquirers_never_overlap(w: World) {
    let http = Http::new();
    // Two railguards on one backend, so that acquires really race in the backend and not only
    // in one process's queue.
    let other = w.another_railguard(&[]).await;
    let urls = [w.rg.lock_url(), other.lock_url()];
    let mut tasks = Vec::new();
    // Some grants are released, some are left to expire: both must end before the next grant
    // begins. etcd leases are whole seconds, so there fewer are left to expire.
    let backend = w.backend;
    let rounds = match backend {
        Backend::Postgres => 6,
        Backend::Etcd => 3,
    };
    for worker in 0..32 {
        let http = http.clone();
        let url = urls[worker % 2].clone();
        tasks.push(tokio::spawn(async move {
            let mut history = Vec::new();
            for round in 0..rounds {
                let (expire, short_ms) = match backend {
                    Backend::Postgres => ((worker + round) % 2 == 0, 40),
                    Backend::Etcd => (worker % 16 == 0 && round == 0, 1000),
                };
                let ttl_ms = if expire { short_ms } else { 5_000 };
                // Half the workers poll without waiting, so attempts collide in the backend.
                let wait_ms = if worker % 4 == 0 { 0 } else { 20_000 };
                let body = format!(
                    "{{\"holder\":\"w{worker}\",\"ttl_ms\":{ttl_ms},\"wait_ms\":{wait_ms}}}"
                );
                let reply = loop {
                    let reply = post(&http, &format!("{url}/v1/locks/inv06/acquire"), &body).await;
                    if reply.status == StatusCode::CONFLICT && wait_ms == 0 {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    }
                    break reply;
                };
                reply.assert_status(StatusCode::OK);
                let grant = reply.json();
                let token = grant["token"].as_i64().unwrap();
                let secret = grant["lease_secret"].as_str().unwrap().to_string();
                let granted_us = grant["granted_at_us"].as_i64().unwrap();
                let expires_us = grant["expires_at_us"].as_i64().unwrap();
                if expire {
                    history.push(Ended {
                        held: Held {
                            token,
                            granted_us,
                            ended_us: expires_us,
                        },
                        revision: None,
                    });
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                let reply = post(
                    &http,
                    &format!("{url}/v1/locks/inv06/release"),
                    &format!("{{\"token\":{token},\"lease_secret\":\"{secret}\"}}"),
                )
                .await;
                reply.assert_status(StatusCode::OK);
                let released = reply.json();
                let ended_us = released["released_at_us"].as_i64().unwrap();
                let revision = released["released_revision"].as_i64();
                history.push(Ended {
                    held: Held {
                        token,
                        granted_us,
                        ended_us,
                    },
                    revision,
                });
            }
            history
        }));
    }
    let mut history = Vec::new();
    for task in tasks {
        history.extend(task.await.unwrap());
    }
    assert_eq!(history.len(), 32 * rounds);
    history.sort_by_key(|e| e.held.token);
    for pair in history.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        match backend {
            // One clock, the database's: each grant starts after the previous one ended.
            Backend::Postgres => {
                assert!(
                    b.held.granted_us >= a.held.ended_us,
                    "grants overlap in the database's time: {a:?} then {b:?}"
                );
            }
            // etcd's order is its revisions: a grant ended by a release at revision r is
            // followed only by grants whose token (their put's revision) is above r.
            Backend::Etcd => {
                if let Some(r) = a.revision {
                    assert!(
                        b.held.token > r,
                        "a grant began before the previous release: {a:?} then {b:?}"
                    );
                }
            }
        }
    }
    let tokens: BTreeSet<i64> = history.iter().map(|e| e.held.token).collect();
    assert_eq!(tokens.len(), history.len(), "every grant has its own token");
}

/// A grant's life and, for etcd, the revision of the release that ended it.
#[derive(Debug, Clone, Copy)]
struct Ended {
    held: Held,
    revision: Option<i64>,
}

async fn post(http: &Http, url: &str, body: &str) -> support::Reply {
    http.send(
        http::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap(),
    )
    .await
    .expect("lock API answers")
}

async fn expired_grant_is_taken_over_and_the_old_holder_is_lost(w: World) {
    let lock = w.client();
    let old = lock
        .acquire("takeover", "w1", w.short_ttl(), NOW)
        .await
        .unwrap();
    assert_eq!(
        lock.acquire("takeover", "w2", TTL, NOW).await,
        Err(SdkError::Held)
    );
    // Wait for the key: it comes free only when the old lease has run out.
    let new = lock
        .acquire("takeover", "w2", TTL, w.short_ttl() * 10)
        .await
        .unwrap();
    assert!(new.token() > old.token(), "the takeover has a larger token");

    assert_eq!(lock.renew(&old).await, Err(SdkError::Lost));
    assert_eq!(lock.release(old.clone()).await, Err(SdkError::Lost));
    let status = lock.inspect("takeover").await.unwrap();
    assert!(status.held);
    assert_eq!(
        status.holder.as_deref(),
        Some("w2"),
        "the old holder changed nothing"
    );
    lock.renew(&new).await.unwrap();
    lock.release(new).await.unwrap();
    let m = w.rg.metrics().await;
    let backend = backend_label(w.backend);
    if matches!(w.backend, Backend::Postgres) {
        // PostgreSQL keeps the expired row and takes it over; etcd deletes an expired key
        // itself, so there the new grant creates the key afresh.
        assert_eq!(
            m.get(&format!("lock_takeovers_total{{backend=\"{backend}\"}}")),
            1.0
        );
    }
    assert_eq!(
        m.get(&format!("lock_lost_total{{backend=\"{backend}\"}}")),
        2.0
    );
    assert!(m.get(&format!("lock_grants_total{{backend=\"{backend}\"}}")) >= 2.0);
}

fn backend_label(backend: Backend) -> &'static str {
    match backend {
        Backend::Postgres => "postgres",
        Backend::Etcd => "etcd",
    }
}

async fn a_hundred_renewals_keep_the_token(w: World) {
    let http = Http::new();
    let url = w.rg.lock_url();
    let reply = post(
        &http,
        &format!("{url}/v1/locks/renewed/acquire"),
        "{\"holder\":\"w\",\"ttl_ms\":5000}",
    )
    .await;
    let token = reply.json()["token"].as_i64().unwrap();
    let secret = reply.json()["lease_secret"].as_str().unwrap().to_string();
    let mut last_expiry = reply.json()["expires_at_us"].as_i64().unwrap();
    for _ in 0..100 {
        let reply = post(
            &http,
            &format!("{url}/v1/locks/renewed/renew"),
            &format!("{{\"token\":{token},\"lease_secret\":\"{secret}\"}}"),
        )
        .await;
        reply.assert_status(StatusCode::OK);
        let renewed = reply.json();
        assert_eq!(renewed["token"], token);
        let expiry = renewed["expires_at_us"].as_i64().unwrap();
        assert!(expiry >= last_expiry, "renewal extends the lease");
        last_expiry = expiry;
    }
    if matches!(w.backend, Backend::Postgres) {
        let row =
            w.pg.client()
                .await
                .query_one("SELECT token FROM lock_entry WHERE key = 'renewed'", &[])
                .await
                .unwrap();
        assert_eq!(
            row.get::<_, i64>(0),
            token,
            "the stored token never changed"
        );
    }
    if matches!(w.backend, Backend::Etcd) {
        let (_, mod_revision, _, _) = w
            .etcd()
            .get("/railguard/locks/renewed")
            .await
            .expect("the key exists");
        assert_eq!(
            mod_revision, token,
            "renewal never wrote the key: its ModRevision is still the token"
        );
    }
    let reply = post(
        &http,
        &format!("{url}/v1/locks/renewed/release"),
        &format!("{{\"token\":{token},\"lease_secret\":\"{secret}\"}}"),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
}

async fn waiters_are_served_in_arrival_order(w: World) {
    let lock = w.client();
    let holder = lock.acquire("fifo", "holder", TTL, NOW).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..5 {
        let lock = lock.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let handle = lock
                .acquire("fifo", &format!("waiter-{i}"), TTL, Duration::from_secs(20))
                .await
                .unwrap();
            tx.send(i).unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            lock.release(handle).await.unwrap();
        });
        // Arrival order is the order the requests reach the service.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lock.release(holder).await.unwrap();
    let mut order = Vec::new();
    for _ in 0..5 {
        order.push(
            tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .unwrap()
                .unwrap(),
        );
    }
    assert_eq!(order, [0, 1, 2, 3, 4]);
}

/// The world for these cases polls rarely, so only a notification or the expiry timer can
/// wake a waiter in time.
const SLOW_POLL: &[(&str, &str)] = &[("RAILGUARD__LOCK__POLL_INTERVAL_MS", "30000")];
/// A waiter's retry at least every 100 ms while the key is held.
const FAST_POLL: &[(&str, &str)] = &[("RAILGUARD__LOCK__POLL_INTERVAL_MS", "100")];

async fn a_waiter_is_woken_by_release(w: World) {
    let lock = w.client();
    let holder = lock
        .acquire("wake", "holder", Duration::from_secs(60), NOW)
        .await
        .unwrap();
    let waiter = {
        let lock = lock.clone();
        tokio::spawn(async move {
            lock.acquire("wake", "waiter", TTL, Duration::from_secs(20))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished());
    lock.release(holder).await.unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(10), waiter).await;
    assert!(
        granted.is_ok_and(|r| r.unwrap().is_ok()),
        "the release woke the waiter (the lease had 60 s left)"
    );
}

async fn a_waiter_is_woken_by_a_release_made_through_another_railguard(w: World) {
    let other = w.another_railguard(SLOW_POLL).await;
    let lock = w.client();
    let holder = other
        .lock_client()
        .acquire("wake2", "holder", Duration::from_secs(60), NOW)
        .await
        .unwrap();
    let waiter = {
        let lock = lock.clone();
        tokio::spawn(async move {
            lock.acquire("wake2", "waiter", TTL, Duration::from_secs(20))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    other.lock_client().release(holder).await.unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(10), waiter).await;
    assert!(
        granted.is_ok_and(|r| r.unwrap().is_ok()),
        "the other process's release reached this waiter"
    );
}

async fn a_waiter_is_woken_by_expiry(w: World) {
    let lock = w.client();
    let _abandoned = lock
        .acquire("expire", "holder", w.short_ttl() * 3, NOW)
        .await
        .unwrap();
    let started = Instant::now();
    let handle = lock
        .acquire("expire", "waiter", TTL, Duration::from_secs(20))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "woken at expiry, not by the 30 s poll"
    );
    lock.release(handle).await.unwrap();
}

async fn a_waiter_gives_up_when_its_wait_runs_out(w: World) {
    let lock = w.client();
    let _holder = lock.acquire("busy", "holder", TTL, NOW).await.unwrap();
    let started = Instant::now();
    assert_eq!(
        lock.acquire("busy", "waiter", TTL, Duration::from_millis(300))
            .await,
        Err(SdkError::Held)
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it waited its full wait"
    );
    assert!(
        lock.inspect("busy").await.unwrap().holder.as_deref() == Some("holder"),
        "the holder still holds"
    );
}

async fn too_many_waiters_get_429(w: World) {
    let lock = w.client();
    let _holder = lock.acquire("crowd", "holder", TTL, NOW).await.unwrap();
    let mut waiters = Vec::new();
    for i in 0..2 {
        let lock = lock.clone();
        waiters.push(tokio::spawn(async move {
            lock.acquire("crowd", &format!("w{i}"), TTL, Duration::from_secs(3))
                .await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        lock.acquire("crowd", "w3", TTL, Duration::from_secs(3))
            .await,
        Err(SdkError::TooManyWaiters)
    );
    for w in waiters {
        assert_eq!(w.await.unwrap(), Err(SdkError::Held));
    }
}

async fn a_held_key_reveals_no_token_and_inspect_never_shows_one(w: World) {
    let http = Http::new();
    let url = w.rg.lock_url();
    let reply = post(
        &http,
        &format!("{url}/v1/locks/secret/acquire"),
        "{\"holder\":\"w1\",\"ttl_ms\":5000}",
    )
    .await;
    let token = reply.json()["token"].as_i64().unwrap().to_string();
    let held = post(
        &http,
        &format!("{url}/v1/locks/secret/acquire"),
        "{\"holder\":\"w2\",\"ttl_ms\":5000}",
    )
    .await;
    assert_eq!(held.status, StatusCode::CONFLICT);
    assert_eq!(held.json()["error"], "held");
    assert!(
        held.json().get("token").is_none() && !held.body.contains(&token),
        "{}",
        held.body
    );
    let (status, body) = http.get(&format!("{url}/v1/locks/secret")).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let inspection: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(inspection["held"], true);
    assert_eq!(inspection["holder"], "w1");
    assert!(inspection.get("token").is_none(), "{body}");
}

async fn bad_input_gets_400_with_a_clear_message(w: World) {
    let http = Http::new();
    let url = w.rg.lock_url();
    let long_key = "k".repeat(300);
    let cases: Vec<(String, &str, &str)> = vec![
        (
            format!("{url}/v1/locks/k/acquire"),
            "{not json",
            "invalid JSON",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":-5}",
            "ttl_ms",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":99999999999}",
            "ttl_ms",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":0}",
            "ttl_ms",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":1000,\"wait_ms\":999999999}",
            "wait_ms",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":1000,\"colour\":\"red\"}",
            "unknown field",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"holder\":\"\",\"ttl_ms\":1000}",
            "holder",
        ),
        (
            format!("{url}/v1/locks/k/acquire"),
            "{\"ttl_ms\":1000}",
            "holder",
        ),
        (
            format!("{url}/v1/locks/{long_key}/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":1000}",
            "longer than 256",
        ),
        (
            format!("{url}/v1/locks/a%2Fb/acquire"),
            "{\"holder\":\"w\",\"ttl_ms\":1000}",
            "may only hold",
        ),
        (
            format!("{url}/v1/locks/k/renew"),
            "{\"token\":0}",
            "positive",
        ),
        (
            format!("{url}/v1/locks/k/renew"),
            "{\"token\":\"5\"}",
            "invalid JSON",
        ),
        (
            format!("{url}/v1/locks/k/release"),
            "{\"token\":5,\"holder\":\"w\"}",
            "unknown field",
        ),
        // A struct also deserializes from an array of its fields: not a request body here.
        (
            format!("{url}/v1/locks/k/acquire"),
            "[\"w\", 1000, 0]",
            "expected a JSON object",
        ),
        // Clients from before lease secrets send only the token: told what is missing.
        (
            format!("{url}/v1/locks/k/renew"),
            "{\"token\":5}",
            "missing `lease_secret`",
        ),
        (
            format!("{url}/v1/locks/k/release"),
            "{\"token\":5,\"lease_secret\":\"abc\"}",
            "64 hex digits",
        ),
    ];
    for (url, body, expect) in cases {
        let reply = post(&http, &url, body).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{url} {body}: {}",
            reply.body
        );
        assert_eq!(reply.json()["error"], "bad_request");
        let message = reply.json()["message"].as_str().unwrap().to_string();
        assert!(
            message.contains(expect),
            "{body}: {message:?} should mention {expect:?}"
        );
    }
    let huge = format!(
        "{{\"holder\":\"{}\",\"ttl_ms\":1000}}",
        "h".repeat(64 * 1024)
    );
    assert_eq!(
        post(&http, &format!("{url}/v1/locks/k/acquire"), &huge)
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert!(
        !w.client().inspect("k").await.unwrap().held,
        "nothing was granted"
    );
}

async fn auto_renew_keeps_a_lease_and_reports_loss_when_the_service_stops(mut w: World) {
    let lock = w.client();
    let ttl = w.short_ttl().max(Duration::from_millis(600));
    let handle = lock.acquire("kept", "w", ttl, NOW).await.unwrap();
    let mut keep = lock.keep_alive(&handle);
    tokio::time::sleep(ttl * 5 / 2).await;
    assert_eq!(keep.lost_reason(), None, "renewed past two ttls");
    assert!(lock.inspect("kept").await.unwrap().held);

    // When it is reported (by the lease's floor, never after) is the SDK's own test, on a
    // paused clock; here, that a stopped service is noticed at all.
    w.rg.stop().await;
    let reason = tokio::time::timeout(Duration::from_secs(5), keep.lost())
        .await
        .expect("loss is reported");
    assert!(matches!(reason, LeaseLost::Unconfirmed(_)), "{reason:?}");
    w.rg.start_again().await;
}

async fn auto_renew_reports_loss_when_the_backend_stops(mut w: World) {
    let lock = w.client();
    let ttl = w.short_ttl().max(Duration::from_millis(600));
    let handle = lock.acquire("kept2", "w", ttl, NOW).await.unwrap();
    let mut keep = lock.keep_alive(&handle);
    tokio::time::sleep(ttl + ttl / 6).await;
    w.stop_backend().await;
    let reason = tokio::time::timeout(Duration::from_secs(5), keep.lost())
        .await
        .expect("loss is reported");
    assert!(matches!(reason, LeaseLost::Unconfirmed(_)), "{reason:?}");
}

async fn auto_renew_reports_revocation(w: World) {
    let lock = w.client();
    let handle = lock
        .acquire(
            "revoked",
            "w",
            w.short_ttl().max(Duration::from_millis(900)),
            NOW,
        )
        .await
        .unwrap();
    let mut keep = lock.keep_alive(&handle);
    // Someone releases the grant behind the keep-alive's back (an operator, say).
    lock.release(handle.clone()).await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), keep.lost())
        .await
        .expect("loss is reported");
    assert_eq!(reason, LeaseLost::Revoked);
}

async fn grants_fence_the_rail_through_the_sdk(w: World) {
    // T-042 with the real lock service: the stalled survivor's token is fenced at the proxy.
    let lock = w.client();
    let rail = railguard::sdk::RailClient::new(w.rg.proxy_url(""));
    let w1 = lock
        .acquire("acct-42", "w1", w.short_ttl(), NOW)
        .await
        .unwrap();
    // W1 stalls past its lease (it never renews); W2 waits for the key and takes it.
    let w2 = lock
        .acquire("acct-42", "w2", TTL, w.short_ttl() * 10)
        .await
        .unwrap();
    assert!(w2.token() > w1.token());
    support::payment::paid_keyed(&rail, &w2, "acct-42", r#"{"amount":1}"#, "p-1").await;
    let stale = support::payment::pay_keyed(&rail, &w1, "acct-42", r#"{"amount":1}"#, "p-1").await;
    match stale.unwrap_err() {
        SdkError::FencedOut {
            account,
            token,
            body,
        } => {
            assert_eq!(account, "acct-42");
            assert_eq!(token, w1.token().get());
            assert!(
                body.contains("\"fenced_out\""),
                "the proxy's 409 body: {body}"
            );
        }
        other => panic!("expected FencedOut, got {other:?}"),
    }
    let ledger = w.rail.ledger();
    assert_eq!(ledger.len(), 1, "the rail saw one payment");
    assert_eq!(
        ledger[0].token.as_deref(),
        Some(w2.token().get().to_string().as_str())
    );
    assert_eq!(w.rg.metrics().await.get("lock_fenced_out_total"), 1.0);
}

async fn backend_down_means_503_and_no_token(mut w: World) {
    let lock = w.client();
    let held = lock.acquire("down", "w", TTL, NOW).await.unwrap();
    w.stop_backend().await;
    let http = Http::new();
    let url = w.rg.lock_url();
    for (path, body) in [
        ("acquire", "{\"holder\":\"w2\",\"ttl_ms\":5000}".to_string()),
        // Any well-formed secret: the backend is not there to check it.
        (
            "renew",
            format!(
                "{{\"token\":{},\"lease_secret\":\"{}\"}}",
                held.token().get(),
                "00".repeat(32)
            ),
        ),
        (
            "release",
            format!(
                "{{\"token\":{},\"lease_secret\":\"{}\"}}",
                held.token().get(),
                "00".repeat(32)
            ),
        ),
    ] {
        let reply = post(&http, &format!("{url}/v1/locks/down/{path}"), &body).await;
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{path}: {}",
            reply.body
        );
        assert_eq!(reply.headers.get("retry-after").unwrap(), "1");
        assert_eq!(reply.json()["error"], "unavailable");
        assert!(
            reply.json().get("token").is_none(),
            "no token invented: {}",
            reply.body
        );
    }
    // Back: the next token is larger than any before the outage.
    w.start_backend().await;
    let next = retry_acquire(&lock, "down-after", TTL).await;
    assert!(
        next.token() > held.token(),
        "{} after {}",
        next.token(),
        held.token()
    );
}

/// A stalled worker that knows only its own superseded grant tries renew and
/// release with every token near its own and near the current one. No answer may differ
/// between guesses (a yes/no to a guess is a read path that returns the token), and the
/// current grant must survive every attempt.
async fn a_superseded_holder_can_neither_learn_nor_end_the_current_grant(w: World) {
    let http = Http::new();
    let url = w.rg.lock_url();
    let acquire = |holder: &str, ttl: Duration, wait: Duration| {
        format!(
            "{{\"holder\":\"{holder}\",\"ttl_ms\":{},\"wait_ms\":{}}}",
            ttl.as_millis(),
            wait.as_millis()
        )
    };
    let old = post(
        &http,
        &format!("{url}/v1/locks/oracle/acquire"),
        &acquire("w1", w.short_ttl(), NOW),
    )
    .await;
    old.assert_status(StatusCode::OK);
    let old = old.json();
    let old_token = old["token"].as_i64().unwrap();
    // W1 stalls past its lease; W2 waits for the key and takes it.
    let new = post(
        &http,
        &format!("{url}/v1/locks/oracle/acquire"),
        &acquire("w2", TTL, w.short_ttl() * 10),
    )
    .await;
    new.assert_status(StatusCode::OK);
    let new = new.json();
    let new_token = new["token"].as_i64().unwrap();
    assert!(new_token > old_token);

    // The attacker's bodies: its own secret (if the service issued one) or none, with each
    // guessed token.
    let own_secret = old.get("lease_secret").cloned();
    let mut bodies = Vec::new();
    for guess in (old_token - 3).max(1)..=new_token + 3 {
        bodies.push((guess, serde_json::json!({ "token": guess })));
        if let Some(secret) = &own_secret {
            bodies.push((
                guess,
                serde_json::json!({ "token": guess, "lease_secret": secret }),
            ));
            bodies.push((
                guess,
                serde_json::json!({ "token": guess, "lease_secret": "00".repeat(32) }),
            ));
        }
    }
    for action in ["renew", "release"] {
        let mut answers = BTreeSet::new();
        for (guess, body) in &bodies {
            let reply = post(
                &http,
                &format!("{url}/v1/locks/oracle/{action}"),
                &body.to_string(),
            )
            .await;
            assert!(
                !reply.status.is_success(),
                "{action} with guessed token {guess} succeeded: {}",
                reply.body
            );
            let shape = body.get("lease_secret").is_some();
            answers.insert((
                shape,
                reply.status.as_u16(),
                reply.json()["error"].to_string(),
            ));
        }
        let shapes: BTreeSet<bool> = answers.iter().map(|a| a.0).collect();
        assert_eq!(
            answers.len(),
            shapes.len(),
            "{action}: the answer must not depend on the guess: {answers:?}"
        );
    }
    // The current grant is untouched: still held by W2, and W2 can renew and release it.
    let (_, inspect) = http.get(&format!("{url}/v1/locks/oracle")).await.unwrap();
    let inspect: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(inspect["holder"], "w2", "{inspect}");
    let mut own = serde_json::json!({ "token": new_token });
    if let Some(secret) = new.get("lease_secret") {
        own["lease_secret"] = secret.clone();
    }
    let renewed = post(
        &http,
        &format!("{url}/v1/locks/oracle/renew"),
        &own.to_string(),
    )
    .await;
    renewed.assert_status(StatusCode::OK);
    // Probing is visible to operators.
    let probes = w.rg.metrics().await.get(&format!(
        "lock_rejected_secrets_total{{backend=\"{}\"}}",
        backend_label(w.backend)
    ));
    assert!(probes > 0.0, "probes counted: {probes}");
    let released = post(
        &http,
        &format!("{url}/v1/locks/oracle/release"),
        &own.to_string(),
    )
    .await;
    released.assert_status(StatusCode::OK);
}

support::suite!([postgres => Backend::Postgres, etcd => Backend::Etcd] {
    inv04_tokens_strictly_increase => inv04_tokens_strictly_increase_across_cycles_restarts_and_recreation,
    inv06_no_overlapping_grants => inv06_concurrent_acquirers_never_overlap,
    takeover_of_an_expired_grant => expired_grant_is_taken_over_and_the_old_holder_is_lost,
    renewals_keep_the_token => a_hundred_renewals_keep_the_token,
    fifo_waiters => waiters_are_served_in_arrival_order,
    woken_by_release => a_waiter_is_woken_by_release with SLOW_POLL,
    woken_by_release_elsewhere => a_waiter_is_woken_by_a_release_made_through_another_railguard with SLOW_POLL,
    woken_by_expiry => a_waiter_is_woken_by_expiry with SLOW_POLL,
    wait_runs_out => a_waiter_gives_up_when_its_wait_runs_out,
    waiters_are_bounded => too_many_waiters_get_429 with &[("RAILGUARD__LOCK__MAX_WAITERS", "2")],
    no_token_leaks => a_held_key_reveals_no_token_and_inspect_never_shows_one,
    bad_input => bad_input_gets_400_with_a_clear_message,
    auto_renew_and_service_loss => auto_renew_keeps_a_lease_and_reports_loss_when_the_service_stops,
    auto_renew_and_backend_loss => auto_renew_reports_loss_when_the_backend_stops,
    auto_renew_and_revocation => auto_renew_reports_revocation,
    backend_down => backend_down_means_503_and_no_token,
    superseded_holder_learns_nothing => a_superseded_holder_can_neither_learn_nor_end_the_current_grant,
    t042_through_the_sdk => grants_fence_the_rail_through_the_sdk,
});

/// C1 §1.6 through the SDK: the paydb row remembers the newest grant that wrote it.
#[tokio::test]
async fn paydb_fenced_update_refuses_a_superseded_grant() {
    use railguard::sdk::paydb::{FencedUpdate, Fencing, PayDbError};
    let w = World::start(Backend::Postgres, &[]).await;
    let db = w.pg.client().await;
    db.batch_execute(
        "CREATE TABLE account (id text PRIMARY KEY, balance bigint NOT NULL, fence bigint NOT NULL DEFAULT 0);
         INSERT INTO account (id, balance) VALUES ('a', 100);",
    )
    .await
    .unwrap();
    let lock = w.client();
    let w1 = lock
        .acquire("paydb-a", "w1", Duration::from_millis(100), NOW)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let w2 = lock.acquire("paydb-a", "w2", TTL, NOW).await.unwrap();

    let update = FencedUpdate::new("account").unwrap();
    let debit = "balance = balance - $3";
    update
        .execute(&db, &w2, &"a", debit, &[&10i64])
        .await
        .unwrap();
    update
        .execute(&db, &w2, &"a", debit, &[&10i64])
        .await
        .unwrap(); // same grant: accepted
    let stale = update.execute(&db, &w1, &"a", debit, &[&10i64]).await;
    assert!(
        matches!(stale, Err(PayDbError::FencedOut { .. })),
        "{stale:?}"
    );
    let missing = update.execute(&db, &w2, &"nope", debit, &[&10i64]).await;
    assert!(
        matches!(missing, Err(PayDbError::NotFound { .. })),
        "{missing:?}"
    );
    let row = db
        .query_one("SELECT balance, fence FROM account WHERE id = 'a'", &[])
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (80, w2.token().get())
    );

    // Negative control: with the kill switch the stale writer's debit lands.
    let unfenced = FencedUpdate::new("account").unwrap().fencing(Fencing::Off);
    unfenced
        .execute(&db, &w1, &"a", debit, &[&10i64])
        .await
        .unwrap();
    let row = db
        .query_one("SELECT balance, fence FROM account WHERE id = 'a'", &[])
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i64>(0),
        70,
        "the corruption the switch exists to show"
    );
    assert_eq!(
        row.get::<_, i64>(1),
        w2.token().get(),
        "the fence itself never goes down"
    );
}

/// FR-10's reason for ModRevision: a key taken over *in place* keeps its CreateRevision, so
/// CreateRevision would give two consecutive holders the same token. ModRevision grows.
#[tokio::test]
async fn etcd_takeover_in_place_keeps_create_revision_while_the_token_grows() {
    let w = World::start(Backend::Etcd, &[]).await;
    let etcd = w.etcd();
    // An entry whose lease does not exist: written without one (as a restore or a tool might).
    let path = "/railguard/locks/in-place";
    let written = etcd
        .put_raw(
            path,
            "{\"holder\":\"ghost\",\"ttl_ms\":1000,\"granted_unix_ms\":0}",
        )
        .await;
    let (create_before, mod_before, _, lease_before) = etcd.get(path).await.unwrap();
    assert_eq!(
        (create_before, mod_before, lease_before),
        (written, written, 0)
    );

    let lock = w.client();
    let first = lock.acquire("in-place", "w1", TTL, NOW).await.unwrap();
    let (create, modified, _, lease) = etcd.get(path).await.unwrap();
    assert_eq!(
        create, create_before,
        "taken over in place: CreateRevision unchanged"
    );
    assert_eq!(
        modified,
        first.token().get(),
        "the token is the ModRevision of the winning txn"
    );
    assert!(first.token().get() > mod_before);
    assert_ne!(lease, 0, "the new grant has its own lease");
    let m = w.rg.metrics().await;
    assert_eq!(m.get("lock_takeovers_total{backend=\"etcd\"}"), 1.0);

    // A renewal is the lease's keep-alive: the key, and so the token, do not change.
    for _ in 0..5 {
        lock.renew(&first).await.unwrap();
    }
    assert_eq!(etcd.get(path).await.unwrap().1, first.token().get());
    lock.release(first.clone()).await.unwrap();
    assert!(etcd.get(path).await.is_none(), "release deletes the key");
    let second = lock.acquire("in-place", "w2", TTL, NOW).await.unwrap();
    assert!(second.token() > first.token());
}

/// Three members; the leader is killed while several clients acquire and release. Grants
/// never overlap, every token is larger than the last, and grants resume under the new leader.
#[tokio::test]
async fn etcd_leader_loss_during_a_stream_of_acquires() {
    let cluster = EtcdCluster::three().await;
    let mut w = World::start_with(Backend::Etcd, Some(cluster), &[]).await;
    let url = w.rg.lock_url();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for worker in 0..4 {
        let (http, url, stop) = (Http::new(), url.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            // (when the grant's answer arrived, token, revision of its release if known)
            let mut history: Vec<(Instant, i64, Option<i64>)> = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let body = format!("{{\"holder\":\"w{worker}\",\"ttl_ms\":1000,\"wait_ms\":3000}}");
                let reply = post(&http, &format!("{url}/v1/locks/leader/acquire"), &body).await;
                match reply.status {
                    StatusCode::OK => {}
                    // No leader yet (503), or the key stayed held for the whole wait (409).
                    StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    other => panic!("unexpected {other}: {}", reply.body),
                }
                let at = Instant::now();
                let token = reply.json()["token"].as_i64().unwrap();
                let secret = reply.json()["lease_secret"].as_str().unwrap().to_string();
                let reply = post(
                    &http,
                    &format!("{url}/v1/locks/leader/release"),
                    &format!("{{\"token\":{token},\"lease_secret\":\"{secret}\"}}"),
                )
                .await;
                // A release whose answer was lost in the election ends the grant at some
                // unknown revision (or at its lease's expiry).
                let revision = (reply.status == StatusCode::OK)
                    .then(|| reply.json()["released_revision"].as_i64().unwrap());
                history.push((at, token, revision));
            }
            history
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leader = w.etcd().leader().await;
    let killed_at = Instant::now();
    w.etcd.as_mut().unwrap().kill(leader).await;
    // A grant whose release was lost with the leader holds the key until its lease runs out
    // (1 s, which etcd refreshes once on the leader change): give it a few seconds.
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut history = Vec::new();
    for worker in workers {
        history.extend(worker.await.unwrap());
    }
    assert!(
        history.iter().any(|(at, _, _)| *at < killed_at),
        "grants before the leader died"
    );
    assert!(
        history
            .iter()
            .any(|(at, _, _)| *at > killed_at + Duration::from_secs(1)),
        "and after a new leader"
    );
    // Grants are sequential, so the order in which their answers arrived is the grant order:
    // tokens must increase along it, and each grant must begin after the previous release.
    history.sort_by_key(|(at, _, _)| *at);
    for pair in history.windows(2) {
        let ((_, a, released), (_, b, _)) = (pair[0], pair[1]);
        assert!(b > a, "token {b} granted after token {a}");
        if let Some(r) = released {
            assert!(
                b > r,
                "token {b} granted before the release (revision {r}) of {a}"
            );
        }
    }
}

/// Wall-clock microseconds since the Unix epoch: the clock the etcd backend's `expires_at_us`
/// is reported in (etcd exposes none).
fn wall_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// Starts a waiting acquire over the HTTP API, for the whole grant response (its ttl and
/// `expires_at_us` included).
fn spawn_waiter(
    w: &World,
    key: &str,
    ttl: Duration,
    wait: Duration,
) -> tokio::task::JoinHandle<support::Reply> {
    let (http, url) = (
        Http::new(),
        format!("{}/v1/locks/{key}/acquire", w.rg.lock_url()),
    );
    let body = format!(
        "{{\"holder\":\"waiter\",\"ttl_ms\":{},\"wait_ms\":{}}}",
        ttl.as_millis(),
        wait.as_millis()
    );
    tokio::spawn(async move { post(&http, &url, &body).await })
}

/// Every lease etcd has, sampled every 50 ms for `period`.
async fn leases_seen(etcd: &EtcdCluster, period: Duration) -> BTreeSet<i64> {
    let mut seen = BTreeSet::new();
    let until = Instant::now() + period;
    while Instant::now() < until {
        seen.extend(etcd.leases().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen
}

/// A waiting acquire uses one lease, like etcd's `concurrency.Session`: its
/// first attempt grants it, the many retries while the key is held reuse it, and the grant
/// gets it — with its whole ttl from the winning attempt on, not from the first attempt.
#[tokio::test]
async fn etcd_a_waiting_acquire_uses_one_lease_and_its_grant_has_the_full_ttl() {
    // A retry at least every 100 ms while the key is held.
    let w = World::start(Backend::Etcd, FAST_POLL).await;
    let etcd = w.etcd();
    let lock = w.client();
    let path = "/railguard/locks/session";
    let (holder, holder_lease) = held(&w, "session").await;
    assert_eq!(etcd.leases().await, [holder_lease]);
    let before = etcd.lease_counts(0).await;

    // Waits 4.6 s — about 45 attempts, and longer than its own 3 s ttl.
    let ttl = Duration::from_secs(3);
    let waiter = spawn_waiter(&w, "session", ttl, Duration::from_secs(20));
    let spawned = Instant::now();
    // One lease for the whole wait, not one per retry.
    let session_lease = waiters_lease(etcd, holder_lease, Duration::from_secs(4)).await;
    assert!(!waiter.is_finished(), "the key is still held");
    let during = etcd.lease_counts(0).await;
    assert_eq!(
        during.granted - before.granted,
        1,
        "granted once: {during:?}"
    );
    assert_eq!(
        during.revoked, before.revoked,
        "nothing given back while waiting"
    );
    assert!(
        during.renewed - before.renewed >= 20,
        "the retries kept the one lease alive instead of granting others: {during:?}"
    );

    // Released between two of the session keeper's keep-alives (one a second for a 3 s
    // lease, from the first attempt on): a grant whose lease the winning attempt did not
    // keep alive itself would end about 0.6 s before its ttl says.
    tokio::time::sleep_until(spawned + Duration::from_millis(4600)).await;
    // The winning attempt starts after this instant, so its lease must last until at least
    // `released_us` + ttl, and the reported expiry must not be earlier than that either.
    let released_us = wall_us();
    let reply = released_to_the_waiter(&lock, holder, waiter).await;
    let grant = reply.json();
    assert_eq!(grant["ttl_ms"], 3000);
    let token = grant["token"].as_i64().unwrap();
    let expires_us = grant["expires_at_us"].as_i64().unwrap();
    assert!(
        expires_us >= released_us + ttl.as_micros() as i64,
        "expires_at is counted from the winning attempt ({expires_us} < {released_us} + ttl)"
    );
    let (_, mod_revision, _, lease) = etcd.get(path).await.expect("the waiter holds the key");
    assert_eq!(mod_revision, token);
    assert_eq!(
        lease, session_lease,
        "the grant carries the session's lease"
    );
    let (remaining, granted) = etcd.lease_ttl(lease).await.expect("the lease is alive");
    assert_eq!(granted, 3);
    assert!(
        remaining >= 2,
        "{remaining} s left of 3 right after the grant"
    );
    let after = etcd.lease_counts(0).await;
    assert_eq!(
        after.granted - before.granted,
        1,
        "one lease for the acquire: {after:?}"
    );
    assert_eq!(
        after.revoked - before.revoked,
        1,
        "only the holder's lease, by its release: {after:?}"
    );

    // Nobody renews the grant. Its key must outlive the expiry the grant reported (and the
    // release instant + ttl); once handed over, nothing keeps the lease alive any more, so it
    // does end, a little after.
    let gone_us = loop {
        let present = etcd.get(path).await.is_some();
        let now = wall_us();
        if !present {
            break now;
        }
        assert!(
            now < expires_us + 5_000_000,
            "the handed-over lease is still being kept alive"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        gone_us >= expires_us && gone_us >= released_us + ttl.as_micros() as i64,
        "the grant's lease ended {} ms before its reported expiry",
        (expires_us - gone_us) / 1000
    );
    assert!(etcd.leases().await.is_empty(), "no lease left behind");
}

/// A waiter whose wait runs out, and one whose caller goes away, each give their one lease
/// back at once — long before it would have expired.
#[tokio::test]
async fn etcd_a_waiter_that_gives_up_leaves_no_lease_behind() {
    let w = World::start(Backend::Etcd, FAST_POLL).await;
    let etcd = w.etcd();
    let (_holder, holder_lease) = held(&w, "giveup").await;
    let before = etcd.lease_counts(0).await;

    // A 30 s lease: gone within a few seconds means revoked, not expired.
    let ttl = Duration::from_secs(30);
    let reply = spawn_waiter(&w, "giveup", ttl, Duration::from_millis(1500))
        .await
        .unwrap();
    reply.assert_status(StatusCode::CONFLICT);
    let left = wait_for_leases(etcd, &[holder_lease]).await;
    assert_eq!(left, [holder_lease], "the waiter's lease was given back");
    let after = etcd.lease_counts(0).await;
    assert_eq!(
        (
            after.granted - before.granted,
            after.revoked - before.revoked
        ),
        (1, 1),
        "one lease for the whole wait, revoked once: {after:?}"
    );

    // The caller goes away mid-wait: the request is dropped, and with it the acquire.
    let waiter = spawn_waiter(&w, "giveup", ttl, Duration::from_secs(20));
    let seen = leases_seen(etcd, Duration::from_secs(1)).await;
    assert_eq!(
        seen.len(),
        2,
        "the holder's and the waiter's session lease: {seen:?}"
    );
    waiter.abort();
    let left = wait_for_leases(etcd, &[holder_lease]).await;
    assert_eq!(
        left,
        [holder_lease],
        "a dropped acquire gives its lease back"
    );
    let after = etcd.lease_counts(0).await;
    assert_eq!(
        (
            after.granted - before.granted,
            after.revoked - before.revoked
        ),
        (2, 2),
        "{after:?}"
    );
}

/// `key` held (60 s) by "holder" on etcd: its grant and its lease.
async fn held(w: &World, key: &str) -> (railguard::sdk::LockHandle, i64) {
    let holder = w
        .client()
        .acquire(key, "holder", Duration::from_secs(60), NOW)
        .await;
    let holder = holder.unwrap();
    let path = format!("/railguard/locks/{key}");
    (holder, w.etcd().get(&path).await.unwrap().3)
}

/// The one lease other than the holder's seen in etcd within `period`: the waiter's session.
async fn waiters_lease(etcd: &EtcdCluster, holder_lease: i64, period: Duration) -> i64 {
    let mut seen = leases_seen(etcd, period).await;
    seen.remove(&holder_lease);
    assert_eq!(seen.len(), 1, "one lease besides the holder's: {seen:?}");
    *seen.first().unwrap()
}

/// Releases `holder`; the waiter's answer (200), once the release has woken it.
async fn released_to_the_waiter(
    lock: &LockClient,
    holder: railguard::sdk::LockHandle,
    waiter: tokio::task::JoinHandle<support::Reply>,
) -> support::Reply {
    lock.release(holder).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the release wakes the waiter")
        .unwrap();
    reply.assert_status(StatusCode::OK);
    reply
}

/// Polls etcd's leases for up to 3 s until they are exactly `expected`; returns the last seen.
async fn wait_for_leases(etcd: &EtcdCluster, expected: &[i64]) -> Vec<i64> {
    let _ = support::within(Duration::from_secs(3), || async {
        (etcd.leases().await == expected).then_some(())
    })
    .await;
    etcd.leases().await
}

/// No attempt is made while waiting (the fallback poll is 30 s, the holder's lease 60 s), for
/// four times the waiter's 1 s ttl: the session's keeper alone keeps its lease alive, and the
/// grant that follows the release carries that same, live lease.
#[tokio::test]
async fn etcd_a_waiter_waiting_longer_than_its_ttl_gets_a_live_lease() {
    let w = World::start(Backend::Etcd, SLOW_POLL).await;
    let etcd = w.etcd();
    let lock = w.client();
    let path = "/railguard/locks/long-wait";
    let (holder, holder_lease) = held(&w, "long-wait").await;
    let before = etcd.lease_counts(0).await;

    let waiter = spawn_waiter(
        &w,
        "long-wait",
        Duration::from_secs(1),
        Duration::from_secs(20),
    );
    let session_lease = waiters_lease(etcd, holder_lease, Duration::from_secs(4)).await;
    assert!(
        etcd.lease_ttl(session_lease).await.is_some(),
        "alive after 4 s, four times its ttl"
    );

    let reply = released_to_the_waiter(&lock, holder, waiter).await;
    let (_, mod_revision, _, lease) = etcd.get(path).await.expect("the waiter holds the key");
    assert_eq!(mod_revision, reply.json()["token"].as_i64().unwrap());
    assert_eq!(lease, session_lease, "the lease the keeper kept alive");
    let (_, granted) = etcd
        .lease_ttl(lease)
        .await
        .expect("the grant's lease is alive");
    assert_eq!(granted, 1);
    let after = etcd.lease_counts(0).await;
    assert_eq!(after.granted - before.granted, 1, "{after:?}");
}

/// A session's lease that is gone by the next attempt (here revoked behind railguard's back,
/// as an expiry during a long stall would end it) is replaced, never put with.
#[tokio::test]
async fn etcd_a_waiter_whose_lease_is_gone_takes_a_new_one() {
    let w = World::start(Backend::Etcd, FAST_POLL).await;
    let etcd = w.etcd();
    let lock = w.client();
    let path = "/railguard/locks/gone";
    let (holder, holder_lease) = held(&w, "gone").await;
    let before = etcd.lease_counts(0).await;

    let waiter = spawn_waiter(&w, "gone", Duration::from_secs(10), Duration::from_secs(20));
    let lost = waiters_lease(etcd, holder_lease, Duration::from_millis(500)).await;
    assert!(etcd.revoke_lease(lost).await);

    // A new lease replaces the lost one.
    let replacement = waiters_lease(etcd, holder_lease, Duration::from_secs(1)).await;
    assert_ne!(replacement, lost);

    let _reply = released_to_the_waiter(&lock, holder, waiter).await;
    let (_, _, _, lease) = etcd.get(path).await.expect("the waiter holds the key");
    assert_eq!(
        lease, replacement,
        "put with the live lease, not the lost one"
    );
    assert!(etcd.lease_ttl(lease).await.is_some());
    let after = etcd.lease_counts(0).await;
    assert_eq!(after.granted - before.granted, 2, "{after:?}");
}

/// The state an attempt leaves when etcd applied its put but the answer was lost (a timeout,
/// a dropped connection): the key carries the waiting acquire's own session lease, a grant
/// nobody received. Made here by writing the key with that lease behind railguard's back. The
/// next attempt must not wait on itself: it revokes that lease (deleting the key) and wins
/// with a new one.
#[tokio::test]
async fn etcd_a_waiter_finding_its_own_lost_put_revokes_it_and_starts_over() {
    let w = World::start(Backend::Etcd, FAST_POLL).await;
    let etcd = w.etcd();
    let path = "/railguard/locks/lost-put";
    let (_holder, holder_lease) = held(&w, "lost-put").await;
    let waiter = spawn_waiter(&w, "lost-put", TTL, Duration::from_secs(20));
    let session_lease = waiters_lease(etcd, holder_lease, Duration::from_millis(500)).await;

    // An overwrite, not a delete: no release notification, only the next poll finds it.
    let lost = etcd
        .put_with_lease(
            path,
            "{\"holder\":\"waiter\",\"ttl_ms\":10000,\"granted_unix_ms\":0}",
            session_lease,
        )
        .await;
    let reply = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter does not wait on its own grant")
        .unwrap();
    reply.assert_status(StatusCode::OK);
    let token = reply.json()["token"].as_i64().unwrap();
    assert!(token > lost, "a new grant, not the lost one");
    let (_, mod_revision, _, lease) = etcd.get(path).await.expect("the waiter holds the key");
    assert_eq!(mod_revision, token);
    assert_ne!(
        lease, session_lease,
        "the lost grant's lease was given back"
    );
    assert_eq!(etcd.lease_ttl(session_lease).await, None);
    let mut left = etcd.leases().await;
    left.retain(|l| *l != holder_lease);
    assert_eq!(left, [lease], "only the new grant's lease");
}
