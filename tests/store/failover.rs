//! railguard on a Patroni cluster, as production runs PostgreSQL: a hard failover, with
//! payments before and after, and an asynchronous standby promoted after it missed the last
//! commits. Either way the new primary is another server than the one the database was
//! acknowledged on, so every grant from before is fenced out once and new grants start at the
//! floor: no token is handed out twice (INV-04) and no superseded grant pays again (INV-05).

use railguard_testkit as support;

use support::payment::{fenced_out, grant, paid, pay, pay_after_the_hold};

use std::time::Duration;

use http::StatusCode;
use railguard::sdk::{LockClient, LockHandle, RailClient, SdkError};
use support::{PatroniCluster, Rail, Railguard, init_tracing};

const FAILOVER: Duration = Duration::from_secs(60);
/// Longer than the hold after a change of server (3 s + the test config's
/// `proxy.rail_transit_ms`), with room for a loaded machine.
const HOLD: Duration = Duration::from_secs(30);

/// A grant once the lock service answers again (it may be reconnecting).
async fn acquire(lock: &LockClient, holder: &str) -> LockHandle {
    support::eventually(
        FAILOVER,
        "a grant of acct from the lock service",
        || async {
            lock.acquire(
                "acct",
                holder,
                Duration::from_secs(60),
                Duration::from_secs(1),
            )
            .await
            .ok()
        },
    )
    .await
}

async fn audited_changes(cluster: &PatroniCluster) -> i64 {
    cluster
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM railguard_audit WHERE action = 'store_changed'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A Patroni cluster of two members, in synchronous mode or not.
async fn two_members(synchronous: bool) -> PatroniCluster {
    PatroniCluster::builder()
        .members(2)
        .synchronous_mode(synchronous)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_fences_the_grants_from_before_it_and_payments_go_on_after_it() {
    init_tracing();
    let mut cluster = two_members(true).await;
    let rail = Rail::start().await;
    let rg = Railguard::start_process(&cluster.url(), &rail.url(), &[]).await;
    let lock = rg.lock_client();
    let proxy = RailClient::new(rg.proxy_url(""));

    let before = acquire(&lock, "w1").await;
    paid(&proxy, &before, "acct", "p1").await;
    let timeline = cluster.timeline().await;

    let old = cluster.kill_primary().await;
    cluster.wait_for_new_primary(old, FAILOVER).await;
    assert!(cluster.timeline().await > timeline);

    // The grant from before is fenced out once, whatever the mark says…
    support::eventually(
        FAILOVER,
        "the grant from before the failover fenced out",
        || async {
            match pay(&proxy, &before, "acct", "p2").await {
                Err(SdkError::FencedOut { .. }) => Some(()),
                _ => None,
            }
        },
    )
    .await;
    // …and payments go on under a new grant, from the floor up.
    let after = acquire(&lock, "w2").await;
    let floor: i64 = support::sql::one(
        &cluster.client().await,
        "SELECT floor FROM railguard_store_epoch",
        &[],
    )
    .await;
    assert!(floor > before.token().get());
    assert!(
        after.token().get() >= floor,
        "new grants start at the floor"
    );
    assert_eq!(
        pay_after_the_hold(&proxy, &after, "acct", "p3", HOLD)
            .await
            .unwrap(),
        StatusCode::CREATED
    );
    assert_eq!(rail.tokens(), [before.token().get(), after.token().get()]);
    assert_eq!(audited_changes(&cluster).await, 1);
    assert!(rg.log().contains("CHANGED SERVER"));
    let metrics = rg.metrics().await;
    assert_eq!(metrics.get("railguard_store_changes_total"), 1.0);
    assert_eq!(metrics.get("railguard_store_epoch"), 1.0);
}

/// W1 pays; replication stops reaching the standby; W1's lease runs out and W2 takes the key
/// and pays — acknowledged by a primary that is then killed, so the promoted standby never had
/// W2's grant, mark or record. A railguard started afterwards (no memory of its own) meets the
/// new primary: W1 and W2 are fenced out, and W3's token is above W2's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asynchronous_failover_that_lost_commits_is_fenced() {
    init_tracing();
    let mut cluster = two_members(false).await;
    let rail = Rail::start().await;
    let mut rg = Railguard::start_process(&cluster.url(), &rail.url(), &[]).await;
    let lock = rg.lock_client();
    let proxy = RailClient::new(rg.proxy_url(""));
    let ttl = Duration::from_millis(300);

    let w1 = grant(&lock, "acct", "w1", ttl, Duration::ZERO).await;
    paid(&proxy, &w1, "acct", "p1").await;
    cluster.wait_caught_up(FAILOVER).await;
    cluster.pause_replication().await;
    let w2 = grant(&lock, "acct", "w2", Duration::from_secs(60), ttl * 20).await;
    assert!(w2.token().get() > w1.token().get());
    paid(&proxy, &w2, "acct", "p2").await;

    let old = cluster.kill_primary().await;
    cluster.wait_for_new_primary(old, FAILOVER).await;
    let lost = support::records::records_keyed(&cluster.client().await, "p2").await;
    assert_eq!(lost, 0, "the new primary never had W2's commit");
    rg.restart().await;

    for (grant, id) in [(&w1, "p3"), (&w2, "p4")] {
        fenced_out(&proxy, grant, "acct", id).await;
    }
    let w3 = acquire(&lock, "w3").await;
    assert!(
        w3.token().get() > w2.token().get(),
        "no token is handed out twice"
    );
    assert_eq!(
        pay_after_the_hold(&proxy, &w3, "acct", "p5", HOLD)
            .await
            .unwrap(),
        StatusCode::CREATED
    );
    assert_eq!(
        rail.tokens(),
        [w1.token().get(), w2.token().get(), w3.token().get()]
    );
    assert_eq!(audited_changes(&cluster).await, 1);
}
