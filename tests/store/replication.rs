//! Replication that can lose a compare-and-set railguard accepted is refused or said loudly
//! (`store::replication`), and a compare-and-set whose commit PostgreSQL reports as done
//! locally but not replicated is not taken as accepted (`db::notices`).
//!
//! - The testkit's clusters run with fsync and full_page_writes off: railguard shows both
//!   risks in `railguard_db_replication_risk`, and with `database.replication_risk =
//!   "refuse"` it does not start, naming the setting and the key.
//! - `pg_receivewal` streaming from the server is a standby that is not synchronous until
//!   `synchronous_standby_names` names it.
//! - With `synchronous_standby_names` naming a standby that never connects, every commit waits
//!   for it; `pg_cancel_backend` ends the fence's wait and PostgreSQL reports the commit as a
//!   success with a warning. The request is answered 503 and the rail never sees it; once
//!   commits are replicated again, its retry with the same idempotency key goes through once.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use railguard::sdk::RailClient;
use railguard::server::ServeError;
use support::{Metrics, Pg, Rail, Railguard, World, eventually, init_tracing};

/// `database.replication_risk = "refuse"`.
const REFUSE: &str = "replication_risk = \"refuse\"\n";

fn risk(metrics: &Metrics, risk: &str) -> f64 {
    metrics.get(&format!("railguard_db_replication_risk{{risk=\"{risk}\"}}"))
}

#[tokio::test]
async fn a_server_without_fsync_shows_the_risk_and_refuse_stops_the_start() {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    let metrics = rg.metrics().await;
    assert_eq!(risk(&metrics, "fsync_off"), 1.0);
    assert_eq!(risk(&metrics, "full_page_writes_off"), 1.0);
    assert_eq!(risk(&metrics, "async_standby"), 0.0);
    assert_eq!(risk(&metrics, "no_sync_commit"), 0.0);
    // Warned, it serves: ready.
    let (status, _) = rg
        .http()
        .get(&format!("http://{}/readyz", rg.admin))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);

    let refused = crate::serve::serve(&pg.url(), REFUSE, std::future::pending())
        .await
        .expect_err("refused");
    let why = refused.to_string();
    assert!(matches!(refused, ServeError::Replication(_)), "{why}");
    assert!(
        why.contains("fsync is off")
            && why.contains("full_page_writes is off")
            && why.contains("database.replication_risk"),
        "{why}"
    );

    // A durable server starts refusing nothing.
    let durable = Pg::builder().durable(true).start().await.unwrap();
    let rg = Railguard::start(
        &durable.url(),
        &rail.url(),
        &[("RAILGUARD__DATABASE__REPLICATION_RISK", "refuse")],
    )
    .await;
    let metrics = rg.metrics().await;
    for name in [
        "async_standby",
        "no_sync_commit",
        "fsync_off",
        "full_page_writes_off",
    ] {
        assert_eq!(risk(&metrics, name), 0.0, "{name}");
    }
}

/// A standby streaming from the server (here `pg_receivewal`) that is not synchronous is a
/// risk, seen by the periodic check; named in `synchronous_standby_names`, it is not. The
/// main pool's `synchronous_commit = local` is a risk of its own; with "refuse", /readyz
/// fails while a risk is present.
#[tokio::test]
async fn a_standby_that_is_not_synchronous_is_a_risk_seen_while_running() {
    init_tracing();
    let pg = Pg::builder().durable(true).start().await.unwrap();
    let rail = Rail::start().await;
    let rg = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[
            ("RAILGUARD__GUARD__INTERVAL_MS", "100"),
            ("RAILGUARD__DATABASE__REPLICATION_RISK", "refuse"),
        ],
    )
    .await;
    let ready = || async {
        rg.http()
            .get(&format!("http://{}/readyz", rg.admin))
            .await
            .unwrap()
    };
    assert_eq!(ready().await.0, StatusCode::OK);
    let shows = |name: &'static str, value: f64| {
        let rg = &rg;
        async move {
            eventually(
                Duration::from_secs(20),
                format!("the risk {name} at {value}"),
                || async { (risk(&rg.metrics().await, name) == value).then_some(()) },
            )
            .await
        }
    };

    let wal = tempfile::tempdir().unwrap();
    let mut receiver = tokio::process::Command::new(pg.server.bin_dir().join("pg_receivewal"))
        .arg("-d")
        .arg(pg.url())
        .arg("-D")
        .arg(wal.path())
        .args(["--synchronous", "--no-loop", "-s", "1"])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    shows("async_standby", 1.0).await;
    let (status, body) = ready().await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("async_standby"), "{body}");

    let admin = pg.client().await;
    set_synchronous_standby_names(&pg, &admin, "pg_receivewal").await;
    shows("async_standby", 0.0).await;
    assert_eq!(ready().await.0, StatusCode::OK);

    // A role whose commits do not wait for the standby: railguard's sessions have it too.
    admin
        .batch_execute("ALTER ROLE CURRENT_USER SET synchronous_commit = local")
        .await
        .unwrap();
    let local = Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let metrics = local.metrics().await;
    assert_eq!(risk(&metrics, "no_sync_commit"), 1.0);
    assert_eq!(risk(&metrics, "async_standby"), 0.0);
    receiver.kill().await.unwrap();
}

/// The fence's compare-and-set committed locally, its wait for the synchronous standby
/// cancelled: 503, nothing forwarded, the idempotency record removed; the retry pays once.
#[tokio::test]
async fn a_compare_and_set_not_replicated_is_not_accepted_and_nothing_is_forwarded() {
    let World { pg, rail, rg, .. } = World::postgres(&[
        ("RAILGUARD__DATABASE__TIMEOUT_MS", "6000"),
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "20000"),
    ])
    .await;
    let lock = rg.lock_client();
    let proxy = RailClient::new(rg.proxy_url(""));
    let grant =
        support::payment::grant(&lock, "acct", "w1", Duration::from_secs(60), Duration::ZERO).await;

    // From now on every commit waits for a standby that never comes.
    let admin = pg.client().await;
    set_synchronous_standby_names(&pg, &admin, "nobody").await;

    let paying = {
        let (proxy, grant) = (proxy.clone(), grant.clone());
        tokio::spawn(async move {
            proxy
                .post(
                    &grant,
                    "acct",
                    "/payments",
                    "{\"id\":\"p1\"}".into(),
                    Some("pay-1"),
                )
                .await
        })
    };
    let waiting: i32 = eventually(
        Duration::from_secs(5),
        "a mark's insert waiting for synchronous replication",
        || async {
            admin
                .query_opt(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' \
                 AND query LIKE '%INSERT INTO rail_high_water%'",
                    &[],
                )
                .await
                .unwrap()
                .map(|row| row.get(0))
        },
    )
    .await;
    admin
        .execute("SELECT pg_cancel_backend($1)", &[&waiting])
        .await
        .unwrap();
    let answer = paying.await.unwrap().expect("an answer");
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let body: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(body["error"], "database_unavailable", "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("nothing was forwarded") && m.contains("retry")),
        "{body}"
    );
    assert!(rail.ledger().is_empty(), "the rail saw nothing");
    // The commit did happen locally: the mark moved, and the record is there until its
    // removal, which waits for the standby too, commits.
    assert_eq!(pg.mark("acct").await, Some(grant.token().get()));

    // Commits are replicated again (no synchronous standby): the record is removed, and the
    // retry with the same key is forwarded, once.
    set_synchronous_standby_names(&pg, &admin, "").await;
    eventually(
        Duration::from_secs(20),
        "pay-1's record removed",
        || async {
            let left = support::records::records_keyed(&admin, "pay-1").await;
            (left == 0).then_some(())
        },
    )
    .await;
    support::payment::paid_keyed(&proxy, &grant, "acct", r#"{"id":"p1"}"#, "pay-1").await;
    rail.assert_paid(1, "payments at the rail");
    assert!(
        rg.metrics()
            .await
            .get("railguard_requests_total{outcome=\"database_unavailable\"}")
            >= 1.0
    );
}

/// Sets `synchronous_standby_names` and waits until new sessions have it.
async fn set_synchronous_standby_names(pg: &Pg, admin: &tokio_postgres::Client, value: &str) {
    admin
        .batch_execute(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{value}'"
        ))
        .await
        .unwrap();
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "synchronous_standby_names reloaded",
        || async {
            let now: String = pg
                .one("SELECT current_setting('synchronous_standby_names')", &[])
                .await;
            (now == value).then_some(())
        },
    )
    .await;
    // The checkpointer tells waiting commits (or the next ones) after its own reload.
    tokio::time::sleep(Duration::from_millis(500)).await;
}
