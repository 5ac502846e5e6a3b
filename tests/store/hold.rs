//! The hold after a change of PostgreSQL server (`store::handover`, "When the store goes
//! back"), with several railguard processes: requests of newer grants that cannot wait it out
//! are answered 503 at once with nothing sent — in every process, one started after the change
//! included — and the hold ends; two changes in a row under a forward held in the network still
//! deliver the older forward first.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, eventually, init_tracing};
use tokio::time::Instant;

/// Has `rg` meet the new server (an old grant is refused: the change is fenced) and returns
/// the floor the change raised.
async fn fence_through(rg: &Railguard, pg: &Pg, account: &str, old: i64) -> i64 {
    eventually(
        Duration::from_secs(15),
        format!("token {old} on {account} refused (409)"),
        || async {
            let reply = rg.http().pay_with(rg, old, account).await;
            (reply.status == StatusCode::CONFLICT).then_some(())
        },
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "the floor raised by the change of server",
        || pg.floor(),
    )
    .await
}

/// A restart of PostgreSQL (nothing lost, a change all the same) under railguards A and B;
/// C starts after it. Each is sent a grant above the new floor during the hold (3 s +
/// `proxy.rail_transit_ms` = 18 s, longer than a request's 3 s deadline): 503 before that
/// deadline, and the rail receives nothing; once the hold has passed, the payment goes through.
#[tokio::test]
async fn during_the_hold_after_a_restart_every_process_answers_503_at_once_and_sends_nothing() {
    init_tracing();
    let mut pg = Pg::start().await;
    let rail = Rail::start().await;
    let env = [
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "15000"),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "3000"),
    ];
    let a = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let b = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let paid = a.http().pay_with(&a, 5, "acct-h").await;
    paid.assert_status(StatusCode::CREATED);
    pg.kill().await;
    pg.server.start().await.expect("PostgreSQL starts again");
    let changed = Instant::now();
    let floor = fence_through(&b, &pg, "acct-h", 6).await;
    let c = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    for (i, rg) in [&a, &b, &c].into_iter().enumerate() {
        let started = Instant::now();
        let reply = rg.http().pay_with(rg, floor + 1 + i as i64, "acct-h").await;
        let took = started.elapsed();
        assert!(
            changed.elapsed() < Duration::from_secs(16),
            "the test was too slow to ask within the hold ({:?})",
            changed.elapsed()
        );
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "railguard {i} during the hold: {}",
            reply.body
        );
        assert!(
            took < Duration::from_secs(3),
            "answered by its deadline, not at once: {took:?}"
        );
    }
    assert_eq!(
        rail.tokens(),
        [5],
        "the rail received a request during the hold"
    );
    let left = Duration::from_secs(45).saturating_sub(changed.elapsed());
    let after = eventually(
        left,
        "the hold's end, 45 s after the change at the latest",
        || async {
            let reply = c.http().pay_with(&c, floor + 10, "acct-h").await;
            (reply.status != StatusCode::SERVICE_UNAVAILABLE).then_some(reply)
        },
    )
    .await;
    after.assert_status(StatusCode::CREATED);
    assert_eq!(rail.tokens(), [5, floor + 10]);
}

/// Railguard A's forward of token 5 is held in the network (8 s); PostgreSQL goes back to a
/// copy from before 5's compare-and-set, B fences it, and PostgreSQL crash-restarts at once
/// (a second change). B's grant above the second floor must reach the rail after 5.
#[tokio::test]
async fn two_changes_in_a_row_under_a_forward_on_its_way_keep_the_older_forward_first() {
    init_tracing();
    let env = [
        ("RAILGUARD__PROXY__RAIL_TRANSIT_MS", "10000"),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "40000"),
    ];
    let crate::Rewound {
        mut pg,
        rail,
        _slow_path,
        _a,
        b,
        older,
    } = crate::rewound_under_a_forward("acct-2", &env).await;
    let first = fence_through(&b, &pg, "acct-2", 6).await;
    pg.kill().await;
    pg.server.start().await.expect("PostgreSQL starts again");
    let second = fence_through(&b, &pg, "acct-2", first + 1).await;
    assert!(second > first);
    crate::newer_then_older(&b, "acct-2", second + 1, older).await;
    assert_eq!(
        rail.tokens(),
        [5, second + 1],
        "the rail received a grant from after the second change before a forward sent before the first"
    );
}
