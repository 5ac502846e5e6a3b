//! A statement stalled on a database connection that stays open (a stopped backend, a network
//! path holding one flow) holds up nothing else (`store::batch::slots`): with one statement in flight
//! per batcher, the requests behind a stalled compare-and-set, last look or completion are
//! still answered, the stall is counted in `railguard_db_statements_stalled`, and the stalled
//! request's own answer stays true — it never reaches the rail unless it says it may have. A
//! graceful stop waits for stalled statements, and the work behind them, within its one grace,
//! and records a clean stop only once none is out.
//!
//! The stall is a relay in front of PostgreSQL that holds one connection's traffic from the
//! chosen statement on ([`Relay::stall_first`]); every other connection carries on.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::relay::Relay;
use support::{Http, Pg, Rail, Railguard, Reply, eventually, init_tracing, until};

/// The account whose statement stalls.
const STALLED: &str = "acct-stalled";

/// The test harness's `database.timeout_ms`.
const DATABASE_TIMEOUT: Duration = Duration::from_secs(1);

struct Setup {
    pg: Pg,
    rail: Rail,
    relay: Relay,
    rg: Railguard,
    http: Http,
}

/// railguard with one statement in flight per batcher (the setting a stall hurts most),
/// reaching PostgreSQL through a relay that can stall a connection.
async fn setup() -> Setup {
    setup_as(false).await
}

/// [`setup`], with railguard in this process or (`process`) as a `railguard serve` process.
async fn setup_as(process: bool) -> Setup {
    init_tracing();
    setup_of(process, Rail::start().await, &[]).await
}

/// [`setup`] in front of `rail`, with `database.timeout_ms` at `timeout`.
async fn setup_with_rail(rail: Rail, timeout: Duration) -> Setup {
    init_tracing();
    let timeout = timeout.as_millis().to_string();
    setup_of(
        false,
        rail,
        &[("RAILGUARD__DATABASE__TIMEOUT_MS", &timeout)],
    )
    .await
}

async fn setup_of(process: bool, rail: Rail, more: &[(&str, &str)]) -> Setup {
    let pg = Pg::start().await;
    let relay = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    let url = relay.postgres_url(&pg.url());
    let mut env = vec![("RAILGUARD__FENCING__BATCH_CONCURRENCY", "1")];
    env.extend_from_slice(more);
    let rg = if process {
        Railguard::start_process(&url, &rail.url(), &env).await
    } else {
        Railguard::start(&url, &rail.url(), &env).await
    };
    Setup {
        pg,
        rail,
        relay,
        rg,
        http: Http::new(),
    }
}

impl Setup {
    /// A payment under token 1, the account's first grant.
    async fn pay(&self, account: &str, key: Option<&str>) -> Reply {
        self.spawn_pay(account, key).await.unwrap()
    }

    fn spawn_pay(&self, account: &str, key: Option<&str>) -> tokio::task::JoinHandle<Reply> {
        let payment = self.rg.payment(account, 1);
        match key {
            Some(key) => payment.key(key).spawn(),
            None => payment.spawn(),
        }
    }

    /// Stalls the connection of the `nth` chunk (from 1) sent to PostgreSQL that names
    /// `needle`: a request's statements name its account (and key) in their parameters, in
    /// the order compare-and-set, last look, completion.
    fn stall_nth(&self, needle: &'static str, nth: usize) {
        let mut seen = 0;
        self.relay.stall_first(move |chunk| {
            if chunk.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                seen += 1;
            }
            seen == nth
        });
    }

    async fn until_stalled(&self) {
        let stalled = || async { self.relay.has_stalled() };
        until(Duration::from_secs(2), "a statement stalled", stalled).await
    }

    async fn stalled(&self, statement: &str) -> f64 {
        self.rg.metrics().await.get(&format!(
            "railguard_db_statements_stalled{{statement=\"{statement}\"}}"
        ))
    }

    /// While the stall lasts (well past the database timeout of 1 s), payments for other
    /// accounts are answered — with an idempotency key, so every batcher is on their path —
    /// without waiting out the database timeout behind the stalled statement (where a
    /// completion would be handed to the background retry and answered a second late), and
    /// each answer is stored before it is heard: a repeat right after it is a replay.
    async fn others_are_answered(&self, round: &str) {
        let until = tokio::time::Instant::now() + Duration::from_millis(2500);
        let mut paid = 0;
        while tokio::time::Instant::now() < until {
            paid += 1;
            let account = format!("acct-{round}-{paid}");
            let key = format!("key-{round}-{paid}");
            let sent = tokio::time::Instant::now();
            let reply = self.pay(&account, Some(&key)).await;
            assert!(
                sent.elapsed() < DATABASE_TIMEOUT,
                "payment {paid} waited {:?}, out the database timeout",
                sent.elapsed()
            );
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "payment {paid} while a statement stalls: {}",
                reply.body
            );
            let repeat = self.pay(&account, Some(&key)).await;
            assert_eq!(
                (repeat.status, repeat.headers.get("idempotency-replayed")),
                (StatusCode::CREATED, Some(&"true".parse().unwrap())),
                "payment {paid}'s answer was heard before it was stored: {}",
                repeat.body
            );
        }
        assert!(paid >= 3, "only {paid} payments in 2.5 s");
    }

    /// The stalled account's payment under `key`, repeated until it is answered 201 (a key
    /// whose statement has just answered may still be in flight for a moment).
    async fn created_soon(&self, key: &str) -> Reply {
        eventually(
            Duration::from_secs(5),
            format!("{key} answered 201"),
            || async {
                let reply = self.pay(STALLED, Some(key)).await;
                (reply.status == StatusCode::CREATED).then_some(reply)
            },
        )
        .await
    }

    /// Stops (SIGSTOP) railguard's backend that waits for a lock in a statement starting
    /// with `statement`, once there is one; returns its pid.
    async fn stop_backend_waiting(&self, statement: &str) -> u32 {
        let client = self.pg.client().await;
        let waits = format!("a railguard statement starting with {statement:?} waiting for a lock");
        let backend = eventually(Duration::from_secs(3), waits, || async {
            let row = client
                .query_opt(
                    "SELECT pid FROM pg_stat_activity
                     WHERE application_name = 'railguard' AND wait_event_type = 'Lock'
                       AND starts_with(query, $1)",
                    &[&statement],
                )
                .await
                .unwrap();
            row.map(|row| row.get::<_, i32>(0) as u32)
        })
        .await;
        self.pg.pause_backend(backend).await;
        backend
    }

    /// The stalled account's worker keeps paying (with `key(n)` on its n-th try) while four
    /// others pay, so that its requests meet theirs in batches; its answers.
    async fn retried_while_others_pay(&self, key: fn(usize) -> String) -> Vec<StatusCode> {
        let retries = {
            let (http, url, proof) = (
                self.http.clone(),
                self.rg.proxy_url("/payments"),
                self.rg.proof(STALLED, 1),
            );
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let until = tokio::time::Instant::now() + Duration::from_millis(2500);
                while tokio::time::Instant::now() < until {
                    let key = key(statuses.len());
                    let headers = [
                        ("Fencing-Token", "1"),
                        ("Fencing-Account", STALLED),
                        ("Fencing-Proof", proof.as_str()),
                        ("Idempotency-Key", key.as_str()),
                    ];
                    statuses.push(http.pay(&url, &headers, "{\"amount\":1}").await.status);
                }
                statuses
            })
        };
        tokio::join!(
            self.others_are_answered("locked-1"),
            self.others_are_answered("locked-2"),
            self.others_are_answered("locked-3"),
            self.others_are_answered("locked-4"),
        );
        retries.await.unwrap()
    }

    /// The stalled request's answer: 503, and nothing reached the rail.
    async fn refused_unpaid(&self, stalled: tokio::task::JoinHandle<Reply>) {
        refused_unpaid(&self.rail, stalled).await;
    }

    fn paid_to(&self, account: &str) -> usize {
        paid_to(&self.rail, account)
    }

    /// A retry of the stalled account's payment keyed `key` is paid (201), and the rail has
    /// paid that account once.
    async fn retry_pays_once(&self, key: &str) {
        let retried = self.pay(STALLED, Some(key)).await;
        retried.assert_status(StatusCode::CREATED);
        assert_eq!(self.paid_to(STALLED), 1, "paid once");
    }

    async fn until_nothing_stalls(&self) {
        until(
            Duration::from_secs(3),
            "released statements no longer counted as stalled",
            || async {
                let m = self.rg.metrics().await;
                let stalled: f64 = ["fence", "completion", "look"]
                    .iter()
                    .map(|s| {
                        m.get(&format!(
                            "railguard_db_statements_stalled{{statement=\"{s}\"}}"
                        ))
                    })
                    .sum();
                stalled == 0.0
            },
        )
        .await
    }
}

/// The stalled request's answer: 503, and nothing reached the rail.
async fn refused_unpaid(rail: &Rail, stalled: tokio::task::JoinHandle<Reply>) {
    let refused = stalled.await.unwrap();
    refused.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        paid_to(rail, STALLED),
        0,
        "a refused request reached the rail"
    );
}

fn paid_to(rail: &Rail, account: &str) -> usize {
    rail.ledger()
        .iter()
        .filter(|e| e.account.as_deref() == Some(account))
        .count()
}

#[tokio::test]
async fn a_stalled_compare_and_set_holds_up_no_other_request() {
    let s = setup().await;
    s.stall_nth(STALLED, 1);
    let stalled = s.spawn_pay(STALLED, Some("key-stalled"));
    s.until_stalled().await;
    s.others_are_answered("fence").await;
    assert_eq!(s.stalled("fence").await, 1.0);
    // The stalled request gave up on its verdict: it was refused and never forwarded.
    s.refused_unpaid(stalled).await;
    // Let the statement go: it commits, and its record — which nobody was told about — goes.
    s.relay.release_stalled();
    s.until_nothing_stalls().await;
    s.retry_pays_once("key-stalled").await;
}

#[tokio::test]
async fn a_stalled_last_look_holds_up_no_other_request() {
    let s = setup().await;
    // Without a key: the compare-and-set names the account first, the last look second.
    s.stall_nth(STALLED, 2);
    let stalled = s.spawn_pay(STALLED, None);
    s.until_stalled().await;
    s.others_are_answered("look").await;
    assert_eq!(s.stalled("look").await, 1.0);
    s.refused_unpaid(stalled).await; // no forward without its last look
    s.relay.release_stalled();
    s.until_nothing_stalls().await;
}

#[tokio::test]
async fn a_stalled_completion_holds_up_no_other_request() {
    let s = setup().await;
    // The key is named by the compare-and-set that creates the record, then by its completion.
    s.stall_nth("key-stalled-completion", 2);
    let answered = s.pay(STALLED, Some("key-stalled-completion")).await;
    // The rail's answer reaches the client even though it could not be stored in time.
    answered.assert_status(StatusCode::CREATED);
    assert!(s.relay.has_stalled());
    s.others_are_answered("completion").await;
    assert_eq!(s.stalled("completion").await, 1.0);
    // A repeat meanwhile is not forwarded again: it waits for the stalled completion, which
    // may hold its record's row (store::batch::held), and is refused when its time is up.
    let repeat = s.pay(STALLED, Some("key-stalled-completion")).await;
    repeat.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(s.paid_to(STALLED), 1);
    s.relay.release_stalled();
    s.until_nothing_stalls().await;
    // Once stored, the answer is replayed.
    let replayed = s.created_soon("key-stalled-completion").await;
    assert_eq!(replayed.body, answered.body);
    assert_eq!(s.paid_to(STALLED), 1, "paid once");
}

#[tokio::test]
async fn a_backend_stopped_holding_an_accounts_row_holds_up_that_account_only() {
    let s = setup().await;
    // The record the stalled request will make is being made by someone else: its statement
    // locks the account's mark row, then waits for that record's row.
    let mut blocker = s.pg.client().await;
    let tx = blocker.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO idempotency_record
             (account_id, idempotency_key, fingerprint, token, owner, state)
         VALUES ($1, 'key-stalled', 'f', 1, 'blocker', 'in_flight')",
        &[&STALLED],
    )
    .await
    .unwrap();
    let stalled = s.spawn_pay(STALLED, Some("key-stalled"));
    // Stopped with the mark row locked; then the record's row is let go.
    let backend = s.stop_backend_waiting("WITH fenced AS").await;
    tx.rollback().await.unwrap();
    let statuses = s
        .retried_while_others_pay(|n| format!("key-retry-{n}"))
        .await;
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    s.refused_unpaid(stalled).await;
    // The backend goes on: its statement commits, and its record — nobody was told — goes.
    s.pg.resume_backend(backend).await;
    s.until_nothing_stalls().await;
    s.created_soon("key-stalled").await;
    assert_eq!(s.paid_to(STALLED), 1, "paid once");
}

#[tokio::test]
async fn shutdown_waits_for_a_stalled_compare_and_set_so_its_key_stays_usable() {
    let mut s = setup_as(true).await;
    s.stall_nth("key-stalled-stop", 1);
    let stalled = s.spawn_pay(STALLED, Some("key-stalled-stop"));
    s.until_stalled().await;
    let (rg, relay, rail) = (&mut s.rg, &s.relay, &s.rail);
    let (status, ()) = tokio::join!(rg.stop(), async {
        // SIGTERM is on its way; the stalled request is refused first, and only then does
        // its statement reach PostgreSQL, and commit.
        refused_unpaid(rail, stalled).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        relay.release_stalled();
    });
    assert!(status.success(), "{status}");
    // The statement committed before railguard stopped, and the record nobody was told about
    // went with it.
    let records: i64 =
        s.pg.one(
            "SELECT count(*) FROM idempotency_record WHERE idempotency_key = 'key-stalled-stop'",
            &[],
        )
        .await;
    assert_eq!(
        records, 0,
        "the record of a request never forwarded is left"
    );
    assert_eq!(s.pg.mark(STALLED).await, Some(1), "the statement committed");
    s.rg.start_again().await;
    s.retry_pays_once("key-stalled-stop").await;
}

#[tokio::test]
async fn a_batcher_jammed_by_stalled_statements_is_not_ready() {
    let s = setup().await;
    let readyz = format!("http://{}/readyz", s.rg.admin);
    // One place and two overrun places (store::batch::slots): three stalled statements fill them.
    let mut stalled = Vec::new();
    for account in ["acct-jam-1", "acct-jam-2", "acct-jam-3"] {
        let (status, body) = s.http.get(&readyz).await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        s.stall_nth(account, 1);
        stalled.push(s.spawn_pay(account, None));
        s.until_stalled().await;
    }
    let jammed = "/readyz saying not ready while every fence place is stalled";
    let why = eventually(Duration::from_secs(2), jammed, || async {
        let (status, body) = s.http.get(&readyz).await.unwrap();
        (status == StatusCode::SERVICE_UNAVAILABLE).then_some(body)
    })
    .await;
    assert!(why.contains("3 fence statements stalled"), "{why}");
    s.relay.release_stalled();
    s.until_nothing_stalls().await;
    let (status, body) = s.http.get(&readyz).await.unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    // Each stalled request was answered truly: refused with nothing paid, or — released
    // before its deadline — paid once.
    for (account, reply) in ["acct-jam-1", "acct-jam-2", "acct-jam-3"]
        .iter()
        .zip(stalled)
    {
        let paid = match reply.await.unwrap().status {
            StatusCode::CREATED => 1,
            StatusCode::SERVICE_UNAVAILABLE => 0,
            other => panic!("{account}: {other}"),
        };
        assert_eq!(s.paid_to(account), paid, "{account}");
    }
}

#[tokio::test]
async fn a_backend_stopped_holding_a_record_in_its_completion_holds_up_that_record_only() {
    // A database timeout of 3 s: a statement holds its place for 300 ms (store::batch::slots).
    let s = setup_with_rail(
        Rail::with_latency(Duration::from_millis(300)).await,
        Duration::from_secs(3),
    )
    .await;
    // A completion stalled on the network first keeps the completion batcher's place for
    // 300 ms, so that the two that follow share one statement.
    s.stall_nth("key-y", 2);
    let earlier = s.spawn_pay("acct-y", Some("key-y"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let firsts = [
        s.spawn_pay(STALLED, Some("key-a")),
        s.spawn_pay(STALLED, Some("key-z")),
    ];
    // While the rail takes its time, key-z's record is locked by someone else: the completion
    // of both locks key-a's row, then waits for key-z's, and is stopped waiting — holding
    // key-a's row from then on.
    let mut blocker = s.pg.client().await;
    let tx = blocker.transaction().await.unwrap();
    until(Duration::from_secs(1), "the record made", || async {
        let locked = tx
            .execute(
                "SELECT 1 FROM idempotency_record
                 WHERE account_id = $1 AND idempotency_key = 'key-z' FOR UPDATE",
                &[&STALLED],
            )
            .await
            .unwrap();
        locked == 1
    })
    .await;
    let backend = s.stop_backend_waiting("UPDATE idempotency_record r").await;
    tx.rollback().await.unwrap();
    // The rail's answers reach the first clients even though they are not stored yet.
    for first in firsts {
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    }
    // Repeats of key-a keep coming while others pay: they wait for the completion (and are
    // refused, nothing forwarded) instead of holding up the batches they would join.
    let statuses = s.retried_while_others_pay(|_| "key-a".to_string()).await;
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    s.pg.resume_backend(backend).await;
    s.relay.release_stalled();
    assert_eq!(earlier.await.unwrap().status, StatusCode::CREATED);
    s.until_nothing_stalls().await;
    let replayed = s.created_soon("key-a").await;
    assert_eq!(
        replayed.headers.get("idempotency-replayed"),
        Some(&"true".parse().unwrap())
    );
    assert_eq!(s.paid_to(STALLED), 2, "key-a and key-z, each paid once");
}

/// The last look has places and sessions of its own (`store::marks`' `look`): a request whose
/// compare-and-set was answered before every fence place stalled takes its last look, and is
/// forwarded, while the fence batcher stays jammed.
#[tokio::test]
async fn a_last_look_is_answered_while_every_fence_place_is_stalled() {
    init_tracing();
    let s = setup_of(
        false,
        Rail::with_latency(Duration::from_millis(2000)).await,
        &[("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000")],
    )
    .await;
    // Token 1 at the rail holds the account's turn: token 2, its compare-and-set answered,
    // waits for that turn before its last look.
    let first = s.rg.payment("acct-look-jam", 1).spawn();
    s.rail.until_paid(1).await;
    let second = s.rg.payment("acct-look-jam", 2).spawn();
    until(
        Duration::from_secs(2),
        "token 2's compare-and-set committed",
        || async { s.pg.mark("acct-look-jam").await == Some(2) },
    )
    .await;
    // Before the rail answers token 1, stalled statements take every fence place.
    let mut jammed = Vec::new();
    for account in ["acct-jam-1", "acct-jam-2", "acct-jam-3"] {
        s.stall_nth(account, 1);
        jammed.push(s.spawn_pay(account, None));
        s.until_stalled().await;
    }
    until(
        Duration::from_secs(1),
        "three stalled fence statements",
        || async { s.stalled("fence").await == 3.0 },
    )
    .await;
    assert!(!second.is_finished(), "token 2 still waits for its turn");
    let second = second.await.unwrap();
    second.assert_status(StatusCode::CREATED);
    assert_eq!(
        s.stalled("fence").await,
        3.0,
        "the fence batcher stayed jammed through token 2's last look"
    );
    first.await.unwrap().assert_status(StatusCode::CREATED);
    let tokens: Vec<Option<String>> = s
        .rail
        .ledger()
        .iter()
        .filter(|e| e.account.as_deref() == Some("acct-look-jam"))
        .map(|e| e.token.clone())
        .collect();
    assert_eq!(tokens, [Some("1".to_string()), Some("2".to_string())]);
    s.relay.release_stalled();
    s.until_nothing_stalls().await;
    for (account, reply) in ["acct-jam-1", "acct-jam-2", "acct-jam-3"]
        .iter()
        .zip(jammed)
    {
        let paid = match reply.await.unwrap().status {
            StatusCode::CREATED => 1,
            StatusCode::SERVICE_UNAVAILABLE => 0,
            other => panic!("{account}: {other}"),
        };
        assert_eq!(s.paid_to(account), paid, "{account}");
    }
}

/// railguard (a process if `process`) with a database timeout of 3 s — a statement holds its
/// place for 300 ms (store::batch::slots) — in front of a rail that answers in 1.5 s, with
/// `more` overrides.
async fn setup_for_a_stopped_compare_and_set(process: bool, more: &[(&str, &str)]) -> Setup {
    init_tracing();
    let mut env = vec![
        ("RAILGUARD__DATABASE__TIMEOUT_MS", "3000"),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000"),
    ];
    env.extend_from_slice(more);
    setup_of(
        process,
        Rail::with_latency(Duration::from_millis(1500)).await,
        &env,
    )
    .await
}

impl Setup {
    /// The stalled account's payment keyed key-held reaches the rail; then a compare-and-set
    /// that holds key-held's record row is stopped, and the rail's answer comes: it reaches its
    /// client, but its completion waits behind the stopped statement. Returns the stopped
    /// backend, the answer, and the requests whose verdicts come too late (refused, nothing
    /// forwarded).
    async fn completion_behind_a_stopped_compare_and_set(
        &self,
    ) -> (u32, Reply, [tokio::task::JoinHandle<Reply>; 3]) {
        let first = self.spawn_pay(STALLED, Some("key-held"));
        self.rail.until_paid(1).await;
        // key-lock's record is being made by someone else.
        let mut blocker = self.pg.client().await;
        let tx = blocker.transaction().await.unwrap();
        tx.execute(
            "INSERT INTO idempotency_record
                 (account_id, idempotency_key, fingerprint, token, owner, state)
             VALUES ($1, 'key-lock', 'f', 1, 'blocker', 'in_flight')",
            &[&STALLED],
        )
        .await
        .unwrap();
        // A statement stalled on the network keeps the fence batcher's place for 300 ms, so
        // that a repeat of key-held and key-lock's first request share the next statement: it
        // locks the account's mark row and key-held's record (the repeat meets it), then waits
        // for key-lock's, and is stopped there.
        self.stall_nth("acct-place", 1);
        let place = self.spawn_pay("acct-place", None);
        self.until_stalled().await;
        let repeat = self.spawn_pay(STALLED, Some("key-held"));
        let other = self.spawn_pay(STALLED, Some("key-lock"));
        let backend = self.stop_backend_waiting("WITH fenced AS").await;
        tx.rollback().await.unwrap();
        // The rail's answer to key-held reaches its client, though it cannot be stored yet.
        let answered = first.await.unwrap();
        answered.assert_status(StatusCode::CREATED);
        let client = self.pg.client().await;
        assert_eq!(
            support::records::state_of(&client, "key-held")
                .await
                .as_deref(),
            Some("in_flight"),
            "the completion waits behind the stopped statement"
        );
        (backend, answered, [repeat, other, place])
    }
}

/// A completion whose record a stopped compare-and-set holds — a repeat of its key, whose
/// statement locked the record's row (`ON CONFLICT`) and was stopped waiting for another
/// record's — is not lost: its statement gives up at the lock timeout, the completion is
/// retried in the background, the rail's answer reaches its client meanwhile, and once the
/// compare-and-set goes on the answer is stored and replayed.
#[tokio::test]
async fn a_completion_behind_a_stopped_compare_and_set_that_holds_its_record_is_stored_later() {
    let s = setup_for_a_stopped_compare_and_set(false, &[]).await;
    let (backend, answered, late) = s.completion_behind_a_stopped_compare_and_set().await;
    s.pg.resume_backend(backend).await;
    s.relay.release_stalled();
    for refused in late {
        refused
            .await
            .unwrap()
            .assert_status(StatusCode::SERVICE_UNAVAILABLE);
    }
    s.until_nothing_stalls().await;
    let replayed = s.created_soon("key-held").await;
    assert_eq!(
        replayed.headers.get("idempotency-replayed"),
        Some(&"true".parse().unwrap())
    );
    assert_eq!(replayed.body, answered.body);
    // key-lock's record, made for a request that was never told, went: its retry pays.
    s.created_soon("key-lock").await;
    assert_eq!(
        s.paid_to(STALLED),
        2,
        "key-held and key-lock, each paid once"
    );
    assert_eq!(s.paid_to("acct-place"), 0);
    assert_eq!(
        s.rg.metrics()
            .await
            .get("railguard_idempotency_outcomes_lost_total"),
        0.0
    );
}

/// A graceful stop with a forward on its way to the rail, a statement stopped at the database
/// and a completion retried in the background behind it waits for all three within its one
/// grace; once none is out it records its clean stop.
#[tokio::test]
async fn a_stop_waits_for_a_forward_a_statement_and_an_outcome_within_one_grace() {
    let mut s =
        setup_for_a_stopped_compare_and_set(true, &[("RAILGUARD__SHUTDOWN__GRACE_MS", "15000")])
            .await;
    let instance = s.rg.instance().expect("the process names its instance");
    let (backend, _answered, late) = s.completion_behind_a_stopped_compare_and_set().await;
    for refused in late {
        refused
            .await
            .unwrap()
            .assert_status(StatusCode::SERVICE_UNAVAILABLE);
    }
    // A keyed forward on its way to the rail whose client leaves: no connection is left for
    // the listener to drain, yet it is counted.
    let slow = s.spawn_pay("acct-slow", Some("key-slow"));
    s.rail.until_paid(2).await;
    slow.abort();
    let stopping = tokio::time::Instant::now();
    let (status, ()) = tokio::join!(s.rg.stop(), async {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        s.pg.resume_backend(backend).await;
        s.relay.release_stalled();
    });
    let took = stopping.elapsed();
    assert!(status.success(), "{status}");
    assert!(
        took >= Duration::from_millis(2500),
        "the stop ended after {took:?}, before the statement and the outcome"
    );
    let log = s.rg.log();
    for waited in [
        "waiting for the rail's answers to forwards still on their way",
        "waiting for database statements still unanswered",
        "waiting for idempotency outcomes still retried until the database takes them",
        "recorded this process's clean stop",
    ] {
        assert!(log.contains(waited), "{waited}: {log}");
    }
    let client = s.pg.client().await;
    assert_eq!(
        support::records::state_of(&client, "key-held")
            .await
            .as_deref(),
        Some("done"),
        "the outcome was stored before the exit"
    );
    assert_eq!(
        support::records::state_of(&client, "key-slow")
            .await
            .as_deref(),
        Some("done"),
        "the forward's answer was stored before the exit"
    );
    assert_eq!(s.paid_to("acct-slow"), 1);
    assert_eq!(clean_stops(&s.pg, instance).await, 1);
}

/// A stop whose grace ends with a compare-and-set still unanswered (its connection stalled)
/// ends within that one grace, says what it leaves, and records no clean stop: the statement
/// may still commit, so the process cannot say it sends nothing more.
#[tokio::test]
async fn a_stop_whose_grace_ends_with_a_statement_stalled_records_no_clean_stop() {
    init_tracing();
    let grace = Duration::from_millis(1500);
    let mut s = setup_of(
        true,
        Rail::start().await,
        &[("RAILGUARD__SHUTDOWN__GRACE_MS", "1500")],
    )
    .await;
    let instance = s.rg.instance().expect("the process names its instance");
    s.stall_nth("key-stalled-past-grace", 1);
    let stalled = s.spawn_pay(STALLED, Some("key-stalled-past-grace"));
    s.until_stalled().await;
    let stopping = tokio::time::Instant::now();
    let (status, ()) = tokio::join!(s.rg.stop(), refused_unpaid(&s.rail, stalled));
    let took = stopping.elapsed();
    assert!(status.success(), "{status}");
    assert!(
        took < grace + Duration::from_secs(2),
        "the stop took {took:?}, well past its grace of {grace:?}"
    );
    let log = s.rg.log();
    assert!(
        log.contains("shutdown.grace_ms is over with work still outstanding")
            && log.contains("no clean stop is recorded"),
        "{log}"
    );
    assert_eq!(
        clean_stops(&s.pg, instance).await,
        0,
        "a clean stop recorded with a statement out"
    );
}

/// The clean stops the railguard of `instance` recorded (`railguard_audit`).
async fn clean_stops(pg: &Pg, instance: i64) -> i64 {
    pg.one(
        "SELECT count(*) FROM railguard_audit WHERE action = 'instance_stopped'
           AND (outcome->>'instance')::bigint = $1",
        &[&instance],
    )
    .await
}
