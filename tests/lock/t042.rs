//! T-042, the stalled survivor, exactly as SPEC.md tells it, once per lock backend:
//!
//! W1 acquires account k (token t1) and stalls longer than its lease; the lease expires; W2
//! takes k (t2 > t1), writes paydb and submits to the rail (high-water t2); W1 wakes, and its
//! paydb write and its submit with t1 are refused — 409 FencedOut, no rail entry, paydb
//! unchanged by W1, `lock_fenced_out_total` +1 — and both tokens are in the JSON logs of the
//! request spans. Real railguard process, real PostgreSQL, real etcd, real sockets.

use railguard_testkit as support;

use std::time::Duration;

use railguard::sdk::SdkError;
use railguard::sdk::paydb::{FencedUpdate, PayDbError};
use support::payment::grant;
use support::{EtcdCluster, Pg, Rail, Railguard, init_tracing};

async fn t042(etcd: Option<EtcdCluster>) {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let endpoints = etcd.as_ref().map(|e| e.endpoints_csv()).unwrap_or_default();
    let mut env = vec![
        // respond's "finished processing request" line, written in the request's span, so that
        // an accepted request is in the log too.
        (
            "RAILGUARD__LOG__LEVEL",
            "info,railguard::proxy::respond=debug",
        ),
    ];
    if etcd.is_some() {
        env.push(("RAILGUARD__LOCK__BACKEND", "etcd"));
        env.push(("RAILGUARD__ETCD__ENDPOINTS", &endpoints));
    }
    let rg = Railguard::start_process(&pg.url(), &rail.url(), &env).await;
    let lock = rg.lock_client();
    let proxy = railguard::sdk::RailClient::new(rg.proxy_url(""));
    let ttl = if etcd.is_some() {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(300)
    };

    // paydb: the worker's own table, fenced by the SDK (C1 §1.6).
    let paydb = pg.client().await;
    paydb
        .batch_execute(
            "CREATE TABLE account (id text PRIMARY KEY, balance bigint NOT NULL, \
             fence bigint NOT NULL DEFAULT 0); INSERT INTO account VALUES ('k', 1000, 0);",
        )
        .await
        .unwrap();
    let debit = FencedUpdate::new("account").unwrap();
    let fenced_before = rg.metrics().await.get("lock_fenced_out_total");

    // W1 acquires k and stalls (no keep-alive) past its lease.
    let w1 = grant(&lock, "k", "w1", ttl, Duration::ZERO).await;
    let t1 = w1.token().get();
    // W2 waits for k and takes it once W1's lease has expired.
    let w2 = grant(&lock, "k", "w2", Duration::from_secs(30), ttl * 10).await;
    let t2 = w2.token().get();
    assert!(
        t2 > t1,
        "the new grant's token {t2} is above the stalled one's {t1}"
    );

    // W2 writes paydb and submits: the rail's high-water for k becomes t2.
    debit
        .execute(&paydb, &w2, &"k", "balance = balance - $3", &[&100i64])
        .await
        .unwrap();
    support::payment::paid_keyed(&proxy, &w2, "k", r#"{"amount":100}"#, "pay-w2").await;

    // W1 wakes up and carries on with t1: paydb refuses it, the proxy refuses it.
    let stale_write = debit
        .execute(&paydb, &w1, &"k", "balance = balance - $3", &[&100i64])
        .await;
    assert!(
        matches!(stale_write, Err(PayDbError::FencedOut { token, .. }) if token == t1),
        "{stale_write:?}"
    );
    let stale = support::payment::pay_keyed(&proxy, &w1, "k", r#"{"amount":100}"#, "pay-w1").await;
    match stale {
        Err(SdkError::FencedOut {
            account,
            token,
            body,
        }) => {
            assert_eq!((account.as_str(), token), ("k", t1));
            // The 409 names the account and the presented token, never the mark (C2 §2.2).
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            let fields = body.as_object().unwrap();
            assert!(fields.values().all(|v| v.as_i64() != Some(t2)), "{body}");
        }
        other => panic!("W1's stale submit must be fenced out: {other:?}"),
    }

    // No side effect of W1 anywhere.
    let ledger = rail.ledger();
    assert_eq!(
        ledger.len(),
        1,
        "the rail saw W2's payment only: {ledger:?}"
    );
    assert_eq!(ledger[0].token.as_deref(), Some(t2.to_string().as_str()));
    let row = paydb
        .query_one("SELECT balance, fence FROM account WHERE id = 'k'", &[])
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (900, t2),
        "paydb moved once, by W2"
    );
    assert_eq!(
        rg.metrics().await.get("lock_fenced_out_total"),
        fenced_before + 1.0
    );

    // Both tokens in the JSON logs of the request spans: W2's accepted, W1's refused.
    let log = rg.log();
    let span_tokens: Vec<i64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            v["spans"]
                .as_array()?
                .iter()
                .find(|s| s["name"] == "proxy.request")
                .and_then(|s| s["lock.token"].as_i64())
        })
        .collect();
    assert!(
        span_tokens.contains(&t2),
        "t2 = {t2} in a request span:\n{log}"
    );
    assert!(
        span_tokens.contains(&t1),
        "t1 = {t1} in a request span:\n{log}"
    );
    drop(etcd);
}

#[tokio::test]
async fn t042_the_stalled_survivor_postgres() {
    t042(None).await;
}

#[tokio::test]
async fn t042_the_stalled_survivor_etcd() {
    t042(Some(EtcdCluster::single().await)).await;
}
