//! The store goes back: PostgreSQL's data directory put back to a copy taken seconds earlier —
//! what promoting an asynchronous standby that missed the last commits does. Marks, lock rows
//! and `fencing_token_seq` go back together; railguard notices the server changed before it
//! uses a session, raises the fencing floor, and every grant from before is fenced out once:
//! no token is handed out twice (INV-04) and no superseded grant pays again (INV-05).
//! With the detection switched off (the negative control), the same rewind lets the
//! superseded grant pay after the newer one: the rail pays twice.

use railguard_testkit as support;

use support::payment::{fenced_out, grant, paid, pay, pay_after_the_hold};

use std::time::Duration;

use tokio::time::Instant;

/// Longer than the hold after a change of server (3 s + the test config's
/// `proxy.rail_transit_ms`), with room for a loaded machine.
const HOLD: Duration = Duration::from_secs(30);

/// A superseded grant's lease, a newer grant's, and how long a newer grant waits for its key.
const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(60);
const WAIT: Duration = Duration::from_secs(5);
const NOW: Duration = Duration::ZERO;

use http::StatusCode;
use railguard::sdk::{LockHandle, RailClient, SdkError};
use support::{Pg, Rail, Railguard, Relay, World, eventually, init_tracing};

struct Run {
    /// The superseded grant's payment after the rewind: refused?
    old_refused: bool,
    /// The newer grant's payment after the rewind: refused (it predates the rewind too)?
    newer_refused: bool,
    /// Tokens: the superseded grant's, the newer one's, the first after the rewind.
    tokens: (i64, i64, Option<i64>),
    rail_tokens: Vec<i64>,
    rg: Railguard,
    pg: Pg,
}

/// W1 (lease `ttl`) pays p1, the copy is taken, W1's lease runs out, W2 takes the key and pays
/// p2; the database is put back to the copy and railguard restarted (a railguard that did not
/// run through the rewind remembers no mark of its own). W1's grant and W2's.
async fn superseded_across_a_rewind(
    pg: &mut Pg,
    rg: &mut Railguard,
    ttl: Duration,
) -> (LockHandle, LockHandle) {
    let (lock, proxy) = (rg.lock_client(), RailClient::new(rg.proxy_url("")));
    let w1 = grant(&lock, "acct", "w1", ttl, NOW).await;
    paid(&proxy, &w1, "acct", "p1").await;
    let copy = pg.copy_data().await.unwrap();
    let w2 = grant(&lock, "acct", "w2", LONG, ttl * 20).await;
    assert!(w2.token().get() > w1.token().get());
    paid(&proxy, &w2, "acct", "p2").await;
    pg.rewind_to(&copy).await.unwrap();
    rg.restart().await;
    (w1, w2)
}

/// [`superseded_across_a_rewind`], then W1 and W2 try again, and W3 acquires.
async fn rewind_under(env: &[(&str, &str)]) -> Run {
    let (mut pg, rail, mut rg) = World::postgres_process(Rail::start().await, env)
        .await
        .parts();
    let (lock, proxy) = (rg.lock_client(), RailClient::new(rg.proxy_url("")));
    let (w1, w2) = superseded_across_a_rewind(&mut pg, &mut rg, Duration::from_millis(300)).await;
    let old = pay(&proxy, &w1, "acct", "p3").await;
    let newer = pay(&proxy, &w2, "acct", "p4").await;
    // Without the detection the token-source guard may find the source behind a mark and
    // refuse every grant: then there is no third grant.
    let w3 = lock
        .acquire(
            "acct",
            "w3",
            Duration::from_secs(60),
            Duration::from_secs(5),
        )
        .await
        .ok();
    let rail_tokens = rail.tokens();
    Run {
        old_refused: matches!(old, Err(SdkError::FencedOut { .. })),
        newer_refused: matches!(newer, Err(SdkError::FencedOut { .. })),
        tokens: (
            w1.token().get(),
            w2.token().get(),
            w3.map(|w3| w3.token().get()),
        ),
        rail_tokens,
        rg,
        pg,
    }
}

#[tokio::test]
async fn a_rewound_database_fences_every_grant_from_before_it() {
    let run = rewind_under(&[]).await;
    let (t1, t2, t3) = run.tokens;
    let t3 = t3.expect("grants go on after the rewind");
    assert!(run.old_refused, "the superseded grant must not pay again");
    assert!(
        run.newer_refused,
        "a grant from before the rewind is fenced once"
    );
    assert!(
        t3 > t2,
        "a token is never handed out twice: {t3} after {t2}"
    );
    assert!(
        t3 >= t2 + railguard::store::epoch::FLOOR_GAP,
        "the first grant after the rewind starts at the new floor: {t3}"
    );
    // The rail saw each grant once, in order, and nothing after the rewind.
    assert_eq!(run.rail_tokens, [t1, t2]);
    // Whichever railguard met the new server first fenced it (here the one stopping, as it
    // recorded its clean stop): one audit row, one error line, and every railguard reads the
    // new epoch.
    let audit = run
        .pg
        .client()
        .await
        .query_one(
            "SELECT count(*), min(outcome->>'floor')::bigint FROM railguard_audit \
             WHERE action = 'store_changed'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(audit.get::<_, i64>(0), 1);
    assert_eq!(audit.get::<_, i64>(1), t3);
    let metrics = run.rg.metrics().await;
    assert_eq!(metrics.get("railguard_store_epoch"), 1.0);
    // W2's grant was superseded by nothing: it meets the floor. (W1's may meet the mark this
    // process remembers first: it was superseded by W2's.)
    assert!(metrics.get("railguard_requests_total{outcome=\"fenced_below_floor\"}") >= 1.0);
    assert!(
        run.rg.log().contains("CHANGED SERVER"),
        "an error line names the change"
    );
}

#[tokio::test]
async fn without_the_detection_a_rewound_database_lets_a_superseded_grant_pay_again() {
    let run = rewind_under(&[("RAILGUARD__GUARD__DETECT_STORE_CHANGES", "false")]).await;
    let (t1, t2, _) = run.tokens;
    assert!(!run.old_refused, "the negative control must show the bug");
    // The rail received the superseded grant's payment after the newer grant's.
    assert_eq!(run.rail_tokens[..3], [t1, t2, t1]);
    assert_eq!(
        run.rg
            .metrics()
            .await
            .get("railguard_store_change_detection"),
        0.0
    );
}

/// A payment whose record went back with the store may already be on the rail. W1 pays P after
/// the copy is taken; the database goes back to the copy, and P's record with it. W2, holding
/// the account afterwards, retries P with P's key and the token P was first sent under: in
/// doubt, not paid twice. A payment first sent under W2's own grant goes through.
#[tokio::test]
async fn a_retry_whose_first_attempt_went_back_with_the_store_is_in_doubt() {
    let (mut pg, rail, mut rg) = World::postgres_process(Rail::start().await, &[])
        .await
        .parts();
    let (lock, proxy) = (rg.lock_client(), RailClient::new(rg.proxy_url("")));

    let w1 = grant(&lock, "acct", "w1", SHORT, NOW).await;
    let copy = pg.copy_data().await.unwrap();
    paid(&proxy, &w1, "acct", "p").await;
    pg.rewind_to(&copy).await.unwrap();
    rg.restart().await;

    let w2 = grant(&lock, "acct", "w2", LONG, WAIT).await;
    let body = "{\"id\":\"p\"}";
    let retry = proxy
        .retry(&w2, "acct", "/payments", body.into(), "p", w1.token())
        .await
        .unwrap();
    assert_eq!(retry.status, StatusCode::CONFLICT);
    let answer: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(answer["error"], "in_doubt", "{answer}");
    rail.assert_paid(1, "P was paid once");

    // A new payment waits out the hold after the change of server (503, nothing sent).
    let fresh = support::eventually(HOLD, "a new payment past the hold (not 503)", || async {
        let fresh = proxy
            .retry(
                &w2,
                "acct",
                "/payments",
                "{\"id\":\"q\"}".into(),
                "q",
                w2.token(),
            )
            .await
            .unwrap();
        (fresh.status != StatusCode::SERVICE_UNAVAILABLE).then_some(fresh)
    })
    .await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    rail.assert_paid(2, "payments at the rail");
}

/// The same with the rail's lookup by idempotency key (`[rail_lookup]`), three accounts, one
/// railguard that runs through the rewind: PAID reached the rail before it, HELD is still on
/// its way (its path to the rail holds it), and UNSENT never left. Their records went back with
/// the store. W2's retries, each with the first grant's token in `Idempotency-First-Token`:
/// UNSENT's, once nothing sent before the change can still land, asks the rail, which has no
/// such payment, and is forwarded — paid once; HELD's asks nothing while railguard's own
/// forward of it is on its way (503, come back), and once that lands, the rail has it and the
/// retry is told so (`in_doubt`: with no record nothing says the retry is the request it has);
/// PAID's likewise. Each is paid exactly once.
#[tokio::test]
async fn with_the_rails_lookup_a_retry_whose_record_went_back_is_forwarded_only_when_the_rail_has_none()
 {
    init_tracing();
    let mut pg = Pg::start().await;
    let rail = Rail::start().await;
    let path = Relay::start(rail.addr).await;
    path.stall_first(|chunk| chunk.windows(4).any(|w| w == b"held"));
    let settings = [
        (
            "RAILGUARD__RAIL_LOOKUP__PATH",
            "/payments?account={account}&idempotency_key={key}",
        ),
        // Longer than the rewind takes: railguard's own forward on the held path keeps its
        // connection meanwhile.
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "4000"),
    ];
    let rg = Railguard::start_process(&pg.url(), &path.url(), &settings).await;
    let lock = rg.lock_client();
    let proxy = RailClient::new(rg.proxy_url(""));

    let mut first = Vec::new();
    for account in ["acct-paid", "acct-held", "acct-unsent"] {
        first.push(grant(&lock, account, "w1", SHORT, NOW).await);
    }
    let copy = pg.copy_data().await.unwrap();
    paid(&proxy, &first[0], "acct-paid", "paid").await;
    let held = {
        let (proxy, w1) = (proxy.clone(), first[1].clone());
        tokio::spawn(async move { pay(&proxy, &w1, "acct-held", "held").await })
    };
    eventually(WAIT, "the held path holding HELD", || async {
        path.has_stalled().then_some(())
    })
    .await;
    pg.rewind_to(&copy).await.unwrap();

    let mut second = Vec::new();
    for account in ["acct-paid", "acct-held", "acct-unsent"] {
        second.push(grant(&lock, account, "w2", LONG, WAIT).await);
    }
    let retry = |n: usize, account: &'static str, key: &'static str| {
        let (proxy, w1, w2) = (&proxy, &first[n], &second[n]);
        async move {
            let body = format!("{{\"id\":\"{key}\"}}");
            let reply = proxy
                .retry(w2, account, "/payments", body.into(), key, w1.token())
                .await
                .unwrap();
            let error = serde_json::from_slice::<serde_json::Value>(&reply.body)
                .ok()
                .and_then(|b| b["error"].as_str().map(str::to_string));
            (
                reply.status,
                error,
                String::from_utf8_lossy(&reply.body).to_string(),
            )
        }
    };
    // Past the hold after the change (503 while it lasts), UNSENT's retry is forwarded.
    let unsent = eventually(HOLD, "UNSENT's retry forwarded", || async {
        let answer = retry(2, "acct-unsent", "unsent").await;
        (answer.0 != StatusCode::SERVICE_UNAVAILABLE && answer.1.as_deref() != Some("in_doubt"))
            .then_some(answer)
    })
    .await;
    assert_eq!(unsent.0, StatusCode::CREATED, "{unsent:?}");
    assert_eq!(rail.times_paid("unsent"), 1);

    // HELD's first attempt is still on its way: its retry is not forwarded, whatever the rail
    // would say now, and is told to come back (503, nothing changed). Unless railguard let
    // that forward go during the rewind (a forward's connection is closed once its row could
    // not be written for 2.5 s, and what it wrote is then taken to arrive within
    // `proxy.rail_transit_ms` or never): then the held bytes are never delivered, as the
    // contract says, and the retry may be the one that pays.
    let let_go = rg
        .log()
        .contains("could not write which forwards it has on their way for too long");
    if let_go {
        let paid = eventually(HOLD, "HELD's retry answered", || async {
            let answer = retry(1, "acct-held", "held").await;
            (answer.0 != StatusCode::SERVICE_UNAVAILABLE).then_some(answer)
        })
        .await;
        assert_eq!(paid.0, StatusCode::CREATED, "{paid:?}");
        rail.until_paid(2).await;
    } else {
        for _ in 0..3 {
            let answer = retry(1, "acct-held", "held").await;
            assert_eq!(answer.0, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        }
        assert_eq!(rail.times_paid("held"), 0, "HELD is still on its way");
        path.release_stalled();
        rail.until_paid(3).await;
        let _ = held.await;
        let answer = retry(1, "acct-held", "held").await;
        assert_eq!(answer.1.as_deref(), Some("in_doubt"), "{answer:?}");
    }

    let answer = retry(0, "acct-paid", "paid").await;
    assert_eq!(answer.1.as_deref(), Some("in_doubt"), "{answer:?}");
    assert!(
        answer.2.contains("the first attempt was paid"),
        "{answer:?}"
    );

    for key in ["paid", "held", "unsent"] {
        assert_eq!(rail.times_paid(key), 1, "{key} paid once");
    }
    let metrics = rg.metrics().await;
    let asked = |outcome: &str| {
        metrics.get(&format!(
            "railguard_in_doubt_resolved_total{{outcome=\"{outcome}\"}}"
        ))
    };
    assert_eq!(
        asked("not_paid"),
        if let_go { 2.0 } else { 1.0 },
        "UNSENT (and HELD, let go): not on the rail"
    );
    let audited: Vec<String> = pg
        .column(
            "SELECT outcome->>'idempotency_key' FROM railguard_audit
             WHERE action = 'idempotency_resolve' AND outcome->>'result' = $1",
            &[&railguard::store::records::FIRST_REQUEST_AFTER_STORE_CHANGE],
        )
        .await;
    let expected: &[&str] = if let_go {
        &["unsent", "held"]
    } else {
        &["unsent"]
    };
    assert_eq!(audited, expected, "the retries that went on, audited");
    if !let_go {
        assert!(asked("paid") >= 2.0, "HELD after it landed, and PAID");
        assert!(asked("unresolved") >= 3.0, "HELD while on its way");
    }
}

/// A copy from before an earlier floor was raised: PostgreSQL restarts (floor one), W1 is
/// granted from it and pays; railguard crashes, the data directory goes back to the copy (no
/// floor in it), railguard starts again with no memory. The floor it raises must be above W1's
/// token, or W2 is handed W1's token again and W1's grant pays again.
#[tokio::test]
async fn a_rewind_past_an_earlier_floor_hands_out_no_token_twice() {
    let (mut pg, rail, mut rg) = World::postgres_process(Rail::start().await, &[])
        .await
        .parts();
    let (lock, proxy) = (rg.lock_client(), RailClient::new(rg.proxy_url("")));
    let w0 = grant(&lock, "acct", "w0", SHORT, NOW).await;
    paid(&proxy, &w0, "acct", "p0").await;
    let backup = pg.copy_data().await.unwrap();

    pg.kill().await;
    pg.server.start().await.unwrap();
    let w1 = grant(&lock, "acct", "w1", Duration::from_millis(400), WAIT).await;
    assert_eq!(
        pay_after_the_hold(&proxy, &w1, "acct", "p1", HOLD)
            .await
            .unwrap(),
        StatusCode::CREATED
    );

    rg.kill().await;
    pg.rewind_to(&backup).await.unwrap();
    rg.start_again().await;
    let w2 = grant(&lock, "acct", "w2", LONG, WAIT).await;
    assert!(
        w2.token().get() > w1.token().get(),
        "W2 {} after W1 {}",
        w2.token().get(),
        w1.token().get()
    );
    assert_eq!(
        pay_after_the_hold(&proxy, &w2, "acct", "p2", HOLD)
            .await
            .unwrap(),
        StatusCode::CREATED
    );
    let again = pay(&proxy, &w1, "acct", "p1").await;
    assert!(
        matches!(again, Err(SdkError::FencedOut { .. })),
        "{again:?}"
    );
    let p1 = rail.times_paid("p1");
    assert_eq!(p1, 1, "p1 paid once");
}

/// A dump restored into the running server (pg_restore --clean): the server is the same, but
/// railguard's tables are new. Marks, records and the sequence went back; the change is fenced
/// all the same, and nothing is paid twice.
#[tokio::test]
async fn a_dump_restored_into_the_running_server_is_fenced() {
    let (pg, rail, mut rg) = World::postgres_process(Rail::start().await, &[])
        .await
        .parts();
    let (lock, proxy) = (rg.lock_client(), RailClient::new(rg.proxy_url("")));
    let ttl = Duration::from_millis(300);
    let w1 = grant(&lock, "acct", "w1", ttl, NOW).await;
    paid(&proxy, &w1, "acct", "p1").await;
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("railguard.dump");
    let out = tokio::process::Command::new(pg.server.bin_dir().join("pg_dump"))
        .args(["-Fc", "-d", &pg.url(), "-f"])
        .arg(&dump)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "pg_dump: {out:?}");
    let w2 = grant(&lock, "acct", "w2", LONG, ttl * 20).await;
    paid(&proxy, &w2, "acct", "p2").await;

    rg.stop().await;
    let out = tokio::process::Command::new(pg.server.bin_dir().join("pg_restore"))
        .args([
            "--clean",
            "--if-exists",
            "--single-transaction",
            "-d",
            &pg.url(),
        ])
        .arg(&dump)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "pg_restore: {out:?}");
    rg.start_again().await;

    for (grant, id) in [(&w1, "p3"), (&w2, "p2")] {
        fenced_out(&proxy, grant, "acct", id).await;
    }
    let w3 = grant(&lock, "acct", "w3", LONG, WAIT).await;
    assert!(w3.token().get() > w2.token().get());
    let retry = proxy
        .retry(
            &w3,
            "acct",
            "/payments",
            "{\"id\":\"p2\"}".into(),
            "p2",
            w2.token(),
        )
        .await
        .unwrap();
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "p2's record went back: in doubt"
    );
    let p2 = rail.times_paid("p2");
    assert_eq!(p2, 1, "p2 paid once");
}

/// The etcd lock backend, PostgreSQL rewound under it: etcd's revision did not go back, but the
/// marks and records did. W1 pays, is superseded by W2, who pays; PostgreSQL goes back to a
/// copy from between the two. With the detection, every grant from before is fenced (the
/// floor is one above etcd's revision); without it, W1's superseded grant pays again.
async fn etcd_backend_rewind(detect: bool) -> (bool, Vec<i64>, i64, i64) {
    init_tracing();
    let etcd = support::EtcdCluster::single().await;
    let mut pg = Pg::start().await;
    let rail = Rail::start().await;
    let endpoints = etcd.endpoints_csv();
    let detect = detect.to_string();
    let env = [
        ("RAILGUARD__LOCK__BACKEND", "etcd"),
        ("RAILGUARD__ETCD__ENDPOINTS", endpoints.as_str()),
        ("RAILGUARD__GUARD__DETECT_STORE_CHANGES", detect.as_str()),
    ];
    let mut rg = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let proxy = RailClient::new(rg.proxy_url(""));
    let (w1, w2) = superseded_across_a_rewind(&mut pg, &mut rg, Duration::from_secs(1)).await;
    let again = pay(&proxy, &w1, "acct", "p3").await;
    let tokens = rail.tokens();
    (
        matches!(again, Err(SdkError::FencedOut { .. })),
        tokens,
        w1.token().get(),
        w2.token().get(),
    )
}

#[tokio::test]
async fn on_the_etcd_backend_a_rewound_database_fences_the_grants_from_before_it() {
    let (refused, tokens, t1, t2) = etcd_backend_rewind(true).await;
    assert!(refused, "W1's superseded grant must not pay again");
    assert_eq!(tokens, [t1, t2]);
}

#[tokio::test]
async fn on_the_etcd_backend_without_the_detection_a_superseded_grant_pays_again() {
    let (refused, tokens, t1, t2) = etcd_backend_rewind(false).await;
    assert!(!refused, "the negative control must show the bug");
    assert_eq!(
        tokens,
        [t1, t2, t1],
        "W1's token reached the rail after W2's"
    );
}

const LOOKUP: (&str, &str) = (
    "RAILGUARD__RAIL_LOOKUP__PATH",
    "/payments?account={account}&idempotency_key={key}",
);

/// `(status, error code)` of a keyed retry of `key` on `account` under `w2`, carrying `first`'s
/// token as `Idempotency-First-Token`.
async fn retry(
    proxy: &RailClient,
    w2: &LockHandle,
    first: &LockHandle,
    account: &str,
    key: &str,
) -> (StatusCode, Option<String>, String) {
    let body = format!("{{\"id\":\"{key}\"}}");
    let reply = proxy
        .retry(w2, account, "/payments", body.into(), key, first.token())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&reply.body).to_string();
    let error = serde_json::from_slice::<serde_json::Value>(&reply.body)
        .ok()
        .and_then(|b| b["error"].as_str().map(str::to_string));
    (reply.status, error, text)
}

/// Retries until an answer that is neither 503 nor `in_doubt`, or `limit`; the last answer.
async fn retry_until_decided(
    proxy: &RailClient,
    w2: &LockHandle,
    first: &LockHandle,
    account: &str,
    key: &str,
    limit: Duration,
) -> (StatusCode, Option<String>, String) {
    let until = Instant::now() + limit;
    loop {
        let answer = retry(proxy, w2, first, account, key).await;
        let undecided =
            answer.0 == StatusCode::SERVICE_UNAVAILABLE || answer.1.as_deref() == Some("in_doubt");
        if !undecided || Instant::now() >= until {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The embedded server, whose data directory is put back from a backup after a crash: its
/// earlier run was killed with HELD's first attempt on its way, and the row that named that
/// forward went back with the data. The retry (`Idempotency-First-Token` of the first grant)
/// with the rail's lookup is not let through while the first attempt can still arrive — the
/// lookup waits 3 s + `proxy.rail_transit_ms` after the change on the embedded server too —
/// and the rail pays HELD once.
#[tokio::test]
async fn the_lookup_after_the_embedded_server_was_restored_waits_for_what_the_earlier_run_sent() {
    let (answer, paid) = embedded_restore().await;
    assert_eq!(paid, 1, "HELD paid once; the retry was answered {answer:?}");
    assert_eq!(answer.0, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
}

/// [`the_lookup_after_the_embedded_server_was_restored_waits_for_what_the_earlier_run_sent`]: the
/// retry's last answer, and how many times the rail paid HELD.
async fn embedded_restore() -> ((StatusCode, Option<String>, String), usize) {
    init_tracing();
    let dir = tempfile::Builder::new()
        .prefix("railguard-embedded-restore-")
        .tempdir()
        .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let data_dir = dir.path().join("pg");
    let copy_dir = dir.path().join("copy");
    let data_dir_text = data_dir.display().to_string();
    let rail = Rail::start().await;
    let path = Relay::start(rail.addr).await;
    let transit = Duration::from_secs(20);
    let transit_ms = transit.as_millis().to_string();
    let env = [
        ("RAILGUARD__DATABASE__DATA_DIR", data_dir_text.as_str()),
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", transit_ms.as_str()),
        LOOKUP,
    ];
    let mut rg = Railguard::start_process("embedded", &path.url(), &env).await;
    // The backup: the data directory of a cleanly stopped railguard.
    assert!(rg.stop().await.success());
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(&data_dir)
        .arg(&copy_dir)
        .status()
        .unwrap();
    assert!(copied.success());
    rg.start_again().await;

    let lock = rg.lock_client();
    let proxy = RailClient::new(rg.proxy_url(""));
    let w1 = grant(&lock, "acct", "w1", SHORT, NOW).await;
    path.stall_first(|chunk| chunk.windows(4).any(|w| w == b"held"));
    let first = {
        let (proxy, w1) = (proxy.clone(), w1.clone());
        tokio::spawn(async move { pay(&proxy, &w1, "acct", "held").await })
    };
    eventually(WAIT, "the path holding HELD's first attempt", || async {
        path.has_stalled().then_some(())
    })
    .await;

    // A crash: railguard and its server killed with HELD's bytes in the network.
    rg.kill().await;
    let killed = Instant::now();
    for pid in support::pids_naming(&data_dir_text) {
        support::signal(pid, "KILL").await;
    }
    eventually(WAIT, "the embedded server gone", || async {
        support::pids_naming(&data_dir_text)
            .is_empty()
            .then_some(())
    })
    .await;
    let _ = first.await;
    // The volume comes back from the backup.
    std::fs::remove_dir_all(&data_dir).unwrap();
    let restored = std::process::Command::new("cp")
        .arg("-a")
        .arg(&copy_dir)
        .arg(&data_dir)
        .status()
        .unwrap();
    assert!(restored.success());
    rg.start_again().await;

    let lock = rg.lock_client();
    let proxy = RailClient::new(rg.proxy_url(""));
    let w2 = grant(&lock, "acct", "w2", LONG, WAIT).await;
    let answer =
        retry_until_decided(&proxy, &w2, &w1, "acct", "held", Duration::from_secs(5)).await;
    let answered = killed.elapsed();
    // The network delivers HELD's first attempt, within proxy.rail_transit_ms of the kill.
    assert!(answered < transit - Duration::from_secs(2), "{answered:?}");
    path.release_stalled();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        killed.elapsed() < transit,
        "released within the stated transit"
    );
    (answer, rail.times_paid("held"))
}

/// Two railguards on one PostgreSQL, a key whose record went back and whose first attempt
/// never left: once the hold has ended, 16 retries at once through A and B, each asking the
/// rail and finding nothing. The compare-and-set's record lets one through: paid once.
#[tokio::test]
async fn concurrent_retries_of_a_key_whose_record_went_back_through_two_railguards_pay_once() {
    init_tracing();
    let mut pg = Pg::start().await;
    let rail = Rail::start().await;
    let env = [LOOKUP, ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "1000")];
    let a = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let w1 = grant(&a.lock_client(), "acct", "w1", SHORT, NOW).await;
    let copy = pg.copy_data().await.unwrap();
    // A record made after the copy, lost with the rewind; the request itself never reached
    // the rail (here: nothing was sent at all).
    pg.rewind_to(&copy).await.unwrap();
    let w2 = grant(&b.lock_client(), "acct", "w2", LONG, WAIT).await;
    // Past the hold: another key's retry decides.
    let first = retry_until_decided(
        &RailClient::new(b.proxy_url("")),
        &w2,
        &w1,
        "acct",
        "warmup",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(first.0, StatusCode::CREATED, "{first:?}");
    let mut tasks = Vec::new();
    for i in 0..16 {
        let proxy = RailClient::new(if i % 2 == 0 {
            a.proxy_url("")
        } else {
            b.proxy_url("")
        });
        let (w1, w2) = (w1.clone(), w2.clone());
        tasks.push(tokio::spawn(async move {
            retry(&proxy, &w2, &w1, "acct", "k").await
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        let a = t.await.unwrap();
        answers.push((a.0, a.1));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(rail.times_paid("k"), 1, "{answers:?}");
}

/// The store goes back twice: after the first rewind a retry of P is let through and paid;
/// the second rewind loses the record that retry made. A retry after it, whichever grant's
/// token it names as the first, finds P on the rail: not forwarded, paid once.
#[tokio::test]
async fn a_retry_whose_record_went_back_twice_is_paid_once() {
    init_tracing();
    let mut pg = Pg::start().await;
    let rail = Rail::start().await;
    let env = [LOOKUP, ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "1000")];
    let rg = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let proxy = RailClient::new(rg.proxy_url(""));
    let w1 = grant(&rg.lock_client(), "acct", "w1", SHORT, NOW).await;
    let copy1 = pg.copy_data().await.unwrap();
    pg.rewind_to(&copy1).await.unwrap();
    let w2 = grant(&rg.lock_client(), "acct", "w2", SHORT, WAIT).await;
    // The store is acknowledged; copy2 has the first floor but not what follows.
    let copy2 = pg.copy_data().await.unwrap();
    let let_through =
        retry_until_decided(&proxy, &w2, &w1, "acct", "p", Duration::from_secs(30)).await;
    assert_eq!(let_through.0, StatusCode::CREATED, "{let_through:?}");
    pg.rewind_to(&copy2).await.unwrap();
    let w3 = grant(&rg.lock_client(), "acct", "w3", LONG, WAIT).await;
    let mut answers = Vec::new();
    for first in [&w1, &w2] {
        // Past the hold after the second change (503 while it lasts).
        let answer = eventually(Duration::from_secs(15), "a retry past the hold", || async {
            let answer = retry(&proxy, &w3, first, "acct", "p").await;
            (answer.0 != StatusCode::SERVICE_UNAVAILABLE).then_some(answer)
        })
        .await;
        assert_eq!(answer.1.as_deref(), Some("in_doubt"), "{answer:?}");
        answers.push((answer.0, answer.1));
    }
    assert_eq!(rail.times_paid("p"), 1, "{answers:?}");
}
