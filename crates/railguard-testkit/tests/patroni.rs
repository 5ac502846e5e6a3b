//! The Patroni cluster fails over as production does: a hard-killed primary is replaced by its
//! standby on a new timeline, the same URL reaches the new primary, and with asynchronous
//! replication a commit the client saw succeed can be gone afterwards.

use std::time::{Duration, Instant};

use railguard_testkit::PatroniCluster;

const FAILOVER_TIMEOUT: Duration = Duration::from_secs(40);

async fn rows(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query("SELECT note FROM notes ORDER BY id", &[])
        .await
        .expect("read notes")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_failover_keeps_committed_rows_and_moves_to_a_new_timeline() {
    let started = Instant::now();
    let mut cluster = PatroniCluster::builder()
        .members(2)
        .synchronous_mode(true)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let bootstrap = started.elapsed();

    let client = cluster.client().await;
    client
        .batch_execute(
            "CREATE TABLE notes (id bigserial PRIMARY KEY, note text NOT NULL);
             INSERT INTO notes (note) VALUES ('before');",
        )
        .await
        .expect("write through the cluster's URL");
    let timeline = cluster.timeline().await;
    let system = cluster.system_identifier().await;

    let killed = Instant::now();
    let old = cluster.kill_primary().await;
    let new = cluster.wait_for_new_primary(old, FAILOVER_TIMEOUT).await;
    let failover = killed.elapsed();
    assert_ne!(new, old);
    assert!(
        client.simple_query("SELECT 1").await.is_err(),
        "the old primary's connection is gone"
    );

    let client = cluster.client().await;
    client
        .execute("INSERT INTO notes (note) VALUES ('after')", &[])
        .await
        .expect("write through the same URL after the failover");
    assert_eq!(rows(&client).await, ["before", "after"]);
    assert!(
        cluster.timeline().await > timeline,
        "promotion starts a timeline"
    );
    assert_eq!(cluster.system_identifier().await, system);

    let restarting = Instant::now();
    assert_eq!(cluster.restart_member(old).await, new);
    let rejoin = restarting.elapsed();
    assert_eq!(
        rows(&cluster.member_client(old).await).await,
        ["before", "after"]
    );

    let switching = Instant::now();
    assert_eq!(cluster.switchover().await, old);
    let switchover = switching.elapsed();
    assert_eq!(rows(&cluster.client().await).await, ["before", "after"]);
    eprintln!(
        "bootstrap {bootstrap:.1?}, failover {failover:.1?}, rejoin {rejoin:.1?}, \
         switchover {switchover:.1?}, total {:.1?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_failover_loses_an_acknowledged_commit() {
    let started = Instant::now();
    let mut cluster = PatroniCluster::builder()
        .members(2)
        .synchronous_mode(false)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let bootstrap = started.elapsed();

    let client = cluster.client().await;
    client
        .batch_execute(
            "CREATE TABLE notes (id bigserial PRIMARY KEY, note text NOT NULL);
             INSERT INTO notes (note) VALUES ('replicated');",
        )
        .await
        .expect("write through the cluster's URL");
    cluster.wait_caught_up(Duration::from_secs(10)).await;

    let primary = cluster.pause_replication().await;
    client
        .execute("INSERT INTO notes (note) VALUES ('acknowledged')", &[])
        .await
        .expect("the commit is acknowledged while no standby receives it");
    assert_eq!(rows(&client).await, ["replicated", "acknowledged"]);

    let killed = Instant::now();
    assert_eq!(cluster.kill_primary().await, primary);
    let new = cluster
        .wait_for_new_primary(primary, FAILOVER_TIMEOUT)
        .await;
    let failover = killed.elapsed();

    let client = cluster.client().await;
    assert_eq!(
        rows(&client).await,
        ["replicated"],
        "the new primary (member {new}) lacks the acknowledged commit"
    );
    eprintln!(
        "bootstrap {bootstrap:.1?}, failover {failover:.1?}, total {:.1?}",
        started.elapsed()
    );
}
