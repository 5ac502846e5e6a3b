//! What becomes of a keyed request's idempotency record (its `RecordGuard`) when the forward
//! ends badly: a client that hangs up or resets its HTTP/2 stream mid-forward, a rail that
//! reads the head and resets or refuses the connection, a database that is away when an
//! unsent request's record must go. A payment the rail may have received is never forwarded
//! twice; the record of one it cannot have received is removed, so that a retry goes through.
//! Also: a stopped in-process railguard stops serving, and every configuration key has a
//! working environment override. Over real sockets, real PostgreSQL and the rail simulator.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, World, init_tracing, until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A payment with `Idempotency-Key: key` and an EMPTY body, over a raw HTTP/1.1 socket that
/// is closed `after` the request was written (the client gives up mid-forward).
async fn pay_empty_then_hang_up(
    rg: &Railguard,
    token: i64,
    account: &str,
    key: &str,
    after: Duration,
) {
    let proof = rg.proof(account, token);
    let mut s = TcpStream::connect(rg.proxy).await.unwrap();
    let req = format!(
        "POST /payments HTTP/1.1\r\nHost: rail\r\nFencing-Token: {token}\r\n\
         Fencing-Account: {account}\r\nFencing-Proof: {proof}\r\nIdempotency-Key: {key}\r\n\
         Content-Length: 0\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    tokio::time::sleep(after).await;
    drop(s); // the client is gone; the rail has (or has not) the payment already
}

async fn record_state(pg: &Pg, account: &str, key: &str) -> Option<String> {
    pg.client()
        .await
        .query_opt(
            "SELECT state FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2",
            &[&account, &key],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// The scenario for both modes: an empty-body payment reaches a slow rail, its client hangs up
/// while the rail is still working on it, and the client retries with the same key later.
async fn empty_body_client_gone_mid_forward(env: &[(&str, &str)]) {
    let (pg, rail, rg) =
        World::postgres_on(Rail::with_latency(Duration::from_millis(1500)).await, env)
            .await
            .parts();
    tokio::join!(
        pay_empty_then_hang_up(&rg, 5, "acct-e", "pay-e", Duration::from_millis(500)),
        rail.until_paid(1)
    );
    rail.assert_paid(1, "the payment reached the rail");
    // Let the rail answer (or not), and the proxy do what it does with the record.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let state = record_state(&pg, "acct-e", "pay-e").await;
    let retry = rg.payment("acct-e", 5).key("pay-e").body("").send().await;
    assert_eq!(
        rail.ledger().len(),
        1,
        "the retry of a payment that reached the rail was forwarded again (paid twice); \
         record state before the retry: {state:?}; retry answer {} {}",
        retry.status,
        retry.body
    );
}

/// Enforcing: the owner's forward runs in a task of its own, so a client that hangs up does not
/// cancel it; its record is completed and the retry is replayed.
#[tokio::test]
async fn enforced_empty_body_client_gone_mid_forward_is_not_paid_twice() {
    empty_body_client_gone_mid_forward(&[]).await;
}

/// Kill switch off (C5 §5.2): fencing is off, but idempotency keys are still honoured (records
/// are still made by the compare-and-set). The forward runs in the connection's task; a client
/// that hangs up drops it, the RecordGuard sees MaybeSent unset (an empty body is never asked
/// for), and forgets the record of a payment the rail has received.
#[tokio::test]
async fn kill_switch_empty_body_client_gone_mid_forward_is_not_paid_twice() {
    empty_body_client_gone_mid_forward(&[("RAILGUARD__FENCING__ENFORCE", "false")]).await;
}

/// A stopped in-process railguard must stop serving: its listeners refuse connections and a
/// keep-alive connection opened before the stop no longer gets answers.
#[tokio::test]
async fn in_process_stop_refuses_connections() {
    let (pg, _rail, mut rg) = World::postgres(&[]).await.parts();
    let (proxy, admin, lock) = (rg.proxy, rg.admin, rg.lock);
    // An idle keep-alive connection open across the stop.
    let mut kept = TcpStream::connect(admin).await.unwrap();
    kept.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    assert!(rg.stop().await.success());
    for addr in [proxy, admin, lock] {
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "{addr} still accepts after stop()"
        );
    }
    let _ = kept
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let n = tokio::time::timeout(Duration::from_secs(2), kept.read(&mut buf))
        .await
        .expect("the kept connection is closed, not left hanging")
        .unwrap_or(0);
    assert_eq!(
        n,
        0,
        "a kept-alive connection was served after stop(): {}",
        String::from_utf8_lossy(&buf[..n])
    );
    // Its instance lock is gone with it, as a process's would be.
    until(
        Duration::from_secs(1),
        "the stopped railguard's instance lock released",
        || async {
            let held: i64 = pg
                .client()
                .await
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            held == 0
        },
    )
    .await;
    rg.start_again().await;
    assert_eq!(
        rg.http().pay_with(&rg, 3, "after").await.status,
        StatusCode::CREATED
    );
}

/// Every key of the configuration can be overridden from the environment, and the override
/// lands in that key (and no other).
#[test]
fn every_key_has_a_working_environment_override() {
    use railguard::config::Config;
    use std::collections::BTreeMap;
    let defaults = toml::Table::try_from(Config::default()).unwrap();
    let mut checked = 0;
    for (section, keys) in &defaults {
        let toml::Value::Table(keys) = keys else {
            panic!("{section} is not a table")
        };
        for (key, default) in keys {
            let dotted = format!("{section}.{key}");
            let (raw, want): (String, toml::Value) = match (dotted.as_str(), default) {
                ("proxy.listen", _) => ("127.0.0.1:18080".into(), "127.0.0.1:18080".into()),
                ("admin.listen", _) => ("127.0.0.1:19100".into(), "127.0.0.1:19100".into()),
                ("lock.listen", _) => ("127.0.0.1:17070".into(), "127.0.0.1:17070".into()),
                ("proxy.upstream", _) => {
                    ("http://10.0.0.9:9999".into(), "http://10.0.0.9:9999".into())
                }
                (k, _) if k.ends_with("_header") => {
                    ("X-Override-Header".into(), "x-override-header".into())
                }
                ("lock.backend", _) => ("etcd".into(), "etcd".into()),
                ("etcd.endpoints", _) => (
                    "http://10.0.0.1:2379, http://10.0.0.2:2379".into(),
                    toml::Value::Array(vec![
                        "http://10.0.0.1:2379".into(),
                        "http://10.0.0.2:2379".into(),
                    ]),
                ),
                ("etcd.key_prefix", _) => ("/override/".into(), "/override/".into()),
                ("etcd.tls_ca_file", _) | ("etcd.tls_cert_file", _) | ("etcd.tls_key_file", _) => {
                    ("/tmp/x.pem".into(), "/tmp/x.pem".into())
                }
                ("proxy.upstream_ca_file", _)
                | ("proxy.upstream_cert_file", _)
                | ("proxy.upstream_key_file", _)
                | ("database.tls_ca_file", _) => ("/tmp/x.pem".into(), "/tmp/x.pem".into()),
                ("database.url", _) => ("postgres://u@h/db".into(), "postgres://u@h/db".into()),
                ("auth.credentials_file", _) => (
                    "/tmp/override-creds.toml".into(),
                    "/tmp/override-creds.toml".into(),
                ),
                ("database.data_dir", _) => ("/tmp/override-pg".into(), "/tmp/override-pg".into()),
                ("fencing.account_in_path", _) => {
                    ("/accounts/{account}/".into(), "/accounts/{account}/".into())
                }
                ("fencing.lock_key_template", _) => {
                    ("pay:{account}".into(), "pay:{account}".into())
                }
                (k, _)
                    if k.ends_with(".tls_cert_file")
                        || k.ends_with(".tls_key_file")
                        || k.ends_with(".tls_client_ca_file") =>
                {
                    ("/tmp/x.pem".into(), "/tmp/x.pem".into())
                }
                (k, _) if k.ends_with(".tls_client_auth") => ("required".into(), "required".into()),
                ("rail_lookup.path", _) => (
                    "/payments?account={account}&idempotency_key={key}".into(),
                    "/payments?account={account}&idempotency_key={key}".into(),
                ),
                ("log.format", _) => ("json".into(), "json".into()),
                ("database.replication_risk", _) => ("refuse".into(), "refuse".into()),
                ("log.level", _) => ("debug".into(), "debug".into()),
                (_, toml::Value::Integer(i)) => ((i + 1).to_string(), toml::Value::Integer(i + 1)),
                (_, toml::Value::Boolean(b)) => ((!b).to_string(), toml::Value::Boolean(!b)),
                (k, v) => panic!("no test value for {k} = {v:?}"),
            };
            let var = format!(
                "RAILGUARD__{}__{}",
                section.to_uppercase(),
                key.to_uppercase()
            );
            let mut env = BTreeMap::from([(var.clone(), raw.clone())]);
            // tls files need each other and https endpoints; etcd keys are checked only with etcd.
            if dotted == "etcd.tls_cert_file" {
                env.insert("RAILGUARD__ETCD__TLS_KEY_FILE".into(), "/tmp/k.pem".into());
            }
            if dotted == "etcd.tls_key_file" {
                env.insert("RAILGUARD__ETCD__TLS_CERT_FILE".into(), "/tmp/c.pem".into());
            }
            // A listener's TLS keys need each other too: a certificate with its key, and client
            // certificates with a CA and a certificate of the listener's own.
            let listener_tls = ["tls_cert_file", "tls_key_file", "tls_client_ca_file"];
            let companions: &[&str] = match key.as_str() {
                "tls_cert_file" => &["tls_key_file"],
                "tls_key_file" => &["tls_cert_file"],
                "tls_client_ca_file" | "tls_client_auth" => &listener_tls,
                _ => &[],
            };
            for companion in companions {
                env.entry(format!(
                    "RAILGUARD__{}__{}",
                    section.to_uppercase(),
                    companion.to_uppercase()
                ))
                .or_insert_with(|| "/tmp/c.pem".into());
            }
            if key == "tls_client_ca_file" {
                env.insert(
                    format!("RAILGUARD__{}__TLS_CLIENT_AUTH", section.to_uppercase()),
                    "optional".into(),
                );
            }
            // The rail's TLS files need an https:// upstream, its CA, and each other.
            if dotted.starts_with("proxy.upstream_") && dotted.ends_with("_file") {
                env.insert(
                    "RAILGUARD__PROXY__UPSTREAM".into(),
                    "https://10.0.0.9:9999".into(),
                );
                env.entry("RAILGUARD__PROXY__UPSTREAM_CA_FILE".into())
                    .or_insert_with(|| "/tmp/ca.pem".into());
            }
            // A shared proxy address needs a shared database, not the embedded one.
            if dotted == "proxy.reuse_port" {
                env.insert(
                    "RAILGUARD__DATABASE__URL".into(),
                    "postgres://u@h/db".into(),
                );
            }
            if dotted == "proxy.upstream_cert_file" {
                env.insert(
                    "RAILGUARD__PROXY__UPSTREAM_KEY_FILE".into(),
                    "/tmp/k.pem".into(),
                );
            }
            if dotted == "proxy.upstream_key_file" {
                env.insert(
                    "RAILGUARD__PROXY__UPSTREAM_CERT_FILE".into(),
                    "/tmp/c.pem".into(),
                );
            }
            let config = Config::parse("", "empty.toml", &env)
                .unwrap_or_else(|e| panic!("{var}={raw:?} refused: {e}"));
            let got = toml::Table::try_from(&config).unwrap();
            assert_eq!(
                got[section][key], want,
                "{var}={raw:?} did not land in {dotted}"
            );
            for (s, ks) in &got {
                for (k, v) in ks.as_table().unwrap() {
                    if (s, k) != (section, key)
                        && !env.keys().any(|e| e.ends_with(&k.to_uppercase()))
                    {
                        assert_eq!(v, &defaults[s][k], "{var} also changed {s}.{k}");
                    }
                }
            }
            checked += 1;
        }
    }
    // Every key has a default and an override, and the sample file documents each of them.
    let documented: toml::Table =
        toml::from_str(include_str!("../../config/railguard.toml")).unwrap();
    let documented: usize = documented
        .values()
        .map(|keys| keys.as_table().map_or(0, |t| t.len()))
        .sum();
    assert_eq!(checked, documented, "every key of config/railguard.toml");
}

/// A rail that reads each request's head (and whatever body came with it in the same read)
/// and then resets the connection without answering. Counts the heads it saw.
async fn resetting_rail() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                #[allow(deprecated)]
                let _ = s.set_linger(Some(Duration::ZERO));
                drop(s); // RST
            });
        }
    });
    (addr, seen)
}

/// A rail that saw the request's head and reset: the request may have reached it, so its record
/// must be in doubt and a retry must not be forwarded — with or without a body.
#[tokio::test]
async fn a_rail_that_reads_the_head_and_resets_leaves_the_record_in_doubt() {
    use std::sync::atomic::Ordering;
    init_tracing();
    let pg = Pg::start().await;
    let (rail, seen) = resetting_rail().await;
    let rg = Railguard::start(&pg.url(), &format!("http://{rail}"), &[]).await;
    for (key, body) in [("reset-empty", ""), ("reset-body", "{\"amount\":1}")] {
        let before = seen.load(Ordering::SeqCst);
        let pay = || rg.payment("acct-r", 9).key(key).body(body).send();
        let first = pay().await;
        assert_eq!(
            first.status,
            StatusCode::BAD_GATEWAY,
            "{key}: {}",
            first.body
        );
        assert!(
            seen.load(Ordering::SeqCst) > before,
            "{key}: the rail saw the head"
        );
        until(
            Duration::from_secs(1),
            format!("{key}'s record in doubt"),
            || async { record_state(&pg, "acct-r", key).await.as_deref() == Some("in_doubt") },
        )
        .await;
        let seen_now = seen.load(Ordering::SeqCst);
        let retry = pay().await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{key}: {}", retry.body);
        assert_eq!(retry.json()["error"], "in_doubt");
        assert_eq!(
            seen.load(Ordering::SeqCst),
            seen_now,
            "{key}: not forwarded again"
        );
    }
}

/// HTTP/2 client, fencing enforced, empty body: the client resets its stream while the rail is
/// working on the payment. The owner's forward goes on in its own task, completes, and the retry
/// is replayed.
#[tokio::test]
async fn http2_client_reset_mid_forward_with_an_empty_body_is_not_paid_twice() {
    let (_pg, rail, rg) =
        World::postgres_on(Rail::with_latency(Duration::from_millis(1500)).await, &[])
            .await
            .parts();
    let h2 = rg.http2();
    let task = rg
        .payment("acct-h2", 5)
        .key("pay-h2")
        .body("")
        .over(&h2)
        .spawn();
    rail.until_paid(1).await;
    rail.assert_paid(1, "payments at the rail");
    task.abort();
    drop(h2);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let retry = rg
        .payment("acct-h2", 5)
        .key("pay-h2")
        .body("")
        .over(&rg.http2())
        .send()
        .await;
    assert_eq!(
        rail.ledger().len(),
        1,
        "paid twice: retry {} {}",
        retry.status,
        retry.body
    );
    assert_eq!(
        retry
            .headers
            .get("idempotency-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
}

/// An empty-body payment is marked "maybe sent" as it is handed to the client (it has no body
/// to ask for). When the rail refuses the connection, nothing can have been received: the
/// record must be forgotten, not left in doubt, so that the worker's retry goes through once
/// the rail is back — without anyone running `idempotency-forget`.
#[tokio::test]
async fn an_empty_body_payment_to_a_rail_that_refuses_connections_leaves_no_record() {
    init_tracing();
    let pg = Pg::start().await;
    // A port nobody listens on: every connect is refused.
    let port = support::free_loopback_port();
    let upstream = format!("http://127.0.0.1:{port}");
    let rg = Railguard::start(&pg.url(), &upstream, &[]).await;

    let refused = rg
        .payment("acct-refused", 5)
        .key("k-empty")
        .body("")
        .send()
        .await;
    refused.assert_status(StatusCode::BAD_GATEWAY);
    // The guard forgets in the background; give it a moment, then look.
    until(
        Duration::from_secs(2),
        "the record of a never-connected forward forgotten",
        || async { record_state(&pg, "acct-refused", "k-empty").await.is_none() },
    )
    .await;

    // The same key again, now against a rail that listens: forwarded, once.
    let rail = Rail::start().await;
    let rg2 = Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let retried = rg2
        .payment("acct-refused", 5)
        .key("k-empty")
        .body("")
        .send()
        .await;
    retried.assert_status(StatusCode::CREATED);
    rail.assert_paid(1, "payments at the rail");
}

/// The record of a request that never reached the rail is deleted, and the delete is retried
/// in the background until the database takes it. Deleted with one attempt, a database that
/// did not answer at that moment would leave it in flight, and a retry with the same key would
/// be refused (`in_flight`, then `in_doubt`) although the rail never saw the payment.
#[tokio::test]
async fn an_unsent_requests_record_goes_once_the_database_answers_again() {
    init_tracing();
    let state = unsent_record_after_an_outage(Duration::from_millis(700), "10000").await;
    assert_eq!(
        state, None,
        "the record of a request that never reached the rail is removed once the database answers"
    );
}

/// Past its owner's deadline a record is reported in doubt, which holds until an operator
/// lifts it; the background delete of an unsent request's record, retried after that, must
/// not lift it on its own.
#[tokio::test]
async fn an_unsent_requests_record_stays_in_doubt_once_its_deadline_has_passed() {
    init_tracing();
    // Request deadline 2 s: the record is in doubt about 5 s after it was made (the deadline,
    // the database timeout and a second); the database is back after that.
    let state = unsent_record_after_an_outage(Duration::from_millis(6000), "2000").await;
    assert_eq!(
        state.as_deref(),
        Some("in_flight"),
        "a record past its deadline (reported in doubt) is left for an operator"
    );
}

/// A keyed payment whose forward cannot connect (a rail whose accept queue is full), with
/// PostgreSQL stopped cleanly while it connects and started again `outage` after the answer;
/// the record's stored state a few seconds later (`None`: removed).
async fn unsent_record_after_an_outage(
    outage: Duration,
    request_timeout_ms: &str,
) -> Option<String> {
    let mut pg = Pg::start().await;
    let rail = support::FullRail::start().await;
    let rg = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[
            ("RAILGUARD__PROXY__UPSTREAM_CONNECT_TIMEOUT_MS", "1500"),
            ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", request_timeout_ms),
        ],
    )
    .await;
    let paying = rg
        .payment("acct-unsent", 5)
        .key("k-unsent")
        .body("{}")
        .spawn();
    // The record is made with the compare-and-set; once the forward is connecting, the
    // database stops (a clean stop: a statement sent to it later is never run).
    until(
        Duration::from_secs(5),
        "the record made by the compare-and-set",
        || async { record_state(&pg, "acct-unsent", "k-unsent").await.is_some() },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    pg.server.stop().await;
    assert!(
        !paying.is_finished(),
        "the forward was still connecting when the database stopped: the first delete meets it"
    );
    let refused = paying.await.unwrap();
    refused.assert_status(StatusCode::BAD_GATEWAY);
    assert!(refused.body.contains("not sent"), "{}", refused.body);
    tokio::time::sleep(outage).await;
    pg.server.start().await.unwrap();
    // Background retries back off to at most 5 s between attempts.
    let removed = support::within(Duration::from_secs(7), || async {
        record_state(&pg, "acct-unsent", "k-unsent")
            .await
            .is_none()
            .then_some(())
    })
    .await;
    drop(rail);
    match removed {
        Ok(()) => None,
        Err(_) => record_state(&pg, "acct-unsent", "k-unsent").await,
    }
}
