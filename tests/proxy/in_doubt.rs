//! A payment in doubt whose request reaches the rail late, over real processes: railguard
//! process A forwards through a relay that holds the request (a slow path), the answer is lost,
//! and the operator follows the in-doubt procedure (`admin::IN_DOUBT_PROCEDURE`) through
//! railguard B. One test per way the request can still land:
//!
//! - during A's graceful stop, with A still holding the connection: the rail's answer is A's
//!   late answer, stored as the record's — the retry gets it, the rail is paid once;
//! - after A exited: forget refuses until the record's in-doubt deadline plus
//!   `proxy.rail_transit_ms`, and the operator, asking the rail only after that, sees the
//!   payment and does not forget;
//! - after a middlebox reset A's connection while keeping the request: A's clean stop says
//!   nothing it sent can arrive before `proxy.rail_transit_ms` after the reset (`quiet_after`),
//!   forget refuses until then, and the operator sees the payment and does not forget.
//!
//! And with the rail's lookup by idempotency key configured on B (`[rail_lookup]`), B's retry
//! asks the rail itself: the rail has the payment — the retry gets its answer replayed, paid
//! once; it has not while A may still send it — still `409 in_doubt`; it has not, A stopped
//! cleanly and the transit time after A's last forward has passed — forgotten, and the next
//! retry is forwarded once; the lookup gets no answer — nothing changes.

use railguard_testkit as support;

use std::process::Output;
use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, Relay, eventually, init_tracing};
use tokio::time::Instant;

/// The network's longest transit in these tests (`proxy.rail_transit_ms`).
const TRANSIT: Duration = Duration::from_millis(4000);
const TRANSIT_MS: &str = "4000";

/// A's and B's settings: a short request deadline, and the test's transit time.
fn settings(grace_ms: &'static str) -> [(&'static str, &'static str); 3] {
    [
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "1000"),
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", TRANSIT_MS),
        ("RAILGUARD__SHUTDOWN__GRACE_MS", grace_ms),
    ]
}

/// A payment with idempotency key `key`, under token 5 of `account`, in a task of its own.
/// The body of every payment here.
const AMOUNT: &str = r#"{"amount":100}"#;

/// A slow path to `rail` that holds the request carrying `key` until released.
async fn slow_path_holding(rail: &Rail, key: &str) -> Relay {
    let relay = Relay::start(rail.addr).await;
    let key = key.as_bytes().to_vec();
    relay.stall_first(move |chunk| chunk.windows(key.len()).any(|w| w == key.as_slice()));
    relay
}

/// The rail simulator's lookup by idempotency key.
const LOOKUP: &str = "/payments?account={account}&idempotency_key={key}";

/// [`settings`], and the rail's lookup.
fn with_lookup(grace_ms: &'static str) -> Vec<(&'static str, &'static str)> {
    let mut env = settings(grace_ms).to_vec();
    env.push(("RAILGUARD__RAIL_LOOKUP__PATH", LOOKUP));
    env
}

/// Owner A (a `railguard serve` process whose path to the rail holds `key`'s request) and B
/// (in this process, straight to the rail), on one PostgreSQL: A's payment of `key` got 504
/// and its record is in doubt.
struct Stuck {
    pg: Pg,
    rail: Rail,
    slow_path: Relay,
    a: Railguard,
    b: Railguard,
    owner: i64,
}

/// [`Stuck`], A stopping within `grace_ms`.
async fn stuck_in_doubt(account: &str, key: &str, grace_ms: &'static str) -> Stuck {
    stuck_in_doubt_with(account, key, grace_ms, None, &settings("3000")).await
}

/// [`Stuck`], B reaching the rail at `b_upstream` (the rail itself if `None`) with `b_env`.
async fn stuck_in_doubt_with(
    account: &str,
    key: &str,
    grace_ms: &'static str,
    b_upstream: Option<&str>,
    b_env: &[(&str, &str)],
) -> Stuck {
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = slow_path_holding(&rail, key).await;
    let a = Railguard::start_process(&pg.url(), &slow_path.url(), &settings(grace_ms)).await;
    let b_upstream = b_upstream.map_or_else(|| rail.url(), str::to_string);
    let b = Railguard::start(&pg.url(), &b_upstream, b_env).await;
    let owner = a.instance().unwrap();
    let first = a
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    assert!(slow_path.has_stalled(), "the request is on the slow path");
    declared_in_doubt(&pg, key).await;
    Stuck {
        pg,
        rail,
        slow_path,
        a,
        b,
        owner,
    }
}

/// The record's state and stored status.
async fn record(pg: &Pg, key: &str) -> Option<(String, Option<i16>)> {
    pg.client()
        .await
        .query_opt(
            "SELECT state, status FROM idempotency_record WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .map(|row| (row.get(0), row.get(1)))
}

/// Waits until the owner has declared `key`'s record in doubt.
async fn declared_in_doubt(pg: &Pg, key: &str) {
    eventually(
        Duration::from_secs(5),
        format!("{key}'s record declared in doubt"),
        || async { (record(pg, key).await?.0 == "in_doubt").then_some(()) },
    )
    .await;
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `railguard idempotency-forget` through `rg`, with `--owner-stopped` if given.
async fn forget(rg: &Railguard, account: &str, key: &str, word: Option<i64>, dry: bool) -> Output {
    let word = word.map(|w| w.to_string());
    let mut more: Vec<&str> = Vec::new();
    if let Some(word) = &word {
        more.extend(["--owner-stopped", word]);
    }
    if dry {
        more.push("--dry-run");
    }
    rg.forget_with(account, key, &more).await
}

/// What the operator did at the end of the procedure.
#[derive(Debug, PartialEq, Eq)]
enum Resolution {
    /// The rail had the payment: no forget, no retry.
    LeftInDoubt,
    /// The rail did not have it: forgotten, and the retry may go.
    Forgotten,
}

/// The in-doubt procedure from step 2 on, as an operator follows it (the owner has stopped,
/// at `stopped_at`; `word`: its instance, when its stop is the operator's word): ask forget
/// with `--dry-run` until it would forget (it names the time until which it refuses), count
/// the transit time from the stop too when it rests on the operator's word, then — only then
/// — ask the rail, and forget only if the rail does not have the payment.
async fn follow_the_procedure(
    rg: &Railguard,
    rail: &Rail,
    account: &str,
    key: &str,
    word: Option<i64>,
    stopped_at: Instant,
) -> Resolution {
    eventually(
        Duration::from_secs(30),
        format!("idempotency-forget --dry-run of {key} on {account} allowed"),
        || async {
            let asked = forget(rg, account, key, word, true).await;
            if asked.status.success() {
                return Some(());
            }
            let why = stderr(&asked);
            assert!(
                why.contains("may still be on its way to the rail until"),
                "forget refused for another reason: {why}"
            );
            None
        },
    )
    .await;
    if word.is_some() {
        eventually(
            Duration::from_secs(30),
            "the transit time since the owner stopped",
            || async { (Instant::now() >= stopped_at + TRANSIT).then_some(()) },
        )
        .await;
    }
    if rail.times_paid(key) > 0 {
        return Resolution::LeftInDoubt;
    }
    let forgot = forget(rg, account, key, word, false).await;
    assert!(forgot.status.success(), "{}", stderr(&forgot));
    Resolution::Forgotten
}

/// The request lands while A drains on SIGTERM, and A receives the rail's answer then: the
/// record is completed with it, the retry through B gets it replayed, the rail is paid once.
#[tokio::test]
async fn a_request_that_lands_during_the_owners_graceful_stop_completes_its_record() {
    init_tracing();
    let (account, key) = ("acct-drain", "lands-in-drain");
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = slow_path_holding(&rail, key).await;
    let mut a = Railguard::start_process(&pg.url(), &slow_path.url(), &settings("10000")).await;
    let b = Railguard::start(&pg.url(), &rail.url(), &settings("3000")).await;

    let first = a.payment(account, 5).key(key).body(AMOUNT).spawn();
    eventually(
        Duration::from_secs(5),
        "the first forward held in the slow path",
        || async { slow_path.has_stalled().then_some(()) },
    )
    .await;
    let first = first.await.unwrap();
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    declared_in_doubt(&pg, key).await;

    // Step 1: the operator stops A. It drains, waiting for the forward still on its way.
    let log = a.log_path();
    let stopping = tokio::spawn(async move {
        let status = a.stop().await;
        (a, status)
    });
    eventually(
        Duration::from_secs(5),
        "A's log saying it waits for forwards still on their way",
        || async {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("waiting for the rail's answers to forwards still on their way")
                .then_some(())
        },
    )
    .await;
    // The request lands now, during the drain; the rail's 201 comes back to A.
    slow_path.release_stalled();
    let (a, status) = stopping.await.unwrap();
    assert!(status.success(), "{status}\n{}", a.log());
    assert_eq!(rail.times_paid(key), 1, "the request reached the rail");
    assert_eq!(
        record(&pg, key).await,
        Some(("done".to_string(), Some(201))),
        "the late answer is the record's: {}",
        a.log()
    );

    // Step 2: there is nothing to forget.
    let asked = forget(&b, account, key, None, true).await;
    assert!(!asked.status.success());
    assert!(
        stderr(&asked).contains("completed: the record is complete"),
        "{}",
        stderr(&asked)
    );
    // The worker's retry through B gets the rail's answer; the rail is not paid again.
    let retry = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    retry.assert_status(StatusCode::CREATED);
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!(rail.times_paid(key), 1, "paid once");
}

/// The request lands after A exited (its stop gave up on the forward, so it recorded no clean
/// stop): forget on the operator's word is refused until the record's in-doubt deadline plus
/// `proxy.rail_transit_ms`, naming that time; the operator, asking the rail only after it,
/// finds the payment and does not forget, and the retry is never forwarded.
#[tokio::test]
async fn a_request_that_lands_after_the_owner_exited_is_never_paid_twice() {
    init_tracing();
    let (account, key) = ("acct-exited", "lands-after-exit");
    let stuck = stuck_in_doubt(account, key, "500").await;
    let Stuck {
        pg,
        rail,
        slow_path,
        mut a,
        b,
        owner,
    } = stuck;

    // Step 1: A stops; its grace runs out with the forward still out, so it records no clean
    // stop, and forget asks for the operator's word.
    let status = a.stop().await;
    let stopped_at = Instant::now();
    assert!(status.success(), "{status}");
    let unknown = forget(&b, account, key, None, false).await;
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("owner_not_seen_stopping: ")
            && stderr(&unknown).contains(&format!("instance {owner}")),
        "{}",
        stderr(&unknown)
    );
    // On the word, forget is refused while the request may still be on its way, and names
    // until when: the in-doubt deadline plus the transit time.
    let until: String = pg
        .client()
        .await
        .query_one(
            "SELECT to_char((in_doubt_at + $2::bigint * interval '1 millisecond')
                            AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US\"Z\"')
             FROM idempotency_record WHERE idempotency_key = $1",
            &[&key, &(TRANSIT.as_millis() as i64)],
        )
        .await
        .unwrap()
        .get(0);
    for dry in [false, true] {
        let early = forget(&b, account, key, Some(owner), dry).await;
        assert!(!early.status.success(), "dry run {dry}: refused");
        let why = stderr(&early);
        assert!(
            why.contains(&format!(
                "may still be on its way to the rail until {until}"
            )),
            "{why}"
        );
        assert!(why.contains("409 Conflict may_still_arrive: "), "{why}");
        assert!(
            why.contains("What to do: docs/operations.md#may_still_arrive"),
            "{why}"
        );
    }
    assert_eq!(
        record(&pg, key).await.unwrap().0,
        "in_doubt",
        "nothing forgotten"
    );

    // The request lands now, after A exited and within the transit time.
    assert_eq!(rail.times_paid(key), 0);
    slow_path.release_stalled();
    eventually(
        Duration::from_secs(5),
        format!("{key} paid once at the rail"),
        || async { (rail.times_paid(key) == 1).then_some(()) },
    )
    .await;

    let resolution = follow_the_procedure(&b, &rail, account, key, Some(owner), stopped_at).await;
    assert_eq!(
        resolution,
        Resolution::LeftInDoubt,
        "the rail has the payment"
    );
    // A retry (a worker that did not wait for the operator) is refused, never forwarded.
    let retry = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    retry.assert_status(StatusCode::CONFLICT);
    assert_eq!(retry.json()["error"], "in_doubt");
    assert_eq!(rail.times_paid(key), 1, "paid once");
}

/// A middlebox resets A's connection to the rail after the request's in-doubt deadline, and
/// still delivers the request later. A's graceful stop is clean (nothing outstanding), but its
/// record says nothing A sent can arrive before `proxy.rail_transit_ms` after the reset; forget
/// is refused until then, naming that time; the operator finds the payment and does not forget.
#[tokio::test]
async fn a_request_delivered_after_its_connection_was_reset_is_never_paid_twice() {
    init_tracing();
    let (account, key) = ("acct-reset", "delivered-after-reset");
    let stuck = stuck_in_doubt(account, key, "3000").await;
    let Stuck {
        pg,
        rail,
        slow_path,
        mut a,
        b,
        owner,
    } = stuck;
    // Well past the record's in-doubt deadline, the middlebox resets A's connection; it keeps
    // the request. Step 1: A stops cleanly (nothing is outstanding any more), and records when
    // nothing it sent can still arrive: the transit time after the reset, past the record's own
    // time.
    let stopped_at = reset_then_stop(&pg, &slow_path, &mut a, key, 2).await;
    let stop = pg
        .client()
        .await
        .query_one(
            "SELECT to_char((s.outcome->>'quiet_after')::timestamptz AT TIME ZONE 'UTC',
                            'YYYY-MM-DD HH24:MI:SS.US\"Z\"'),
                    (s.outcome->>'quiet_after')::timestamptz
                        > s.finished_at + $2::bigint * interval '1 millisecond' - interval '1 s',
                    (s.outcome->>'quiet_after')::timestamptz
                        > r.in_doubt_at + $2::bigint * interval '1 millisecond'
             FROM railguard_audit s, idempotency_record r
             WHERE s.action = 'instance_stopped' AND (s.outcome->>'instance')::bigint = $1
               AND r.idempotency_key = $3",
            &[&owner, &(TRANSIT.as_millis() as i64), &key],
        )
        .await
        .unwrap();
    let (quiet_after, after_transit, after_record): (Option<String>, Option<bool>, Option<bool>) =
        (stop.get(0), stop.get(1), stop.get(2));
    assert!(
        after_transit == Some(true) && after_record == Some(true),
        "the clean stop's quiet_after ({quiet_after:?}) is the transit time after the reset, \
         not the stop itself\n{}",
        a.log()
    );
    let quiet_after = quiet_after.unwrap();
    // Forget is refused until then, though the owner stopped cleanly.
    let early = forget(&b, account, key, None, false).await;
    assert!(!early.status.success(), "refused before quiet_after");
    let why = stderr(&early);
    assert!(
        why.contains(&format!(
            "may still be on its way to the rail until {quiet_after}"
        )) && why.contains("recorded a clean stop"),
        "{why}"
    );
    assert_eq!(record(&pg, key).await.unwrap().0, "in_doubt");

    // The middlebox delivers the request now, within the transit time.
    assert_eq!(rail.times_paid(key), 0);
    slow_path.release_stalled();
    eventually(
        Duration::from_secs(5),
        format!("{key} paid once at the rail"),
        || async { (rail.times_paid(key) == 1).then_some(()) },
    )
    .await;

    let resolution = follow_the_procedure(&b, &rail, account, key, None, stopped_at).await;
    assert_eq!(
        resolution,
        Resolution::LeftInDoubt,
        "the rail has the payment"
    );
    let retry = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    retry.assert_status(StatusCode::CONFLICT);
    assert_eq!(retry.json()["error"], "in_doubt");
    assert_eq!(rail.times_paid(key), 1, "paid once");
}

/// Waits until the record of `key` is `secs` past its in-doubt deadline.
async fn past_its_deadline(pg: &Pg, key: &str, secs: i64) {
    eventually(
        Duration::from_secs(15),
        format!("{key}'s record {secs} s past its in-doubt deadline"),
        || async {
            pg.client()
                .await
                .query_one(
                    "SELECT now() > in_doubt_at + $2::bigint * interval '1 second'
                 FROM idempotency_record WHERE idempotency_key = $1",
                    &[&key, &secs],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
                .then_some(())
        },
    )
    .await;
}

/// A cut off from the rail and stopped: once `key`'s record is `secs` past its in-doubt
/// deadline, the middlebox on `slow_path` resets A's connection (keeping the request it holds);
/// once A's log says the forward left by its caller ended, A stops and must exit successfully.
/// Returns when A had stopped.
async fn reset_then_stop(
    pg: &Pg,
    slow_path: &Relay,
    a: &mut Railguard,
    key: &str,
    secs: i64,
) -> Instant {
    past_its_deadline(pg, key, secs).await;
    slow_path.reset_sources();
    eventually(
        Duration::from_secs(5),
        "A's log saying a forward left by its caller ended",
        || async {
            a.log()
                .contains("a forward left by its caller ended")
                .then_some(())
        },
    )
    .await;
    let status = a.stop().await;
    let stopped_at = Instant::now();
    assert!(status.success(), "{status}\n{}", a.log());
    stopped_at
}

/// The audit records of `action` for `key`: their reasons.
async fn audited(pg: &Pg, action: &str, key: &str) -> Vec<String> {
    pg.client()
        .await
        .query(
            "SELECT reason FROM railguard_audit
             WHERE action = $1 AND outcome->>'idempotency_key' = $2 ORDER BY id",
            &[&action, &key],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// `railguard_in_doubt_resolved_total{outcome}` at `rg`.
async fn resolved(rg: &Railguard, outcome: &str) -> f64 {
    rg.metrics().await.get(&format!(
        "railguard_in_doubt_resolved_total{{outcome=\"{outcome}\"}}"
    ))
}

/// [`Stuck`] with the rail's lookup on B, and A stopped cleanly after a middlebox reset its
/// connection past the record's in-doubt deadline, keeping the request (it is never delivered):
/// nothing A sent can arrive after its clean stop's `quiet_after`, which is returned (UTC).
async fn stopped_cleanly_with_the_request_held(
    account: &str,
    key: &str,
    b_upstream: Option<&str>,
) -> (Stuck, String) {
    let mut stuck =
        stuck_in_doubt_with(account, key, "3000", b_upstream, &with_lookup("3000")).await;
    reset_then_stop(&stuck.pg, &stuck.slow_path, &mut stuck.a, key, 2).await;
    let quiet_after: String = stuck
        .pg
        .one(
            "SELECT to_char((outcome->>'quiet_after')::timestamptz AT TIME ZONE 'UTC',
                            'YYYY-MM-DD HH24:MI:SS.US\"Z\"')
             FROM railguard_audit
             WHERE action = 'instance_stopped' AND (outcome->>'instance')::bigint = $1",
            &[&stuck.owner],
        )
        .await;
    (stuck, quiet_after)
}

/// The request reached the rail after A exited without a clean stop, and A never heard the
/// answer. B's retry asks the rail, which has the payment: the record is completed with the
/// rail's answer (audited), the retry gets it replayed, and later retries get it from the
/// record — the rail is paid once.
#[tokio::test]
async fn a_retry_gets_the_rails_answer_when_the_rail_has_the_payment_in_doubt() {
    init_tracing();
    let (account, key) = ("acct-found", "found-on-the-rail");
    let Stuck {
        pg,
        rail,
        slow_path,
        mut a,
        b,
        ..
    } = stuck_in_doubt_with(account, key, "500", None, &with_lookup("3000")).await;
    let status = a.stop().await;
    assert!(status.success(), "{status}");
    slow_path.release_stalled();
    eventually(
        Duration::from_secs(5),
        format!("{key} paid once at the rail"),
        || async { (rail.times_paid(key) == 1).then_some(()) },
    )
    .await;
    assert_eq!(
        record(&pg, key).await.unwrap().0,
        "in_doubt",
        "A never heard"
    );

    // Another request under the key asks the rail too, and is still refused as another request.
    let other = b
        .http()
        .pay(
            &b.proxy_url("/payments"),
            &[
                ("Fencing-Token", "5"),
                ("Fencing-Account", account),
                ("Idempotency-Key", key),
            ],
            r#"{"amount":999}"#,
        )
        .await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        other.body
    );
    assert_eq!(record(&pg, key).await.unwrap().0, "done", "asked the rail");

    for attempt in 0..2 {
        let retry = b
            .payment(account, 5)
            .key(key)
            .body(AMOUNT)
            .spawn()
            .await
            .unwrap();
        assert_eq!(retry.status, StatusCode::OK, "{attempt}: {}", retry.body);
        assert_eq!(retry.headers["idempotency-replayed"], "true");
        assert_eq!(
            retry.json()["payment"],
            1,
            "the rail's answer: {}",
            retry.body
        );
    }
    assert_eq!(rail.times_paid(key), 1, "paid once");
    assert_eq!(
        record(&pg, key).await,
        Some(("done".to_string(), Some(200))),
        "the rail's answer is the record's"
    );
    let audit = audited(&pg, "idempotency_resolve", key).await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert!(audit[0].contains("found the payment"), "{audit:?}");
    assert_eq!(
        resolved(&b, "paid").await,
        1.0,
        "the second retry is the record's"
    );
}

/// A's forward is still held on its way to the rail and A is running: B's retries, well past
/// the record's in-doubt deadline plus the transit time, find no payment on the rail and still
/// get `409 in_doubt` — nothing forwarded. The request then lands, and the rail is paid once.
#[tokio::test]
async fn a_payment_the_rail_does_not_have_stays_in_doubt_while_its_owner_runs() {
    init_tracing();
    let (account, key) = ("acct-owner-runs", "owner-still-runs");
    let Stuck {
        pg,
        rail,
        slow_path,
        a,
        b,
        ..
    } = stuck_in_doubt_with(account, key, "3000", None, &with_lookup("3000")).await;
    past_its_deadline(&pg, key, (TRANSIT.as_secs() + 1) as i64).await;

    for attempt in 0..2 {
        let retry = b
            .payment(account, 5)
            .key(key)
            .body(AMOUNT)
            .spawn()
            .await
            .unwrap();
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "{attempt}: {}",
            retry.body
        );
        assert_eq!(retry.json()["error"], "in_doubt");
    }
    assert_eq!(rail.times_paid(key), 0, "nothing forwarded");
    assert_eq!(record(&pg, key).await.unwrap().0, "in_doubt");
    assert!(audited(&pg, "idempotency_forget", key).await.is_empty());
    assert_eq!(resolved(&b, "unresolved").await, 2.0);

    // The held request lands; A hears the rail's answer and stores it.
    slow_path.release_stalled();
    eventually(
        Duration::from_secs(5),
        format!("{key}'s record done"),
        || async { (record(&pg, key).await?.0 == "done").then_some(()) },
    )
    .await;
    let retry = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    assert_eq!(rail.times_paid(key), 1, "paid once\n{}", a.log());
}

/// A stopped cleanly; the request it wrote never reaches the rail. Before the clean stop's
/// `quiet_after`, B's retry finds no payment and stays `409 in_doubt`; after it, the retry
/// finds none, the record is forgotten (audited) and the retry is told so, and the next retry
/// is forwarded — once.
#[tokio::test]
async fn a_payment_the_rail_does_not_have_is_forgotten_once_nothing_sent_can_arrive() {
    init_tracing();
    let (account, key) = ("acct-not-found", "not-on-the-rail");
    // The slow path is kept: dropped, it would deliver the request it holds.
    let (
        Stuck {
            pg,
            rail,
            slow_path: _held,
            b,
            ..
        },
        quiet_after,
    ) = stopped_cleanly_with_the_request_held(account, key, None).await;

    let early = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    assert_eq!(early.status, StatusCode::CONFLICT, "{}", early.body);
    assert_eq!(
        early.json()["error"],
        "in_doubt",
        "before {quiet_after}: {}",
        early.body
    );
    assert_eq!(record(&pg, key).await.unwrap().0, "in_doubt");

    let told = eventually(
        Duration::from_secs(20),
        "a retry answered other than in_doubt",
        || async {
            let retry = b
                .payment(account, 5)
                .key(key)
                .body(AMOUNT)
                .spawn()
                .await
                .unwrap();
            (retry.json()["error"] != "in_doubt").then_some(retry)
        },
    )
    .await;
    assert_eq!(told.status, StatusCode::CONFLICT, "{}", told.body);
    assert_eq!(told.json()["error"], "not_on_the_rail", "{}", told.body);
    assert_eq!(rail.times_paid(key), 0, "that retry was not forwarded");
    assert_eq!(record(&pg, key).await, None, "forgotten");
    let audit = audited(&pg, "idempotency_forget", key).await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert!(audit[0].contains("rail's lookup"), "{audit:?}");

    // B's forward waits first for A's last row to settle (`store::handover`): until then a
    // retry is told so, and nothing is sent.
    let forwarded = eventually(
        Duration::from_secs(20),
        "a retry forwarded once the owner's last row settled",
        || async {
            let retry = b
                .payment(account, 5)
                .key(key)
                .body(AMOUNT)
                .spawn()
                .await
                .unwrap();
            let waited = retry.status == StatusCode::GATEWAY_TIMEOUT
                && retry.body.contains("this request was not sent");
            (!waited).then_some(retry)
        },
    )
    .await;
    assert_eq!(forwarded.status, StatusCode::CREATED, "{}", forwarded.body);
    assert!(!forwarded.headers.contains_key("idempotency-replayed"));
    let again = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    assert_eq!(again.headers["idempotency-replayed"], "true");
    assert_eq!(rail.times_paid(key), 1, "forwarded once");
    assert_eq!(resolved(&b, "not_paid").await, 1.0);
}

/// The same as above, but B's lookup gets no answer (nothing listens where B reaches the rail):
/// once `idempotency-forget` would forget the record, the retry still changes nothing — `409
/// in_doubt`, the record kept.
#[tokio::test]
async fn a_lookup_that_gets_no_answer_changes_nothing() {
    init_tracing();
    let (account, key) = ("acct-lookup-down", "lookup-down");
    // A claimed port: nothing listens there, and no other test's pick takes it meanwhile.
    let nothing_there = format!("http://127.0.0.1:{}", support::free_loopback_port());
    // The slow path is kept: dropped, it would deliver the request it holds.
    let (
        Stuck {
            pg,
            rail,
            slow_path: _held,
            b,
            ..
        },
        quiet_after,
    ) = stopped_cleanly_with_the_request_held(account, key, Some(&nothing_there)).await;
    // Wait until the operator's forget would forget it.
    eventually(
        Duration::from_secs(20),
        "forget would forget the record",
        || async {
            forget(&b, account, key, None, true)
                .await
                .status
                .success()
                .then_some(())
        },
    )
    .await;

    for attempt in 0..2 {
        let retry = b
            .payment(account, 5)
            .key(key)
            .body(AMOUNT)
            .spawn()
            .await
            .unwrap();
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "{attempt} after {quiet_after}: {}",
            retry.body
        );
        assert_eq!(retry.json()["error"], "in_doubt", "{}", retry.body);
    }
    assert_eq!(record(&pg, key).await.unwrap().0, "in_doubt", "kept");
    assert!(audited(&pg, "idempotency_forget", key).await.is_empty());
    assert_eq!(rail.times_paid(key), 0);
    assert_eq!(resolved(&b, "failed").await, 2.0);
}

/// A "not found" the rail gave while A's request could still land is never acted on, even when
/// it reaches B after the record's quiet time: B asks only after deciding, by the database's
/// clock, that forget would forget the record. Here B's path to the rail takes 2 s each way;
/// the lookup leaves 3.5 s before the quiet time, the rail answers 404 1.5 s before it, A's
/// request lands 0.8 s before it, and B hears the 404 after it. The record stays in doubt, the
/// next lookup finds the payment, and the rail is paid once.
#[tokio::test]
async fn a_not_found_given_while_the_request_could_still_land_is_never_acted_on() {
    init_tracing();
    let (account, key) = ("acct-stale-404", "stale-not-found");
    let transit = Duration::from_secs(6);
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = slow_path_holding(&rail, key).await;
    let b_path = Relay::start(rail.addr).await;
    let a_env = [
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "1000"),
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "6000"),
        ("RAILGUARD__SHUTDOWN__GRACE_MS", "3000"),
    ];
    let mut a = Railguard::start_process(&pg.url(), &slow_path.url(), &a_env).await;
    let b_env = [
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000"),
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "6000"),
        ("RAILGUARD__RAIL_LOOKUP__PATH", LOOKUP),
        ("RAILGUARD__RAIL_LOOKUP__TIMEOUT_MS", "10000"),
    ];
    let b = Railguard::start(&pg.url(), &b_path.url(), &b_env).await;
    let first = a
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    first.assert_status(StatusCode::GATEWAY_TIMEOUT);
    declared_in_doubt(&pg, key).await;
    // The rail closes a connection whose request head has not arrived within 10 s: the
    // whole scene stays within that of A's first byte.
    reset_then_stop(&pg, &slow_path, &mut a, key, 0).await;
    // How long until forget would forget the record: the later of its in-doubt deadline plus
    // the transit time and A's clean stop's `quiet_after`.
    let until_quiet: f64 = pg
        .client()
        .await
        .query_one(
            "SELECT extract(epoch FROM GREATEST(
                        r.in_doubt_at + $2::bigint * interval '1 millisecond',
                        (SELECT max((outcome->>'quiet_after')::timestamptz) FROM railguard_audit
                         WHERE action = 'instance_stopped')) - now())::float8 * 1000
             FROM idempotency_record r WHERE idempotency_key = $1",
            &[&key, &(transit.as_millis() as i64)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        until_quiet > 3600.0,
        "the scene needs 3.6 s before the quiet time; {until_quiet} ms were left"
    );
    let quiet = Instant::now() + Duration::from_millis(until_quiet as u64);
    b_path.set_delay(Duration::from_millis(2000));
    tokio::time::sleep_until(quiet - Duration::from_millis(3500)).await;
    let retry = b.payment(account, 5).key(key).body(AMOUNT).spawn();
    tokio::time::sleep_until(quiet - Duration::from_millis(800)).await;
    slow_path.release_stalled();
    rail.until_paid(1).await;
    let retry = retry.await.unwrap();
    retry.assert_status(StatusCode::CONFLICT);
    assert_eq!(retry.json()["error"], "in_doubt", "{}", retry.body);
    assert_eq!(record(&pg, key).await.unwrap().0, "in_doubt", "kept");
    assert!(audited(&pg, "idempotency_forget", key).await.is_empty());

    b_path.set_delay(Duration::ZERO);
    let found = b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    found.assert_status(StatusCode::OK);
    assert_eq!(found.headers["idempotency-replayed"], "true");
    assert_eq!(rail.times_paid(key), 1, "paid once");
}

/// Only an answer that names the key it looked up is one: with a lookup path the rail does not
/// serve (its `404` names no key, as a gateway's or an authentication layer's would not), a
/// record whose payment the rail has is never forgotten, however long after the quiet time.
#[tokio::test]
async fn a_not_found_that_names_no_key_forgets_nothing() {
    init_tracing();
    let (account, key) = ("acct-wrong-path", "wrong-path");
    let mut b_env = settings("3000").to_vec();
    b_env.push((
        "RAILGUARD__RAIL_LOOKUP__PATH",
        "/payment?account={account}&idempotency_key={key}",
    ));
    let mut stuck = stuck_in_doubt_with(account, key, "3000", None, &b_env).await;
    reset_then_stop(&stuck.pg, &stuck.slow_path, &mut stuck.a, key, 2).await;
    // The request A wrote lands within the transit time: the rail has the payment.
    stuck.slow_path.release_stalled();
    stuck.rail.until_paid(1).await;
    let (pg, rail, b) = (&stuck.pg, &stuck.rail, &stuck.b);
    eventually(
        Duration::from_secs(20),
        "forget would forget the record",
        || async {
            forget(b, account, key, None, true)
                .await
                .status
                .success()
                .then_some(())
        },
    )
    .await;
    for attempt in 0..2 {
        let retry = b
            .payment(account, 5)
            .key(key)
            .body(AMOUNT)
            .spawn()
            .await
            .unwrap();
        retry.assert_status(StatusCode::CONFLICT);
        assert_eq!(
            retry.json()["error"],
            "in_doubt",
            "{attempt}: {}",
            retry.body
        );
    }
    assert_eq!(record(pg, key).await.unwrap().0, "in_doubt", "kept");
    assert!(audited(pg, "idempotency_forget", key).await.is_empty());
    assert_eq!(rail.times_paid(key), 1, "paid once");
    assert_eq!(resolved(b, "failed").await, 2.0);
}

/// And a `200` that names no key (here the rail's ledger, a listing) is not the payment's
/// answer: the record stays in doubt, nothing is replayed.
#[tokio::test]
async fn a_found_that_names_no_key_completes_nothing() {
    init_tracing();
    let (account, key) = ("acct-wrong-200", "wrong-200");
    let mut b_env = settings("3000").to_vec();
    b_env.push((
        "RAILGUARD__RAIL_LOOKUP__PATH",
        "/ledger?account={account}&idempotency_key={key}",
    ));
    let stuck = stuck_in_doubt_with(account, key, "3000", None, &b_env).await;
    let retry = stuck
        .b
        .payment(account, 5)
        .key(key)
        .body(AMOUNT)
        .spawn()
        .await
        .unwrap();
    retry.assert_status(StatusCode::CONFLICT);
    assert_eq!(retry.json()["error"], "in_doubt", "{}", retry.body);
    assert!(!retry.headers.contains_key("idempotency-replayed"));
    assert_eq!(record(&stuck.pg, key).await.unwrap().0, "in_doubt");
    assert_eq!(stuck.rail.times_paid(key), 0);
    assert_eq!(resolved(&stuck.b, "failed").await, 1.0);
}
