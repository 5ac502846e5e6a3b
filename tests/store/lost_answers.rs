//! A compare-and-set whose commit reached PostgreSQL but whose answer was lost with its
//! connection, and that could not be tried again on a new session (a partition between
//! railguard and PostgreSQL), is refused (503) with nothing forwarded — and the idempotency
//! record its lost commit made is removed once the database answers again, so that the retry
//! the 503 asks for goes through, once, instead of meeting `in_flight` and then `in_doubt`
//! (`store::marks`' `advance`).
//!
//! The answer is lost by a relay in front of PostgreSQL: the statement waits at the server for
//! the account's mark row (a transaction of the test holds it), the relay starts holding
//! everything the server sends, the test lets the row go — the statement commits — and the
//! relay cuts every connection and refuses new ones for a while.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::relay::Relay;
use support::{Pg, Rail, Railguard, eventually, init_tracing, until};

const ACCOUNT: &str = "acct-lost-answer";
const KEY: &str = "key-lost-answer";

#[tokio::test]
async fn a_compare_and_set_whose_answer_was_lost_leaves_no_record_in_flight() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let relay = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    let rg = Railguard::start(&relay.postgres_url(&pg.url()), &rail.url(), &[]).await;
    // The account has a mark row; a transaction of the test holds it, so that the keyed
    // request's compare-and-set waits for it at the server.
    rg.payment(ACCOUNT, 1)
        .expect(StatusCode::CREATED)
        .send()
        .await;
    let mut holder = pg.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM rail_high_water WHERE account_id = $1 FOR UPDATE",
        &[&ACCOUNT],
    )
    .await
    .unwrap();
    let paying = rg.payment(ACCOUNT, 1).key(KEY).spawn();
    let watcher = pg.client().await;
    until(
        Duration::from_millis(800),
        "the compare-and-set waiting for the mark row",
        || async {
            watcher
                .query_opt(
                    "SELECT pid FROM pg_stat_activity
                     WHERE application_name = 'railguard' AND wait_event_type = 'Lock'
                       AND starts_with(query, 'WITH fenced AS')",
                    &[],
                )
                .await
                .unwrap()
                .is_some()
        },
    )
    .await;
    // Everything the server sends from now on is held; the row goes, and the statement commits.
    relay.set_delay(Duration::from_secs(5));
    tx.rollback().await.unwrap();
    until(
        Duration::from_millis(500),
        "the record committed",
        || async { support::records::records_keyed(&watcher, KEY).await == 1 },
    )
    .await;
    // Its answer is lost with the connection, and no new session can be had for a while.
    relay.cut_for(Duration::from_millis(1500));
    relay.set_delay(Duration::ZERO);
    let refused = paying.await.unwrap();
    refused.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        rail.times_paid(KEY),
        0,
        "a refused request reached the rail"
    );
    // The retry the 503 asks for goes through once the database answers again: the record of
    // the lost commit — whose request was never forwarded — is gone.
    let retried = eventually(
        Duration::from_secs(10),
        "the retry of the refused request paid",
        || async {
            let reply = rg.payment(ACCOUNT, 1).key(KEY).send().await;
            (reply.status == StatusCode::CREATED).then_some(reply)
        },
    )
    .await;
    assert_eq!(retried.headers.get("idempotency-replayed"), None);
    assert_eq!(rail.times_paid(KEY), 1, "paid once");
}
