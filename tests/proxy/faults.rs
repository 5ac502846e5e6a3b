//! Safety under faults: each test is a scenario in which a fault (a slow network, a database
//! outage or crash, clients that hang up, mixed timeouts, a restart) could let a stale grant
//! through or pay twice, and checks that it does not. Real PostgreSQL, real railguard
//! processes, the rail simulator, and a delaying TCP relay where the network has to be slow.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::relay::Relay;
use support::{Http, Pg, Rail, Railguard, World, eventually, init_tracing, until};

/// A grant from the lock API, as a worker in another language would read it.
struct WireGrant {
    token: i64,
    proof: Option<String>,
    secret: Option<String>,
}

async fn acquire(http: &Http, rg: &Railguard, key: &str) -> WireGrant {
    let reply = http
        .send(
            http::Request::post(format!("{}/v1/locks/{key}/acquire", rg.lock_url()))
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    "{\"holder\":\"w\",\"ttl_ms\":30000}",
                )))
                .unwrap(),
        )
        .await
        .unwrap();
    reply.assert_status(StatusCode::OK);
    let grant = reply.json();
    WireGrant {
        token: grant["token"].as_i64().unwrap(),
        proof: grant["fencing_proof"].as_str().map(str::to_string),
        secret: grant["lease_secret"].as_str().map(str::to_string),
    }
}

/// A token is only good for the account whose lock key it was granted on, and a
/// token nobody was granted is good for nothing.
#[tokio::test]
async fn a_grant_of_one_key_does_not_pass_for_another_account_nor_an_invented_token() {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    let http = Http::new();
    let b = acquire(&http, &rg, "acct-B").await;
    let paid = rg
        .payment("acct-B", b.token)
        .with_proof(b.proof.as_deref())
        .send()
        .await;
    paid.assert_status(StatusCode::CREATED);
    // A later grant on another key has a larger token: it must not pass for acct-B.
    let a = acquire(&http, &rg, "acct-A").await;
    assert!(a.token > b.token);
    let wrong = rg
        .payment("acct-B", a.token)
        .with_proof(a.proof.as_deref())
        .send()
        .await;
    wrong.assert_status(StatusCode::BAD_REQUEST);
    assert_eq!(pg.mark("acct-B").await, Some(b.token), "mark unchanged");
    // Never issued: the largest token there is, with no proof and with a made-up one.
    for proof in [None, Some("v1.".to_string() + &"0".repeat(64))] {
        let invented = rg
            .payment("acct-B", i64::MAX)
            .with_proof(proof.as_deref())
            .send()
            .await;
        invented.assert_status(StatusCode::BAD_REQUEST);
    }
    assert_eq!(pg.mark("acct-B").await, Some(b.token), "mark unchanged");
    assert_eq!(pg.mark("acct-A").await, None, "no mark made");
    // The right grant still passes.
    let again = rg
        .payment("acct-B", b.token)
        .with_proof(b.proof.as_deref())
        .send()
        .await;
    again.assert_status(StatusCode::CREATED);
    rail.assert_paid(2, "only the two good payments reached the rail");
}

/// Two railguards on one database with different request timeouts (a rolling
/// config change). The owner's forward is slow on the network; the other process must not
/// declare its record in doubt on the strength of its own, shorter, timeout.
#[tokio::test]
async fn mixed_request_timeouts_across_two_processes_never_pay_twice() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = Relay::start(rail.addr).await;
    let owner = Railguard::start(
        &pg.url(),
        &slow_path.url(),
        &[("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000")],
    )
    .await;
    let other = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "1000")],
    )
    .await;
    let http = Http::new();
    let grant = acquire(&http, &owner, "acct-mixed").await;
    slow_path.set_delay(Duration::from_millis(5000));
    let original = owner
        .payment("acct-mixed", grant.token)
        .with_proof(grant.proof.as_deref())
        .key("pay-1")
        .spawn();
    // The request is on the slow path; the answer will come back at once.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    slow_path.set_delay(Duration::ZERO);
    // Past the other process's in-doubt threshold (its 1 s deadline + 1 s + 1 s).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(rail.ledger().is_empty(), "the original is still on its way");
    // The operator follows the procedure through the other process: the rail shows nothing.
    let forgot = other.forget("acct-mixed", "pay-1").await;
    if forgot.status.success() {
        let retry = other
            .payment("acct-mixed", grant.token)
            .with_proof(grant.proof.as_deref())
            .key("pay-1")
            .send()
            .await;
        assert!(retry.status.is_success(), "{}", retry.body);
    }
    let first = original.await.unwrap();
    first.assert_status(StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let paid: Vec<_> = rail
        .ledger()
        .into_iter()
        .filter(|e| e.idempotency_key.as_deref() == Some("pay-1"))
        .collect();
    assert_eq!(paid.len(), 1, "one payment at the rail: {paid:?}");
}

/// A forward whose bytes are still in the network after its request timed out —
/// held longer than `proxy.rail_transit_ms` says any path can hold one (the operator's
/// statement about the network is wrong). A middlebox resets the owner's connection and keeps
/// the request; the owner stops cleanly; the operator follows the in-doubt procedure — waits
/// for the time forget names, finds nothing at the rail, forgets, retries — and then the
/// original arrives. Nothing railguard can check sees bytes held past the stated transit time;
/// what absorbs them is the rail's own deduplication by the `Idempotency-Key` that railguard
/// forwards. (With a rail that does not deduplicate this pays twice: the residual risk the
/// procedure spells out.)
#[tokio::test]
async fn a_forward_delayed_in_the_network_is_absorbed_by_a_rail_that_deduplicates() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::deduplicating().await;
    let slow_path = Relay::start(rail.addr).await;
    slow_path.stall_first(|chunk| chunk.windows(5).any(|w| w == b"pay-n"));
    // 3 s request timeout; a transit time of 1 s, shorter than the relay will hold the request.
    let mut rg = Railguard::start_process(&pg.url(), &slow_path.url(), &[]).await;
    let http = Http::new();
    let grant = acquire(&http, &rg, "acct-net").await;
    let grant = (grant.token, grant.proof);
    let first = rg
        .payment("acct-net", grant.0)
        .with_proof(grant.1.as_deref())
        .key("pay-n")
        .send()
        .await;
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    assert!(slow_path.has_stalled(), "the request is held on its way");
    // Its owner said at once that the forward ended without an answer: repeats are in doubt.
    eventually(
        Duration::from_secs(2),
        "repeats of pay-n answered in doubt",
        || async {
            let reply = rg
                .payment("acct-net", grant.0)
                .with_proof(grant.1.as_deref())
                .key("pay-n")
                .send()
                .await;
            (reply.status == StatusCode::CONFLICT && reply.json()["error"] == "in_doubt")
                .then_some(())
        },
    )
    .await;
    // While the owning process runs it may still be writing the request out: refused.
    let early = rg.forget("acct-net", "pay-n").await;
    assert!(!early.status.success(), "refused while the owner runs");
    let why = String::from_utf8_lossy(&early.stderr);
    assert!(why.contains("owner_running: "), "{why}");
    // The middlebox resets the owner's connection, keeping the request; the owner then stops
    // cleanly, with nothing outstanding.
    slow_path.reset_sources();
    rg.restart().await;
    // The procedure: wait for the time forget names, ask the rail (nothing there), forget.
    eventually(
        Duration::from_secs(15),
        "idempotency-forget --dry-run of pay-n allowed",
        || async {
            rg.forget_with("acct-net", "pay-n", &["--dry-run"])
                .await
                .status
                .success()
                .then_some(())
        },
    )
    .await;
    assert!(
        rail.ledger().is_empty(),
        "the operator finds nothing at the rail"
    );
    let forgot = rg.forget("acct-net", "pay-n").await;
    assert!(
        forgot.status.success(),
        "{}",
        String::from_utf8_lossy(&forgot.stderr)
    );
    let retry = rg
        .payment("acct-net", grant.0)
        .with_proof(grant.1.as_deref())
        .key("pay-n")
        .send()
        .await;
    retry.assert_status(StatusCode::CREATED);
    // The original arrives after all, and the rail recognises its key.
    slow_path.release_stalled();
    eventually(
        Duration::from_secs(6),
        "the delayed original absorbed by the rail",
        || async { (rail.absorbed() > 0).then_some(()) },
    )
    .await;
    assert_eq!(rail.absorbed(), 1, "the delayed original reached the rail");
    let ledger = rail.ledger();
    assert_eq!(ledger.len(), 1, "one payment at the rail: {ledger:?}");
    assert_eq!(
        ledger[0].idempotency_key.as_deref(),
        Some("pay-n"),
        "the key reached the rail"
    );
}

/// A database outage is not railguard's error. 503s are logged once each at info by
/// the proxy's own layer, never at ERROR by the trace layer.
#[tokio::test]
async fn a_database_outage_logs_no_error_lines() {
    let (mut pg, _rail, rg) = World::postgres_process(Rail::start().await, &[])
        .await
        .parts();
    let http = rg.http();
    assert_eq!(
        http.pay_with(&rg, 3, "acct-o").await.status,
        StatusCode::CREATED
    );
    pg.kill().await;
    for _ in 0..20 {
        let reply = http.pay_with(&rg, 3, "acct-o").await;
        reply.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    }
    pg.server.start().await.expect("postgres restarts");
    let errors: Vec<String> = rg
        .log()
        .lines()
        .filter(|l| l.contains("\"level\":\"ERROR\""))
        .map(str::to_string)
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
}

/// An acquire answered 503 because PostgreSQL was slower than `database.timeout_ms`
/// must not leave behind a grant nobody received, holding the key for its whole ttl.
#[tokio::test]
async fn an_acquire_slower_than_the_database_timeout_leaves_no_grant_behind() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_db = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    let rg = Railguard::start(&slow_db.postgres_url(&pg.url()), &rail.url(), &[]).await;
    let http = Http::new();
    let body = "{\"holder\":\"w1\",\"ttl_ms\":60000}";
    let url = format!("{}/v1/locks/slow/acquire", rg.lock_url());
    // Every pooled connection has the acquire prepared: the slow statement is the acquire.
    for i in 0..16 {
        acquire(&http, &rg, &format!("warm-{i}")).await;
    }
    slow_db.set_delay(Duration::from_millis(1500)); // the harness's database.timeout_ms is 1 s
    let reply = http
        .send(
            http::Request::post(&url)
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap(),
        )
        .await
        .unwrap();
    reply.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    assert!(reply.json().get("token").is_none());
    slow_db.set_delay(Duration::ZERO);
    // The slow statement reaches PostgreSQL 1.5 s after it was sent, and commits.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Whatever the slow statement committed is undone: the key is free again within a few
    // seconds, not after the 60 s lease.
    until(
        Duration::from_secs(10),
        "the key freed of a grant nobody received",
        || async {
            let held: bool = pg
                .client()
                .await
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM lock_entry WHERE key = 'slow'
                     AND ended_at IS NULL AND expires_at > clock_timestamp())",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            !held
        },
    )
    .await;
    let second = http
        .send(
            http::Request::post(&url)
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    "{\"holder\":\"w2\",\"ttl_ms\":5000}",
                )))
                .unwrap(),
        )
        .await
        .unwrap();
    second.assert_status(StatusCode::OK);
}

/// PostgreSQL dies after the rail answered and before the response was stored. The
/// client got its 201; once the database is back the record must be complete and replayable,
/// not in flight (and later in doubt) for a payment that succeeded.
#[tokio::test]
async fn a_completion_lost_to_a_database_crash_is_stored_when_it_returns() {
    let (mut pg, rail, rg) =
        World::postgres_on(Rail::with_latency(Duration::from_millis(1500)).await, &[])
            .await
            .parts();
    let http = Http::new();
    let grant = acquire(&http, &rg, "acct-c").await;
    let original = rg
        .payment("acct-c", grant.token)
        .with_proof(grant.proof.as_deref())
        .key("pay-c")
        .spawn();
    rail.until_paid(1).await;
    rail.assert_paid(1, "the payment reached the rail");
    tokio::time::sleep(Duration::from_millis(300)).await; // let the record's commit reach disk
    pg.kill().await;
    let first = original.await.unwrap();
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the client hears the rail's answer"
    );
    pg.server.start().await.expect("postgres restarts");
    let replayed = eventually(
        Duration::from_secs(10),
        "the completion stored once the database was back",
        || async {
            let again = rg
                .payment("acct-c", grant.token)
                .with_proof(grant.proof.as_deref())
                .key("pay-c")
                .send()
                .await;
            (again.status == StatusCode::CREATED).then_some(again)
        },
    )
    .await;
    assert_eq!(
        replayed.headers.get("idempotency-replayed").unwrap(),
        "true"
    );
    assert_eq!(replayed.body, first.body);
    rail.assert_paid(1, "payments at the rail");
}

/// Across two railguard processes, a token superseded in the database before its
/// forward starts must be refused (or counted), not delivered after the newer one.
#[tokio::test]
async fn a_token_superseded_in_another_process_before_its_forward_starts_is_refused() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::with_latency(Duration::from_millis(1500)).await;
    let a = Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let b = Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let http = Http::new();
    let t0 = acquire(&http, &a, "acct-x").await;
    release(&http, &a, "acct-x", &t0).await;
    let t1 = acquire(&http, &a, "acct-x").await;
    release(&http, &a, "acct-x", &t1).await;
    let t2 = acquire(&http, &a, "acct-x").await;
    // t0's forward is at the (slow) rail; t1 passes its compare-and-set in A and waits there
    // for t0's forward to end.
    let first = a
        .payment("acct-x", t0.token)
        .with_proof(t0.proof.as_deref())
        .key("p0")
        .spawn();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = a
        .payment("acct-x", t1.token)
        .with_proof(t1.proof.as_deref())
        .key("p1")
        .spawn();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile t2 is accepted by B and sent at once.
    let third = b
        .payment("acct-x", t2.token)
        .with_proof(t2.proof.as_deref())
        .key("p2")
        .spawn();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    let second = second.await.unwrap();
    assert_eq!(third.await.unwrap().status, StatusCode::CREATED);
    let order: Vec<String> = rail
        .ledger()
        .iter()
        .filter_map(|e| e.token.clone())
        .collect();
    let t1_text = t1.token.to_string();
    assert!(
        !order.contains(&t1_text),
        "t1 reached the rail after t2 ({order:?}); its sender got {} {}",
        second.status,
        second.body
    );
    second.assert_status(StatusCode::CONFLICT);
    assert_eq!(second.json()["error"], "fenced_out");
    let fenced = a.metrics().await.get("lock_fenced_out_total");
    assert_eq!(fenced, 1.0, "the page fires");
}

/// Ends `grant` through the lock API, with its lease secret when the service issued one.
async fn release(http: &Http, rg: &Railguard, key: &str, grant: &WireGrant) {
    let mut body = serde_json::json!({ "token": grant.token });
    if let Some(secret) = &grant.secret {
        body["lease_secret"] = secret.clone().into();
    }
    let reply = http
        .send(
            http::Request::post(format!("{}/v1/locks/{key}/release", rg.lock_url()))
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    body.to_string(),
                )))
                .unwrap(),
        )
        .await
        .unwrap();
    reply.assert_status(StatusCode::OK);
}

/// A keyed forward whose client hangs up while the request is still in the network keeps the
/// account's turn, so a newer grant's request (same process, same account) reaches the rail
/// only after the older one.
#[tokio::test]
async fn a_keyed_client_that_hangs_up_does_not_let_a_newer_grant_overtake_its_forward() {
    let (
        World {
            pg: _pg, rail, rg, ..
        },
        slow_path,
    ) = World::postgres_via_relay(&[]).await; // 3 s request timeout
    let http = Http::new();
    let old = acquire(&http, &rg, "acct-hang").await;
    slow_path.set_delay(Duration::from_millis(2000));
    // The old holder's client gives up after 300 ms (its own timeout, a crash, a cut path).
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        rg.payment("acct-hang", old.token)
            .with_proof(old.proof.as_deref())
            .key("pay-old")
            .send(),
    )
    .await;
    assert!(gave_up.is_err(), "the client hung up before any answer");
    slow_path.set_delay(Duration::ZERO);
    release(&http, &rg, "acct-hang", &old).await;
    let new = acquire(&http, &rg, "acct-hang").await;
    assert!(new.token > old.token);
    let reply = rg
        .payment("acct-hang", new.token)
        .with_proof(new.proof.as_deref())
        .key("pay-new")
        .send()
        .await;
    // Whatever the proxy answers the new holder, wait for the old request to land.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let tokens: Vec<i64> = rail
        .ledger()
        .iter()
        .filter_map(|e| e.token.as_deref().and_then(|t| t.parse().ok()))
        .collect();
    eprintln!(
        "ledger tokens {tokens:?}, new holder got {} {}",
        reply.status, reply.body
    );
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "the rail received tokens out of order {tokens:?} (new holder got {})",
        reply.status
    );
}

/// A *graceful* stop (SIGTERM, as a rolling config change or deploy does)
/// must wait — within its grace — for forwards past their deadline that still wait for the
/// rail's late answer; otherwise the restarted process knows nothing of them and a newer
/// grant's request overtakes one at the rail.
#[tokio::test]
async fn a_graceful_restart_waits_for_a_late_forward_before_a_newer_grant_is_sent() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = Relay::start(rail.addr).await;
    // The forward is late past its 1 s deadline but arrives within the 3 s grace.
    let mut rg = Railguard::start_process(
        &pg.url(),
        &slow_path.url(),
        &[("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "1000")],
    )
    .await;
    let http = Http::new();
    let old = acquire(&http, &rg, "acct-roll").await;
    slow_path.set_delay(Duration::from_millis(2500));
    let first = rg
        .payment("acct-roll", old.token)
        .with_proof(old.proof.as_deref())
        .key("pay-old")
        .send()
        .await;
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    slow_path.set_delay(Duration::ZERO);
    let stopping = std::time::Instant::now();
    rg.restart().await;
    let restart_took = stopping.elapsed();
    release(&http, &rg, "acct-roll", &old).await;
    let new = acquire(&http, &rg, "acct-roll").await;
    let reply = rg
        .payment("acct-roll", new.token)
        .with_proof(new.proof.as_deref())
        .key("pay-new")
        .send()
        .await;
    tokio::time::sleep(Duration::from_millis(4000)).await;
    let tokens: Vec<i64> = rail
        .ledger()
        .iter()
        .filter_map(|e| e.token.as_deref().and_then(|t| t.parse().ok()))
        .collect();
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "after a graceful restart ({restart_took:?}) the rail received grant {} after grant {}: \
         {tokens:?} (new holder got {} {})",
        old.token,
        new.token,
        reply.status,
        reply.body
    );
}
