//! Several railguard processes on one database, each request of an account sent to either:
//! the rail receives the account's tokens in order whichever process each went through
//! (`store::handover`). A forward one process has on its way to the rail — held in the network,
//! or sent by a process killed since — holds back a newer token's forward in another until it
//! can no longer arrive; one that was never sent (its compare-and-set committed after its caller
//! left) holds back nothing. With the order switched off (`fencing.order_across_processes = false`,
//! the negative control) the same runs deliver the newer token first.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, Relay, eventually, init_tracing};

/// Token 5 through railguard A, whose path to the rail holds each chunk 1.5 s; token 7 through
/// railguard B, direct, 300 ms later. Returns the order the rail received them in, and B's
/// count of forwards that waited for another process's.
async fn two_processes(order: &str) -> (Vec<i64>, f64) {
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = Relay::start(rail.addr).await;
    let env = [
        ("RAILGUARD__FENCING__ORDER_ACROSS_PROCESSES", order),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000"),
    ];
    let a = Railguard::start_process(&pg.url(), &slow_path.url(), &env).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    slow_path.set_delay(Duration::from_millis(1500));
    let older = a.pay_in_background(5, "acct-x");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let newer = b.http().pay_with(&b, 7, "acct-x").await;
    newer.assert_status(StatusCode::CREATED);
    let older = older.await.unwrap();
    older.assert_status(StatusCode::CREATED);
    let waited = b.metrics().await.get("railguard_forward_handovers_total");
    (rail.tokens(), waited)
}

#[tokio::test]
async fn a_newer_token_through_another_railguard_waits_for_a_forward_still_on_its_way() {
    init_tracing();
    let (tokens, waited) = two_processes("true").await;
    assert_eq!(
        tokens,
        [5, 7],
        "the rail received the newer grant's request before the older one still on its way"
    );
    assert_eq!(waited, 1.0, "B's forward of 7 counted as one that waited");
}

#[tokio::test]
async fn without_the_cross_process_order_the_newer_token_overtakes() {
    init_tracing();
    let (tokens, _) = two_processes("false").await;
    assert_eq!(
        tokens,
        [7, 5],
        "the negative control: without the order the newer request arrives first"
    );
}

/// Railguard A is SIGKILLed while its forward of token 5 is held in the network; the relay
/// still delivers it. B's newer token waits until A's row says nothing of A can still arrive
/// (A's last write, plus the time A forwards without writing, plus `proxy.rail_transit_ms`),
/// then goes: behind the killed process's request, not before it — and not for ever.
#[tokio::test]
async fn a_killed_railguards_forward_holds_newer_tokens_until_it_can_no_longer_arrive() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = Relay::start(rail.addr).await;
    let env = [
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "1500"),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000"),
    ];
    let mut a = Railguard::start_process(&pg.url(), &slow_path.url(), &env).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    slow_path.set_delay(Duration::from_millis(2500));
    let older = a.pay_in_background(5, "acct-k");
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill().await;
    let _ = older.await;
    let started = tokio::time::Instant::now();
    let newer = b.http().pay_with(&b, 7, "acct-k").await;
    newer.assert_status(StatusCode::CREATED);
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "7 went after {:?}, before the killed process's forward could have arrived",
        started.elapsed()
    );
    assert_eq!(rail.tokens(), [5, 7]);
}

/// A running process's entry stays in an account's row after another process's request
/// waited for it (its own next compare-and-set for the account replaces it); once that process
/// has stopped and its row is quiet, the next request that finds its entry removes it.
#[tokio::test]
async fn the_entry_of_a_stopped_process_is_removed_once_its_row_is_quiet() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let mut a = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    let (a_id, b_id) = (a.instance().unwrap(), b.instance().unwrap());
    let forwarders = |account: &'static str| {
        let pg = &pg;
        async move {
            let mut ids = pg
                .client()
                .await
                .query_one(
                    "SELECT forwarders FROM rail_high_water WHERE account_id = $1",
                    &[&account],
                )
                .await
                .unwrap()
                .get::<_, Vec<i64>>(0);
            ids.sort_unstable();
            ids
        }
    };
    let both = {
        let mut ids = vec![a_id, b_id];
        ids.sort_unstable();
        ids
    };
    for token in [3, 4] {
        let paid = a.http().pay_with(&a, token, "acct-p").await;
        paid.assert_status(StatusCode::CREATED);
    }
    assert_eq!(forwarders("acct-p").await, [a_id]);
    b.http()
        .pay_with(&b, 5, "acct-p")
        .await
        .assert_status(StatusCode::CREATED);
    a.http()
        .pay_with(&a, 6, "acct-p")
        .await
        .assert_status(StatusCode::CREATED);
    b.http()
        .pay_with(&b, 7, "acct-p")
        .await
        .assert_status(StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        forwarders("acct-p").await,
        both,
        "each running process's entry stays, replaced by its own next compare-and-set"
    );
    assert!(a.stop().await.success());
    // A's row is quiet 3 s + proxy.rail_transit_ms (1 s here) after its last write; B reads it
    // again once the row it read is a second old.
    let mut token = 8;
    eventually(
        Duration::from_secs(15),
        "the stopped process's entry removed from acct-p's row",
        || {
            token += 1;
            let (b, token) = (&b, token);
            let forwarders = &forwarders;
            async move {
                b.http()
                    .pay_with(b, token, "acct-p")
                    .await
                    .assert_status(StatusCode::CREATED);
                tokio::time::sleep(Duration::from_millis(300)).await;
                (forwarders("acct-p").await == [b_id]).then_some(())
            }
        },
    )
    .await;
    let tokens = rail.tokens();
    assert_eq!(tokens[..5], [3, 4, 5, 6, 7]);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

/// B pays an account whose last forward went through A a second earlier and was answered
/// then, and again once the row B read of A is older than a second: B reads A's row, finds the
/// forward answered, and waits for nothing — not counted as a handover.
#[tokio::test]
async fn a_forward_of_another_process_answered_before_is_not_waited_for() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let a = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &[]).await;
    a.http()
        .pay_with(&a, 3, "acct-q")
        .await
        .assert_status(StatusCode::CREATED);
    // A's row is written again within its heartbeat (500 ms) of the forward's answer.
    for (token, pause) in [(4, 2000), (5, 1100), (6, 1100)] {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        b.http()
            .pay_with(&b, token, "acct-q")
            .await
            .assert_status(StatusCode::CREATED);
    }
    assert_eq!(rail.tokens(), [3, 4, 5, 6]);
    assert_eq!(
        b.metrics().await.get("railguard_forward_handovers_total"),
        0.0,
        "B counted a wait for A's forward answered long before"
    );
}

/// Railguard B reads A's row once (its token 4 after A's 3) and keeps it; then A forwards 5
/// on a path that holds it 1.5 s, and B's token 7 comes 300 ms later. The row B read before
/// was written before A handed out 5's entry: it settles nothing of it, and 7 waits for 5.
#[tokio::test]
async fn a_row_read_before_does_not_settle_a_forward_handed_out_since() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let slow_path = Relay::start(rail.addr).await;
    let env = [("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "10000")];
    let a = Railguard::start_process(&pg.url(), &slow_path.url(), &env).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    a.http()
        .pay_with(&a, 3, "acct-r")
        .await
        .assert_status(StatusCode::CREATED);
    b.http()
        .pay_with(&b, 4, "acct-r")
        .await
        .assert_status(StatusCode::CREATED);
    slow_path.set_delay(Duration::from_millis(1500));
    let older = a.pay_in_background(5, "acct-r");
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.http()
        .pay_with(&b, 7, "acct-r")
        .await
        .assert_status(StatusCode::CREATED);
    older.await.unwrap().assert_status(StatusCode::CREATED);
    assert_eq!(
        rail.tokens(),
        [3, 4, 5, 7],
        "the newer token overtook a forward handed out after the row B had read"
    );
}

/// Token 5 through railguard A, whose path to the rail holds each chunk 8 s (longer than the
/// rewind takes, within `proxy.rail_transit_ms`); then the database goes back to a copy taken before 5's
/// compare-and-set (a rewind: the entry that named A's forward is lost with it), and railguard
/// B pays a grant above the floor the change raised. Returns the order the rail received them
/// in, and that grant's token. A cannot write its row while the server restarts: if that takes
/// longer than it may forward unheard, it closes its connection to the rail (502, "it may have
/// received the request"), and the relay still delivers what it holds.
async fn the_database_goes_back_with_a_forward_on_its_way(order: &str) -> (Vec<i64>, i64) {
    let env = [
        ("RAILGUARD__FENCING__ORDER_ACROSS_PROCESSES", order),
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "10000"),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "40000"),
    ];
    let crate::Rewound {
        pg,
        rail,
        _slow_path,
        _a,
        b,
        older,
    } = crate::rewound_under_a_forward("acct-r", &env).await;
    // B's next database connection meets the new server and raises the floor: an old grant is
    // refused.
    eventually(
        Duration::from_secs(10),
        "token 6 on acct-r refused through B (409)",
        || async {
            let reply = b.http().pay_with(&b, 6, "acct-r").await;
            (reply.status == StatusCode::CONFLICT).then_some(())
        },
    )
    .await;
    let floor = eventually(
        Duration::from_secs(5),
        "the floor raised by the change of server",
        || pg.floor(),
    )
    .await;
    crate::newer_then_older(&b, "acct-r", floor + 1, older).await;
    (rail.tokens(), floor + 1)
}

#[tokio::test]
async fn a_forward_on_its_way_when_the_database_goes_back_still_holds_newer_tokens() {
    init_tracing();
    let (tokens, newer) = the_database_goes_back_with_a_forward_on_its_way("true").await;
    assert_eq!(
        tokens,
        [5, newer],
        "the rail received a grant from after the rewind before a forward sent before it"
    );
}

#[tokio::test]
async fn without_the_cross_process_order_a_rewind_lets_the_newer_token_overtake() {
    init_tracing();
    let (tokens, newer) = the_database_goes_back_with_a_forward_on_its_way("false").await;
    assert_eq!(
        tokens,
        [newer, 5],
        "the negative control: without the order the newer request arrives first"
    );
}

/// Railguard A's compare-and-set for a keyed payment is held in the network until its caller
/// has given up (503, nothing forwarded); then it reaches PostgreSQL and commits — A's record
/// and A's entry among the account's forwarders with it. Nobody was told, so A forgets the
/// record and settles the entry: the retry through railguard B goes through at once, once, and
/// waits neither for a record in flight nor for A's row to go quiet.
#[tokio::test]
async fn a_compare_and_set_committed_after_its_caller_left_holds_up_no_retry_through_another_railguard()
 {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let a_path = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    let a = Railguard::start(&a_path.postgres_url(&pg.url()), &rail.url(), &[]).await;
    let b = Railguard::start(&pg.url(), &rail.url(), &[]).await;
    a_path.stall_first(|chunk| chunk.windows(8).any(|w| w == b"key-late"));
    let refused = a.payment("acct-late", 7).key("key-late").spawn();
    support::until(
        Duration::from_secs(2),
        "A's compare-and-set held",
        || async { a_path.has_stalled() },
    )
    .await;
    refused
        .await
        .unwrap()
        .assert_status(StatusCode::SERVICE_UNAVAILABLE);
    a_path.release_stalled();
    let client = pg.client().await;
    eventually(
        Duration::from_secs(3),
        "A's late commit made, and its record forgotten",
        || async {
            let made = pg.mark("acct-late").await == Some(7);
            let left = support::records::records_keyed(&client, "key-late").await;
            (made && left == 0).then_some(())
        },
    )
    .await;
    let retrying = tokio::time::Instant::now();
    b.payment("acct-late", 7)
        .key("key-late")
        .expect(StatusCode::CREATED)
        .send()
        .await;
    assert!(
        retrying.elapsed() < Duration::from_secs(2),
        "the retry waited {:?} for A's forward that was never sent",
        retrying.elapsed()
    );
    assert_eq!(rail.times_paid("key-late"), 1, "paid once");
    let forwarders: i32 = client
        .query_one(
            "SELECT cardinality(forwarders) FROM rail_high_water WHERE account_id = 'acct-late'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        forwarders, 2,
        "A's entry was in the account's row when B's compare-and-set ran, and stays, A running"
    );
    b.payment("acct-late", 6)
        .expect(StatusCode::CONFLICT)
        .send()
        .await;
}
