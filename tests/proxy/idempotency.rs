//! Idempotency keys at the proxy (C3 §3.1), and group commit, end to end.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, World, eventually, init_tracing, signal, until};

/// Waits (up to 5 s) until the owner has stored its declaration that `key`'s record is in
/// doubt (it does so after answering the client).
async fn wait_until_in_doubt(pg: &Pg, key: &str) {
    let client = pg.client().await;
    until(
        Duration::from_secs(5),
        format!("{key}'s record declared in doubt"),
        || async {
            let state = support::records::state_of(&client, key).await;
            state.as_deref() == Some("in_doubt")
        },
    )
    .await
}

/// The clean stops the railguard of `instance` recorded (`railguard_audit`).
async fn clean_stops(pg: &Pg, instance: i64) -> i64 {
    pg.client()
        .await
        .query_one(
            "SELECT count(*) FROM railguard_audit WHERE action = 'instance_stopped'
               AND (outcome->>'instance')::bigint = $1",
            &[&instance],
        )
        .await
        .unwrap()
        .get(0)
}

/// `railguard idempotency-forget` through `rg` with `more`, once it is due: the in-doubt
/// procedure's step 2 (`--dry-run` until the time it names, by which nothing the owner sent can
/// still reach the rail, has passed), then the forget itself.
async fn forget_when_due(
    rg: &Railguard,
    account: &str,
    key: &str,
    more: &[&str],
) -> std::process::Output {
    let dry: Vec<&str> = more.iter().copied().chain(["--dry-run"]).collect();
    eventually(
        Duration::from_secs(15),
        format!("idempotency-forget --dry-run of {key} on {account} allowed"),
        || async {
            let asked = rg.forget_with(account, key, &dry).await;
            if asked.status.success() {
                return Some(());
            }
            let why = String::from_utf8_lossy(&asked.stderr);
            assert!(
                why.contains("may still be on its way to the rail until"),
                "refused for another reason: {why}"
            );
            None
        },
    )
    .await;
    rg.forget_with(account, key, more).await
}

async fn records(pg: &Pg) -> i64 {
    pg.one("SELECT count(*) FROM idempotency_record", &[]).await
}

#[tokio::test]
async fn a_completed_request_is_replayed_without_touching_the_rail() {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    let first = rg
        .payment("acct", 7)
        .key("pay-1")
        .body("{\"amount\":5}")
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.headers.contains_key("idempotency-replayed"));
    let again = rg
        .payment("acct", 7)
        .key("pay-1")
        .body("{\"amount\":5}")
        .send()
        .await;
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body, "the stored response, byte for byte");
    assert_eq!(
        again.headers.get("content-type"),
        first.headers.get("content-type")
    );
    assert_eq!(again.headers.get("idempotency-replayed").unwrap(), "true");
    // A newer grant retrying the same payment gets the same answer too.
    let newer = rg
        .payment("acct", 8)
        .key("pay-1")
        .body("{\"amount\":5}")
        .send()
        .await;
    assert_eq!(newer.body, first.body);
    rail.assert_paid(1, "the rail saw the payment once");
    // Keys are scoped per account: the same key on another account is another payment.
    assert_eq!(
        rg.payment("other", 8)
            .key("pay-1")
            .body("{\"amount\":5}")
            .send()
            .await
            .status,
        StatusCode::CREATED
    );
    rail.assert_paid(2, "payments at the rail");
    let m = rg.metrics().await;
    assert_eq!(m.get("railguard_requests_total{outcome=\"replayed\"}"), 2.0);
    // A stale token is fenced before its key is looked at, and leaves no record.
    let stale = rg.payment("acct", 1).key("pay-2").body("{}").send().await;
    assert_eq!(stale.status, StatusCode::CONFLICT);
    assert_eq!(stale.json()["error"], "fenced_out");
    assert_eq!(records(&pg).await, 2);
}

#[tokio::test]
async fn concurrent_duplicates_are_forwarded_once() {
    let (_pg, rail, rg) =
        World::postgres_on(Rail::with_latency(Duration::from_millis(500)).await, &[])
            .await
            .parts();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        tasks.push(rg.payment("a", 3).key("dup").body("{}").spawn());
    }
    let (mut created, mut in_flight) = (0, 0);
    for task in tasks {
        let reply = task.await.unwrap();
        assert!(
            !reply.headers.contains_key("idempotency-replayed"),
            "all overlap the first"
        );
        match reply.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {
                assert_eq!(reply.json()["error"], "in_flight", "{}", reply.body);
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {}", reply.body),
        }
    }
    assert_eq!((created, in_flight), (1, 19));
    rail.assert_paid(1, "payments at the rail");
}

#[tokio::test]
async fn the_same_key_with_another_request_is_422() {
    let (_pg, rail, rg) = World::postgres(&[("RAILGUARD__IDEMPOTENCY__REQUIRED", "true")])
        .await
        .parts();
    let http = rg.http();
    assert_eq!(
        rg.payment("a", 1)
            .key("k")
            .body("{\"amount\":5}")
            .send()
            .await
            .status,
        StatusCode::CREATED
    );
    let other = rg
        .payment("a", 1)
        .key("k")
        .body("{\"amount\":6}")
        .send()
        .await;
    other.assert_status(StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.json()["error"], "idempotency_key_reused");
    let other_path = http
        .pay(
            &rg.proxy_url("/refunds"),
            &[
                ("Fencing-Token", "1"),
                ("Fencing-Account", "a"),
                ("Idempotency-Key", "k"),
            ],
            "{\"amount\":5}",
        )
        .await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    // Required: a request without a key is refused.
    let missing = http.pay_with(&rg, 1, "a").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert!(
        missing.json()["message"]
            .as_str()
            .unwrap()
            .contains("idempotency-key")
    );
    let bad = rg.payment("a", 1).key("has space").body("{}").send().await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    rail.assert_paid(1, "payments at the rail");
}

#[tokio::test]
async fn a_proxy_killed_mid_request_leaves_a_record_in_doubt_that_is_never_forwarded_twice() {
    // The killed process's forward counts as on its way until its row is quiet
    // (`store::handover`): half a second of transit keeps that short.
    let World {
        pg: _pg,
        rail,
        mut rg,
        ..
    } = World::postgres_process(
        Rail::with_latency(Duration::from_secs(2)).await,
        &[("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "500")],
    )
    .await;
    let http = rg.http();
    let in_flight = {
        let http = http.clone();
        let url = rg.proxy_url("/payments");
        let proof = rg.proof("a", 4);
        tokio::spawn(async move {
            http.send(
                http::Request::post(url)
                    .header("Fencing-Token", "4")
                    .header("Fencing-Proof", proof)
                    .header("Fencing-Account", "a")
                    .header("Idempotency-Key", "crash")
                    .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
                    .unwrap(),
            )
            .await
        })
    };
    rail.until_paid(1).await;
    rail.assert_paid(1, "the payment reached the rail");
    let killed_owner = rg
        .instance()
        .expect("railguard logs its instance when it starts");
    rg.kill().await; // before the rail answered
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client lost its connection"
    );
    rg.start_again().await;

    let soon = rg.payment("a", 4).key("crash").body("{}").send().await;
    soon.assert_status(StatusCode::CONFLICT);
    assert_eq!(soon.json()["error"], "in_flight");
    // While its forward may still be running, the operator cannot forget it.
    let early = rg.forget("a", "crash").await;
    assert!(!early.status.success(), "refused while it may be in flight");
    assert!(String::from_utf8_lossy(&early.stderr).contains("not yet in doubt"));
    // Past the longest a forward and its record's completion can take (the harness's 3 s
    // deadline + 1 s database timeout + 1 s), it is in doubt.
    tokio::time::sleep(Duration::from_millis(5200)).await;
    let later = rg.payment("a", 4).key("crash").body("{}").send().await;
    assert_eq!(later.status, StatusCode::CONFLICT);
    assert_eq!(later.json()["error"], "in_doubt", "{}", later.body);
    assert!(
        later.json()["message"]
            .as_str()
            .unwrap()
            .contains("idempotency-forget")
    );
    rail.assert_paid(1, "never forwarded twice");

    // The operator's way out, after checking the rail: asks the running railguard. The owner
    // crashed, so nothing recorded its stop: forget asks for the operator's word, naming it.
    let refused = rg.forget("a", "crash").await;
    assert!(
        !refused.status.success(),
        "a crashed owner is not known stopped"
    );
    let why = String::from_utf8_lossy(&refused.stderr);
    let owner = killed_owner.to_string();
    assert!(
        why.contains("owner_not_seen_stopping: ") && why.contains(&format!("instance {owner}")),
        "{why}"
    );
    assert!(
        why.contains("What to do: docs/operations.md#owner_not_seen_stopping"),
        "{why}"
    );
    let out = forget_when_due(&rg, "a", "crash", &["--owner-stopped", &owner]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let retried = tokio::time::timeout(
        Duration::from_secs(5),
        rg.payment("a", 4).key("crash").body("{}").send(),
    )
    .await
    .unwrap();
    assert_eq!(retried.status, StatusCode::CREATED);
    rail.assert_paid(2, "forwarded again only after the operator said so");
}

/// A request whose record was made but which was superseded before its turn never reached the
/// rail: its record is removed, so a retry of the key goes through.
#[tokio::test]
async fn a_superseded_request_leaves_no_record_behind() {
    let (pg, rail, rg) =
        World::postgres_on(Rail::with_latency(Duration::from_millis(600)).await, &[])
            .await
            .parts();
    let first = rg.payment("a", 42).body("{}").spawn(); // in flight at the rail
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Accepted, recorded, waits for its turn.
    let waiting = rg.payment("a", 43).key("k").body("{}").spawn();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let newer = rg.payment("a", 44).body("{}").spawn(); // accepted: 43 is superseded before it starts
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    let superseded = waiting.await.unwrap();
    superseded.assert_status(StatusCode::CONFLICT);
    assert_eq!(superseded.json()["error"], "fenced_out");
    assert_eq!(newer.await.unwrap().status, StatusCode::CREATED);
    // Removed in the background; the retry of the key (by the newer grant) is forwarded.
    until(
        Duration::from_secs(3),
        "the superseded request's record removed",
        || async { records(&pg).await == 0 },
    )
    .await;
    let retry = rg.payment("a", 44).key("k").body("{}").send().await;
    retry.assert_status(StatusCode::CREATED);
    let tokens: Vec<_> = rail
        .ledger()
        .iter()
        .map(|e| e.token.clone().unwrap())
        .collect();
    assert_eq!(tokens, ["42", "44", "44"]);
}

#[tokio::test]
async fn retention_removes_old_records() {
    let World { pg, rail, rg, .. } = World::postgres(&[
        ("RAILGUARD__IDEMPOTENCY__RETENTION_SECS", "1"),
        ("RAILGUARD__IDEMPOTENCY__SWEEP_INTERVAL_SECS", "1"),
    ])
    .await;
    assert_eq!(
        rg.payment("a", 1).key("old").body("{}").send().await.status,
        StatusCode::CREATED
    );
    assert_eq!(records(&pg).await, 1);
    until(
        Duration::from_secs(5),
        "the record removed after its retention",
        || async { records(&pg).await == 0 },
    )
    .await;
    // A record in flight (here: left by a crashed proxy long ago) is never swept: only an
    // operator decides about a payment in doubt.
    pg.client()
        .await
        .execute(
            "INSERT INTO idempotency_record (account_id, idempotency_key, fingerprint, token, state, owner, created_at)
             VALUES ('a', 'doubt', 'f', 1, 'in_flight', 'o', now() - interval '1 day')",
            &[],
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        records(&pg).await,
        1,
        "the in-doubt record survived the sweep"
    );
    // After retention a repeat is a new payment: that is what retention means.
    assert_eq!(
        rg.payment("a", 1).key("old").body("{}").send().await.status,
        StatusCode::CREATED
    );
    rail.assert_paid(2, "payments at the rail");
}

#[tokio::test]
async fn large_responses_are_replayed_without_their_body_and_unreached_rails_leave_no_record() {
    let (pg, rail, rg) = World::postgres(&[("RAILGUARD__IDEMPOTENCY__MAX_RESPONSE_BYTES", "10")])
        .await
        .parts();
    let first = rg.payment("a", 1).key("big").body("{}").send().await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(
        first.body.len() > 10,
        "the client got the whole body: {}",
        first.body
    );
    let again = rg.payment("a", 1).key("big").body("{}").send().await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, "");
    assert_eq!(
        again.headers.get("idempotency-replay-body").unwrap(),
        "omitted"
    );
    rail.assert_paid(1, "payments at the rail");

    let dead = format!("http://127.0.0.1:{}", support::free_loopback_port());
    let rg2 = Railguard::start(&pg.url(), &dead, &[]).await;
    let reply = rg2
        .payment("b", 1)
        .key("never-sent")
        .body("{}")
        .send()
        .await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    // Removed in the background, after the answer (`delete_unsent`): waited for, bounded.
    let client = pg.client().await;
    // The rail cannot have seen it, so a retry may go through.
    until(
        Duration::from_secs(5),
        "never-sent's record removed",
        || async {
            let left = support::records::records_keyed(&client, "never-sent").await;
            left == 0
        },
    )
    .await;
}

#[tokio::test]
async fn concurrent_accounts_share_commits() {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let account = format!("acct-{}", i % 50);
        tasks.push(rg.payment(&account, 1 + i / 50).body("{}").spawn());
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().status);
    }
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::CREATED || *s == StatusCode::CONFLICT),
        "{statuses:?}"
    );
    let m = rg.metrics().await;
    let batches = m.get("railguard_fence_batch_size_count");
    let requests = m.get("railguard_fence_batch_size_sum");
    assert_eq!(
        requests, 200.0,
        "every compare-and-set went through a batch"
    );
    assert!(
        batches < requests,
        "some statements carried several requests ({batches} statements)"
    );
    // Every account's mark is the largest token accepted for it.
    for i in 0..50 {
        let account = format!("acct-{i}");
        let mark = pg.mark(&account).await.unwrap();
        let forwarded: Vec<i64> = rail
            .ledger()
            .iter()
            .filter(|e| e.account.as_deref() == Some(account.as_str()))
            .map(|e| e.token.as_ref().unwrap().parse().unwrap())
            .collect();
        assert_eq!(Some(mark), forwarded.iter().max().copied(), "{account}");
        assert!(
            forwarded.windows(2).all(|w| w[0] <= w[1]),
            "{account}: {forwarded:?}"
        );
    }
}

/// Completions are group-committed like the fence's compare-and-sets, and every request still
/// hears its answer only once it is stored: right after the last answer, every record is
/// `done` and every key replays its own answer.
#[tokio::test]
async fn concurrent_keyed_requests_are_all_completed_and_replayable() {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (account, key) = (format!("acct-{}", i % 20), format!("pay-{i}"));
        let paying = rg
            .payment(&account, 3)
            .key(&key)
            .body(&format!("{{\"n\":{i}}}"));
        tasks.push((account, key, i, paying.spawn()));
    }
    let mut answers = Vec::new();
    for (account, key, i, t) in tasks {
        let reply = t.await.unwrap();
        reply.assert_status(StatusCode::CREATED);
        answers.push((account, key, i, reply.body));
    }
    rail.assert_paid(200, "payments at the rail");
    let done: i64 = pg
        .one(
            "SELECT count(*) FROM idempotency_record WHERE state = 'done' AND status = 201",
            &[],
        )
        .await;
    assert_eq!(done, 200, "stored before any answer went out");
    let m = rg.metrics().await;
    let statements = m.get("railguard_idempotency_completion_batch_size_count");
    let completions = m.get("railguard_idempotency_completion_batch_size_sum");
    assert_eq!(completions, 200.0, "every completion went through a batch");
    assert!((1.0..=200.0).contains(&statements), "{statements}");
    for (account, key, i, body) in answers {
        let again = rg
            .payment(&account, 3)
            .key(&key)
            .body(&format!("{{\"n\":{i}}}"))
            .send()
            .await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.headers.get("idempotency-replayed").unwrap(), "true");
        assert_eq!(again.body, body, "{key} replays its own answer");
    }
    rail.assert_paid(200, "no replay reached the rail");
}

/// A record removed while its request is at the rail (an operator forgot it; here deleted
/// behind railguard's back) stays removed: the completion stores nothing, and the client still
/// hears the rail's answer. A retry of the key is then a new payment, as forgetting means.
#[tokio::test]
async fn a_completion_whose_record_was_forgotten_does_not_resurrect_it() {
    let (pg, rail, rg) =
        World::postgres_on(Rail::with_latency(Duration::from_millis(600)).await, &[])
            .await
            .parts();
    let paying = rg.payment("a", 2).key("forgotten").body("{}").spawn();
    // Its neighbour in the same account completes normally, in the same window.
    let neighbour = rg.payment("a", 2).key("kept").body("{}").spawn();
    rail.until_paid(2).await;
    rail.assert_paid(2, "both reached the rail");
    let client = pg.client().await;
    let deleted = client
        .execute(
            "DELETE FROM idempotency_record WHERE account_id = 'a' AND idempotency_key = 'forgotten'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(deleted, 1, "the record was in flight");

    let reply = paying.await.unwrap();
    reply.assert_status(StatusCode::CREATED);
    assert_eq!(neighbour.await.unwrap().status, StatusCode::CREATED);
    let states = support::records::record_states(&client).await;
    assert_eq!(
        states,
        [("kept".to_string(), "done".to_string())],
        "the forgotten record was not made again"
    );
    let retried = rg.payment("a", 2).key("forgotten").body("{}").send().await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(!retried.headers.contains_key("idempotency-replayed"));
    rail.assert_paid(3, "forgotten means a retry is a new payment");
}

/// Whether the railguard of `instance` holds its instance lock, as forget looks it up.
async fn instance_lock_held(pg: &Pg, instance: i64) -> bool {
    pg.client()
        .await
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
                AND objsubid = 1 AND classid = ($1::bigint >> 32)::oid
                AND objid = ($1::bigint & 4294967295)::oid)",
            &[&instance],
        )
        .await
        .unwrap()
        .get(0)
}

async fn wait_for_lock(pg: &Pg, instance: i64, held: bool) {
    until(
        Duration::from_secs(10),
        format!("instance {instance}'s lock held = {held}"),
        || async { instance_lock_held(pg, instance).await == held },
    )
    .await
}

/// A missing instance lock is no proof that a record's owner has stopped: a paused owner whose
/// database session is lost (a backend crash resets every session without restarting the
/// postmaster; a terminated session; a failover) holds no lock either, and sends once it runs
/// again. Only the owner's own clean stop, or the operator's word naming it, shows it stopped;
/// a held lock refuses even that word.
#[tokio::test]
async fn a_paused_owner_whose_session_was_lost_is_not_taken_as_stopped() {
    init_tracing();
    let pg = Pg::start().await;
    // Slower than the harness's request timeout: the forward ends without an answer (504) and
    // its owner declares the record in doubt.
    let rail = Rail::with_latency(Duration::from_secs(6)).await;
    let owner_rg = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    let other = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    let owner = owner_rg
        .instance()
        .expect("railguard logs its instance when it starts");
    let first = owner_rg
        .payment("a", 4)
        .key("paused")
        .body("{}")
        .send()
        .await;
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    wait_until_in_doubt(&pg, "paused").await;
    rail.assert_paid(1, "the payment reached the rail");

    // Running, it is refused even on the operator's word.
    let owner_text = owner.to_string();
    let refused = other
        .forget_with("a", "paused", &["--owner-stopped", &owner_text])
        .await;
    assert!(
        !refused.status.success(),
        "a running owner is never taken as stopped"
    );
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        why.contains("owner_running: ")
            && why.contains(&format!("instance {owner_text}"))
            && why.contains("not heard"),
        "{why}"
    );
    let unrecorded = other
        .forget_with("a", "paused", &["--owner-stopped", "unrecorded"])
        .await;
    assert!(!unrecorded.status.success());
    let why = String::from_utf8_lossy(&unrecorded.stderr);
    assert!(
        why.contains("owner_running: ") && why.contains("is for records that name no owner"),
        "{why}"
    );

    // Paused, and its lock's session ended under it.
    let pid = owner_rg.pid().unwrap();
    signal(pid, "STOP").await;
    let ended: bool = pg
        .client()
        .await
        .query_one(
            "SELECT bool_or(pg_terminate_backend(pid)) FROM pg_locks
             WHERE locktype = 'advisory' AND granted AND objsubid = 1
               AND classid = ($1::bigint >> 32)::oid AND objid = ($1::bigint & 4294967295)::oid",
            &[&owner],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ended, "the owner's lock session was found and ended");
    wait_for_lock(&pg, owner, false).await;
    let unknown = other.forget("a", "paused").await;
    signal(pid, "CONT").await;
    assert!(!unknown.status.success(), "a lost lock is not a stop");
    let why = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        why.contains("owner_not_seen_stopping: ")
            && why.contains("nothing shows it has stopped")
            && why.contains(&format!("instance {owner}")),
        "{why}"
    );
    assert_eq!(records(&pg).await, 1, "the record is left as it is");
    // Running again, it takes its lock again and is refused again.
    wait_for_lock(&pg, owner, true).await;
    let again = other
        .forget_with("a", "paused", &["--owner-stopped", &owner_text])
        .await;
    assert!(!again.status.success());
    rail.assert_paid(1, "never forwarded again on its own");
}

/// A crashed owner records no stop: forget names it, refuses another instance's name, and
/// forgets on the operator's word for the owner — the delete and its audit record in one
/// transaction.
#[tokio::test]
async fn a_crashed_owners_record_is_forgotten_on_the_operators_word_naming_it() {
    // The killed owner's forward counts as on its way until its row is quiet
    // (`store::handover`): half a second of transit keeps that short.
    let World {
        mut pg,
        rail,
        mut rg,
        ..
    } = World::postgres_process(
        Rail::with_latency(Duration::from_secs(6)).await,
        &[("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "500")],
    )
    .await;
    let owner = rg
        .instance()
        .expect("railguard logs its instance when it starts");
    let first = rg.payment("a", 4).key("gone").body("{}").send().await;
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    wait_until_in_doubt(&pg, "gone").await;
    rg.kill().await;
    // A PostgreSQL restart on top changes nothing of what follows.
    pg.server.stop().await;
    pg.server.start().await.unwrap();
    rg.start_again().await;
    let running = rg.instance().unwrap();
    assert_ne!(running, owner, "a new process is a new instance");

    let unknown = rg.forget("a", "gone").await;
    assert!(!unknown.status.success());
    let why = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        why.contains("owner_not_seen_stopping: ") && why.contains(&format!("instance {owner}")),
        "{why}"
    );
    // Another instance's word is not the owner's.
    let running_text = running.to_string();
    let other = rg
        .forget_with("a", "gone", &["--owner-stopped", &running_text])
        .await;
    assert!(!other.status.success());
    let why = String::from_utf8_lossy(&other.stderr);
    assert!(why.contains("is not the owner"), "{why}");
    let retry = rg.payment("a", 4).key("gone").body("{}").send().await;
    retry.assert_status(StatusCode::CONFLICT);
    assert_eq!(retry.json()["error"], "in_doubt");
    rail.assert_paid(1, "never forwarded again on its own");

    let owner_text = owner.to_string();
    let forgot = forget_when_due(&rg, "a", "gone", &["--owner-stopped", &owner_text]).await;
    assert!(
        forgot.status.success(),
        "{}",
        String::from_utf8_lossy(&forgot.stderr)
    );
    let audit = pg
        .client()
        .await
        .query_one(
            "SELECT reason, outcome->>'owner_stopped', (outcome->>'owner_instance')::bigint
             FROM railguard_audit WHERE action = 'idempotency_forget'",
            &[],
        )
        .await
        .unwrap();
    let (reason, because, named): (String, String, i64) =
        (audit.get(0), audit.get(1), audit.get(2));
    assert!(reason.contains("--owner-stopped"), "{reason}");
    assert_eq!(because, "on_the_operators_word");
    assert_eq!(named, owner);
    // The grant from before the PostgreSQL restart is fenced once (store::epoch); the key is
    // free again for the payment under a grant from after it.
    let stale = rg.payment("a", 4).key("gone").body("{}").send().await;
    assert_eq!(stale.json()["error"], "fenced_out", "{}", stale.body);
    let floor = pg
        .floor()
        .await
        .expect("railguard met the restarted server");
    let again = rg.payment("a", floor).key("gone").body("{}").send().await;
    again.assert_status(StatusCode::GATEWAY_TIMEOUT);
    rail.assert_paid(2, "forwarded again only after the operator said so");
}

/// A record that names no owner (made by a railguard older than migration 0004) has nothing in
/// the database to speak for the process that made it — no lock, no clean stop — and that
/// process may be paused, not stopped: forget keeps it until the operator says every railguard
/// running when it was made has stopped (`--owner-stopped unrecorded`), and audits that word.
#[tokio::test]
async fn a_record_naming_no_owner_is_forgotten_only_on_the_operators_word() {
    // Its answer never comes within the test: a late answer would complete the record.
    let (pg, rail, rg) =
        World::postgres_process(Rail::with_latency(Duration::from_secs(60)).await, &[])
            .await
            .parts();
    let first = rg.payment("a", 4).key("old").body("{}").send().await;
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    wait_until_in_doubt(&pg, "old").await;
    // As a binary from before migration 0004 left it: no owner instance.
    let db = pg.client().await;
    let unowned = db
        .execute(
            "UPDATE idempotency_record SET owner_instance = NULL WHERE idempotency_key = 'old'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(unowned, 1);
    let created: std::time::SystemTime = db
        .query_one(
            "SELECT created_at FROM idempotency_record WHERE idempotency_key = 'old'",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    for word in [&[][..], &["--owner-stopped", "7"][..]] {
        let refused = rg.forget_with("a", "old", word).await;
        assert!(!refused.status.success(), "{word:?}");
        let why = String::from_utf8_lossy(&refused.stderr);
        assert!(
            why.contains("owner_unrecorded: ") && why.contains("names no owner"),
            "{word:?}: {why}"
        );
    }
    let nonsense = rg
        .forget_with("a", "old", &["--owner-stopped", "maybe"])
        .await;
    assert!(!nonsense.status.success());
    let why = String::from_utf8_lossy(&nonsense.stderr);
    assert!(why.contains("neither an instance number"), "{why}");
    let retry = rg.payment("a", 4).key("old").body("{}").send().await;
    retry.assert_status(StatusCode::CONFLICT);
    assert_eq!(retry.json()["error"], "in_doubt");
    rail.assert_paid(1, "kept, and never forwarded again");

    let forgot = forget_when_due(&rg, "a", "old", &["--owner-stopped", "unrecorded"]).await;
    assert!(
        forgot.status.success(),
        "{}",
        String::from_utf8_lossy(&forgot.stderr)
    );
    let audit = db
        .query_one(
            "SELECT reason, outcome->>'owner_stopped', outcome->>'owner_instance',
                    outcome->>'record_created'
                        = to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US\"Z\"')
             FROM railguard_audit, (SELECT $1::timestamptz AS created_at) r
             WHERE action = 'idempotency_forget'",
            &[&created],
        )
        .await
        .unwrap();
    let (reason, because, named, dated): (String, String, Option<String>, bool) =
        (audit.get(0), audit.get(1), audit.get(2), audit.get(3));
    assert!(reason.contains("--owner-stopped unrecorded"), "{reason}");
    assert!(dated, "the audit names when the record was made");
    assert_eq!(because, "no_owner");
    assert_eq!(named, None);
    let again = rg.payment("a", 4).key("old").body("{}").send().await;
    again.assert_status(StatusCode::GATEWAY_TIMEOUT);
    rail.assert_paid(2, "forwarded again only after the word");
}

/// An owner that stops cleanly, with every forward ended, says so: its records in doubt are
/// forgotten without the operator's word (the procedure's "stop that process, then forget") —
/// once nothing it sent can still reach the rail. Here the forward is let go unanswered by
/// `proxy.late_answer_wait_ms`, so the stop records the transit time after that
/// (`quiet_after`), and forget waits for it and for the record's in-doubt deadline plus the
/// transit time.
#[tokio::test]
async fn a_cleanly_stopped_owners_record_is_forgotten_without_the_operators_word() {
    let World {
        pg,
        rail: _rail,
        mut rg,
        ..
    } = World::postgres_process(
        Rail::with_latency(Duration::from_secs(6)).await,
        &[
            ("RAILGUARD__PROXY__LATE_ANSWER_WAIT_MS", "500"),
            ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "5000"),
        ],
    )
    .await;
    let owner = rg.instance().unwrap();
    let first = rg.payment("a", 4).key("stopped").body("{}").send().await;
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    wait_until_in_doubt(&pg, "stopped").await;
    rg.restart().await;
    let stops = clean_stops(&pg, owner).await;
    assert_eq!(stops, 1, "{}", rg.log());
    let early = rg.forget("a", "stopped").await;
    assert!(!early.status.success(), "refused within the transit time");
    let why = String::from_utf8_lossy(&early.stderr);
    assert!(
        why.contains("may still be on its way to the rail until")
            && why.contains("recorded a clean stop"),
        "{why}"
    );
    let forgot = forget_when_due(&rg, "a", "stopped", &[]).await;
    assert!(
        forgot.status.success(),
        "{}",
        String::from_utf8_lossy(&forgot.stderr)
    );
}

/// A completion the database did not take at once is retried in the background; a graceful
/// stop that ended those retries with the process would leave a paid request's record in
/// flight, then in doubt (its repeats refused instead of replayed). The stop waits for them
/// within `shutdown.grace_ms`: PostgreSQL back during the stop, the record is completed.
#[tokio::test]
async fn a_graceful_stop_waits_for_a_completion_still_retried_in_the_background() {
    // Longer than the retries' longest pause (5 s), so the test does not race the backoff.
    let World {
        mut pg,
        rail,
        mut rg,
        ..
    } = World::postgres_process(
        Rail::with_latency(Duration::from_millis(1500)).await,
        &[("RAILGUARD__SHUTDOWN__GRACE_MS", "15000")],
    )
    .await;
    let paying = rg.payment("a", 4).key("late-store").body("{}").spawn();
    rail.until_paid(1).await;
    rail.assert_paid(1, "the payment reached the rail");
    // PostgreSQL goes away before the rail answers: the answer cannot be stored.
    pg.server.stop().await;
    let answered = paying.await.unwrap();
    answered.assert_status(StatusCode::CREATED);

    let stopping = tokio::spawn(async move {
        let status = rg.stop().await;
        (rg, status)
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!stopping.is_finished(), "the stop waits for the outcome");
    pg.server.start().await.unwrap();
    let (rg, status) = stopping.await.unwrap();
    assert!(status.success(), "{status}");
    let state: String = pg
        .client()
        .await
        .query_one(
            "SELECT state FROM idempotency_record WHERE account_id = 'a'
               AND idempotency_key = 'late-store'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "done", "{}", rg.log());
}

/// Every keyed request is counted as outstanding from before its compare-and-set, not only
/// once its forward starts: otherwise a stop while it waits for its account's turn (behind a
/// slower forward) would record a clean stop — "sends nothing more" — and the request would
/// reach the rail afterwards.
#[tokio::test]
async fn no_clean_stop_is_recorded_while_a_keyed_request_waits_for_its_turn() {
    let World {
        pg, rail, mut rg, ..
    } = World::postgres_process(
        Rail::with_latency(Duration::from_millis(1500)).await,
        &[("RAILGUARD__SHUTDOWN__GRACE_MS", "1000")],
    )
    .await;
    let owner = rg.instance().unwrap();
    // A keyless forward holds the account's turn at the rail; the keyed one waits behind it.
    let first = rg.payment("turn", 100).body("{}").spawn();
    rail.until_paid(1).await;
    let waiting = rg.payment("turn", 101).key("waits").body("{}").spawn();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(records(&pg).await, 1, "the keyed request's record is made");
    let status = rg.stop().await;
    assert!(status.success(), "{status}");
    let _ = (first.await, waiting.await);
    let stops = clean_stops(&pg, owner).await;
    assert_eq!(stops, 0, "{}", rg.log());
}

/// W1 pays P; W2 takes the account over and pays; W1, whose answer was lost, retries P with
/// P's key: it gets P's own answer, not `fenced_out` — fencing refuses new payments of a
/// superseded grant, not the replay of one it let through. W1's new payment under the same
/// grant is refused, and a stale grant never receives another grant's answer (W2's key under
/// W1's token is refused too).
#[tokio::test]
async fn a_retry_after_its_grant_was_superseded_gets_its_own_answer() {
    let (_pg, rail, rg) = World::postgres_process(Rail::start().await, &[])
        .await
        .parts();
    let first = rg.payment("a", 10).key("p").body("{\"n\":1}").send().await;
    first.assert_status(StatusCode::CREATED);
    let newer = rg.payment("a", 11).key("q").body("{\"n\":2}").send().await;
    newer.assert_status(StatusCode::CREATED);

    let retry = support::eventually(
        Duration::from_secs(10),
        "the retry of p answered other than in_flight",
        || async {
            let reply = rg.payment("a", 10).key("p").body("{\"n\":1}").send().await;
            // The completion may still be on its way: in_flight until it is stored.
            (reply.status != StatusCode::CONFLICT || reply.json()["error"] != "in_flight")
                .then_some(reply)
        },
    )
    .await;
    retry.assert_status(StatusCode::CREATED);
    assert_eq!(retry.headers.get("idempotency-replayed").unwrap(), "true");
    assert_eq!(retry.body, first.body);

    let changed = rg.payment("a", 10).key("p").body("{\"n\":9}").send().await;
    changed.assert_status(StatusCode::UNPROCESSABLE_ENTITY);
    let new_payment = rg.payment("a", 10).key("r").body("{\"n\":3}").send().await;
    assert_eq!(
        new_payment.json()["error"],
        "fenced_out",
        "{}",
        new_payment.body
    );
    let others = rg.payment("a", 10).key("q").body("{\"n\":2}").send().await;
    assert_eq!(others.json()["error"], "fenced_out", "{}", others.body);
    rail.assert_paid(2, "the rail saw P and Q once each");
}
