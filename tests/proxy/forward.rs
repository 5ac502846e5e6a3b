//! The rail proxy end to end: real PostgreSQL, the rail simulator, and the `railguard`
//! binary, all over real sockets.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::{Http, Pg, Rail, Railguard, World, eventually, init_tracing};

const FENCED: &str = "lock_fenced_out_total";
const FORWARDED: &str = "railguard_requests_total{outcome=\"forwarded\"}";

async fn world() -> (Pg, Rail, Railguard) {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    (pg, rail, rg)
}

#[tokio::test]
async fn tokens_at_or_above_the_mark_pass_and_stale_tokens_are_fenced_out() {
    let (pg, rail, rg) = world().await;
    let http = rg.http();

    // The first token for a new account is accepted and becomes its mark.
    let reply = http.pay_with(&rg, 42, "acct-1").await;
    reply.assert_status(StatusCode::CREATED);
    assert_eq!(pg.mark("acct-1").await, Some(42));

    // An equal token is the same grant: accepted.
    assert_eq!(
        http.pay_with(&rg, 42, "acct-1").await.status,
        StatusCode::CREATED
    );
    // A larger token is a newer grant: accepted, mark advanced.
    assert_eq!(
        http.pay_with(&rg, 57, "acct-1").await.status,
        StatusCode::CREATED
    );
    assert_eq!(pg.mark("acct-1").await, Some(57));
    rail.assert_paid(3, "payments at the rail");
    let before = rg.metrics().await;

    // T-042's last step: the stalled survivor comes back with 42.
    let reply = http.pay_with(&rg, 42, "acct-1").await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    let body = reply.json();
    assert_eq!(body["error"], "fenced_out");
    assert_eq!(body["account"], "acct-1");
    assert_eq!(body["token"], 42);
    let keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "account",
            "error",
            "message",
            "origin",
            "request_id",
            "token"
        ],
        "the 409 carries these fields and nothing else"
    );
    for value in body.as_object().unwrap().values() {
        assert!(
            value != 57 && value != "57" && !value.as_str().is_some_and(|v| v.contains(" 57")),
            "the 409 must never reveal the mark: {}",
            reply.body
        );
    }
    rail.assert_paid(3, "the rail never saw the stale request");
    assert_eq!(pg.mark("acct-1").await, Some(57));

    let after = rg.metrics().await;
    assert_eq!(after.get(FENCED) - before.get(FENCED), 1.0);
    assert_eq!(
        after.get("railguard_requests_total{outcome=\"fenced_out\"}"),
        1.0
    );
    assert_eq!(after.get(FORWARDED), 3.0);
    assert_eq!(after.get("railguard_fencing_enforced"), 1.0);
    assert!(after.get("railguard_fence_check_duration_seconds_count{path=\"database\"}") >= 3.0);
    assert!(after.get("railguard_upstream_duration_seconds_count") >= 3.0);

    // Other accounts are independent, and the ledger recorded the headers the rail saw.
    assert_eq!(
        http.pay_with(&rg, 1, "acct-2").await.status,
        StatusCode::CREATED
    );
    let ledger = rail.ledger();
    let tokens: Vec<_> = ledger.iter().map(|e| e.token.clone().unwrap()).collect();
    assert_eq!(tokens, ["42", "42", "57", "1"]);
    assert_eq!(ledger[3].account.as_deref(), Some("acct-2"));
    assert_eq!(ledger[0].forwarded_for.as_deref(), Some("127.0.0.1"));
}

#[tokio::test]
async fn a_stale_token_is_fenced_even_when_the_mark_was_never_cached() {
    // Two railguards share one database: the second has never seen the account.
    let (pg, rail, rg1) = world().await;
    let rg2 = Railguard::start(&pg.url(), &rail.url(), &[]).await;
    let http = rg1.http();
    assert_eq!(
        http.pay_with(&rg1, 57, "shared").await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        http.pay_with(&rg2, 42, "shared").await.status,
        StatusCode::CONFLICT
    );
    rail.assert_paid(1, "payments at the rail");
    let m = rg2.metrics().await;
    assert_eq!(m.get(FENCED), 1.0);
    assert_eq!(
        m.get("railguard_fence_check_duration_seconds_count{path=\"cache\"}"),
        0.0
    );
}

#[tokio::test]
async fn malformed_fencing_headers_are_refused_and_never_forwarded() {
    let (_pg, rail, rg) = world().await;
    let http = rg.http();
    let url = rg.proxy_url("/payments");
    // The fencing headers by short names, so that each case is one line.
    const T: &str = "Fencing-Token";
    const A: &str = "Fencing-Account";
    let cases: &[(&str, &[(&str, &str)])] = &[
        ("missing token", &[(A, "a")]),
        ("empty token", &[(T, ""), (A, "a")]),
        ("non-numeric token", &[(T, "abc"), (A, "a")]),
        ("zero token", &[(T, "0"), (A, "a")]),
        ("negative token", &[(T, "-5"), (A, "a")]),
        ("plus sign", &[(T, "+5"), (A, "a")]),
        ("fraction", &[(T, "4.2"), (A, "a")]),
        ("overflowing token", &[(T, "9223372036854775808"), (A, "a")]),
        (
            "huge token",
            &[(T, "123456789012345678901234567890"), (A, "a")],
        ),
        ("repeated token", &[(T, "5"), (T, "6"), (A, "a")]),
        ("repeated equal token", &[(T, "5"), (T, "5"), (A, "a")]),
        ("comma-joined tokens", &[(T, "5, 6"), (A, "a")]),
        ("missing account", &[(T, "5")]),
        ("empty account", &[(T, "5"), (A, "")]),
        ("repeated account", &[(T, "5"), (A, "a"), (A, "b")]),
        ("account with a space", &[(T, "5"), (A, "a b")]),
    ];
    for (what, headers) in cases {
        let reply = http.pay(&url, headers, "{}").await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{what}: {}",
            reply.body
        );
        let body = reply.json();
        assert_eq!(body["error"], "bad_request", "{what}");
        assert!(
            body["message"].as_str().unwrap().contains("fencing-"),
            "{what}: {}",
            reply.body
        );
    }
    let long_account = "x".repeat(129);
    let reply = http
        .pay(
            &url,
            &[("Fencing-Token", "5"), ("Fencing-Account", &long_account)],
            "{}",
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);

    assert!(
        rail.ledger().is_empty(),
        "nothing malformed reached the rail"
    );
    let m = rg.metrics().await;
    assert_eq!(
        m.get("railguard_requests_total{outcome=\"bad_request\"}"),
        (cases.len() + 1) as f64
    );
    assert_eq!(m.get(FENCED), 0.0);
}

#[tokio::test]
async fn oversized_bodies_get_413_and_advance_nothing() {
    let (pg, rail, rg) = world().await;
    let mut rg = rg;
    rg.stop().await;
    let mut rg = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__PROXY__MAX_BODY_BYTES", "1024")],
    )
    .await;
    let big = "x".repeat(4096);
    let reply = rg.payment("a", 9).body(&big).send().await;
    reply.assert_status(StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        pg.mark("a").await,
        None,
        "a refused body never advances the mark"
    );
    assert!(rail.ledger().is_empty());
    let ok = rg.payment("a", 9).body("small").send().await;
    assert_eq!(ok.status, StatusCode::CREATED);
    rg.stop().await;
}

/// With proofs on (the default), an account is paid with a grant of its lock key, and lock keys
/// hold only `A-Z a-z 0-9 . _ : -`: an account outside that set could never be granted, so
/// it is refused at once, with the characters allowed named. With proofs off it is fenced as
/// any other.
#[tokio::test]
async fn an_account_no_lock_key_can_name_is_refused_while_proofs_are_required() {
    let (pg, rail, rg) = world().await;
    let http = rg.http();
    for account in ["a,b", "acct/1", "a%2Cb", "acct@eu", "a+b"] {
        // Even with a proof made for it (no grant could be: the lock API refuses the key).
        let reply = http.pay_with(&rg, 5, account).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{account}: {}",
            reply.body
        );
        let body = reply.json();
        assert_eq!(body["error"], "bad_request", "{account}");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains("fencing-account"), "{message}");
        assert!(message.contains("A-Z a-z 0-9 . _ : -"), "{message}");
        assert!(message.contains("fencing.require_proof"), "{message}");
        assert_eq!(pg.mark(account).await, None, "{account}: no mark moved");
    }
    assert!(rail.ledger().is_empty(), "nothing forwarded");
    assert!(
        rg.lock_client()
            .acquire("a,b", "w", Duration::from_secs(5), Duration::ZERO)
            .await
            .is_err(),
        "the lock API refuses such a key"
    );

    // Proofs off: the account is fenced and forwarded with an issued token.
    let grant = rg
        .lock_client()
        .acquire("acct-any", "w", Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap();
    let lenient = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__FENCING__REQUIRE_PROOF", "false")],
    )
    .await;
    let token = grant.token().get().to_string();
    let reply = support::Http::new()
        .pay(
            &lenient.proxy_url("/payments"),
            &[("Fencing-Token", &token), ("Fencing-Account", "a,b")],
            "{}",
        )
        .await;
    reply.assert_status(StatusCode::CREATED);
    assert_eq!(pg.mark("a,b").await, Some(grant.token().get()));
}

/// The contract's small print as docs/openapi.yaml states it: a lock key sent percent-encoded
/// is the key it decodes to; a 405 names in `Allow` what the path takes, on every listener;
/// the admin listener's errors are JSON in the shape of the other listeners' (an empty
/// account included, which its schema refuses too).
#[tokio::test]
async fn encoded_keys_allow_headers_and_admin_errors_are_as_documented() {
    let (_pg, _rail, rg) = world().await;
    let http = Http::new();
    let send = |method: &str, url: String, body: &str| {
        let request = http::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap();
        let http = http.clone();
        async move { http.send(request).await.expect("railguard answers") }
    };
    let lock = rg.lock_url();
    let acquire = r#"{"holder":"w","ttl_ms":5000}"#;

    // `%3A` is `:`: the grant is of `acct:1`, which is then held under either spelling.
    let granted = send("POST", format!("{lock}/v1/locks/acct%3A1/acquire"), acquire).await;
    granted.assert_status(StatusCode::OK);
    assert_eq!(granted.json()["key"], "acct:1");
    let again = send("POST", format!("{lock}/v1/locks/acct:1/acquire"), acquire).await;
    again.assert_status(StatusCode::CONFLICT);
    assert_eq!(again.json()["error"], "held");
    // A key that decodes to a character no key may hold is refused as that character is.
    let slash = send("POST", format!("{lock}/v1/locks/a%2Fb/acquire"), acquire).await;
    slash.assert_status(StatusCode::BAD_REQUEST);
    assert!(slash.body.contains("A-Z a-z 0-9"), "{}", slash.body);

    // 405 on the lock listener and on the admin listener: `Allow` says which method the path
    // takes; the admin listener's errors are JSON.
    let admin = format!("http://{}", rg.admin);
    for (listener, method, path, allow) in [
        (&lock, "POST", "/v1/locks/k", "GET"),
        (&lock, "GET", "/v1/locks/k/acquire", "POST"),
        (&lock, "DELETE", "/v1/locks/k/release", "POST"),
        (&admin, "DELETE", "/metrics", "GET"),
        (&admin, "POST", "/readyz", "GET"),
        (&admin, "GET", "/marks", "POST"),
        (&admin, "GET", "/idempotency/forget", "POST"),
    ] {
        let reply = send(method, format!("{listener}{path}"), "").await;
        assert_eq!(
            reply.status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}"
        );
        assert_eq!(reply.headers["allow"], allow, "{method} {path}");
        if listener == &admin {
            assert_eq!(reply.headers["content-type"], "application/json");
        }
        assert_eq!(reply.json()["error"], "method_not_allowed");
    }
    for (method, path, body, status, code) in [
        (
            "GET",
            "/no-such-route",
            "",
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/marks",
            r#"{"account":""}"#,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "POST",
            "/marks",
            "{not json",
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "POST",
            "/idempotency/forget",
            r#"{"account":"a","key":"never-sent"}"#,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
    ] {
        let reply = send(method, format!("{admin}{path}"), body).await;
        assert_eq!(
            reply.status, status,
            "{method} {path} {body}: {}",
            reply.body
        );
        assert_eq!(reply.headers["content-type"], "application/json", "{path}");
        let json = reply.json();
        assert_eq!(json["error"], code, "{path}");
        assert!(
            json["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{json}"
        );
    }
}

/// A chunked body over `proxy.max_body_bytes` gets 413 as soon as the limit is passed — by a
/// chunk's declared size, or by the bytes that arrived — not 408 at the request deadline:
/// nothing forwarded, no mark moved.
#[tokio::test]
async fn an_oversized_chunked_body_gets_413_at_once_and_advances_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (pg, rail, rg) = World::postgres(&[("RAILGUARD__PROXY__MAX_BODY_BYTES", "1024")])
        .await
        .parts();
    let over = "x".repeat(1025);
    let half = "y".repeat(512);
    let cases: [(&str, String); 4] = [
        // The first chunk alone says it is over the limit; its bytes never come.
        (
            "a 1 GiB first chunk, declared only",
            "40000000\r\n".to_string(),
        ),
        (
            "a chunk one byte over, declared only",
            "401\r\n".to_string(),
        ),
        ("a chunk one byte over, sent", format!("401\r\n{over}")),
        (
            "chunks within the limit, then one past it",
            format!("200\r\n{half}\r\n200\r\n{half}\r\n1\r\nz\r\n"),
        ),
    ];
    for (i, (case, body)) in cases.iter().enumerate() {
        let account = format!("acct-chunked-{i}");
        let head = format!(
            "POST /payments HTTP/1.1\r\nHost: rail\r\nFencing-Token: 9\r\n\
             Fencing-Account: {account}\r\nFencing-Proof: {}\r\n\
             Transfer-Encoding: chunked\r\n\r\n",
            rg.proof(&account, 9)
        );
        let mut stream = tokio::net::TcpStream::connect(rg.proxy).await.unwrap();
        let started = std::time::Instant::now();
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body.as_bytes()).await.unwrap();
        // The client keeps the connection open, as one still sending would.
        let mut answer = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("{case}: no answer"))
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
        let took = started.elapsed();
        assert!(answer.starts_with("HTTP/1.1 413"), "{case}: {answer}");
        assert!(answer.contains("body_too_large"), "{case}: {answer}");
        assert!(
            took < Duration::from_millis(1500),
            "{case}: answered after {took:?}, not at once (the request deadline is 3 s)"
        );
        assert_eq!(pg.mark(&account).await, None, "{case}: no mark moved");
    }
    assert!(rail.ledger().is_empty(), "nothing forwarded");
}

/// One burst: 50 concurrent requests for `account` with random tokens. Checks the rail's
/// ledger for that account and returns how many were fenced out.
async fn fifty_concurrent_random_tokens(
    pg: &Pg,
    rail: &Rail,
    rg: &Railguard,
    account: &str,
) -> usize {
    use std::hash::{BuildHasher, RandomState};
    let seed = RandomState::new();
    let tokens: Vec<i64> = (0..50u64)
        .map(|i| 1 + (seed.hash_one(i) % 200) as i64)
        .collect();
    let http = rg.http();
    let mut tasks = Vec::new();
    for token in tokens.clone() {
        let http = http.clone();
        let url = rg.proxy_url("/payments");
        let account = account.to_string();
        tasks.push(tokio::spawn(async move {
            let t = token.to_string();
            let reply = http
                .pay(
                    &url,
                    &[("Fencing-Token", &t), ("Fencing-Account", &account)],
                    "{}",
                )
                .await;
            (token, reply.status, reply.body)
        }));
    }
    let mut accepted = 0;
    let mut fenced = 0;
    for task in tasks {
        let (token, status, body) = task.await.unwrap();
        match status {
            StatusCode::CREATED => accepted += 1,
            StatusCode::CONFLICT => fenced += 1,
            other => panic!("token {token}: unexpected {other}: {body}"),
        }
    }
    let forwarded: Vec<i64> = rail
        .ledger()
        .iter()
        .filter(|e| e.account.as_deref() == Some(account))
        .map(|e| e.token.as_ref().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        forwarded.len(),
        accepted,
        "every 201 is one ledger entry, every 409 none"
    );
    assert_eq!(accepted + fenced, 50);
    for (i, t) in forwarded.iter().enumerate() {
        assert!(
            forwarded[..i].iter().all(|earlier| earlier <= t),
            "{account}: token {t} reached the rail after a larger one: {forwarded:?}"
        );
    }
    let max_forwarded = *forwarded.iter().max().unwrap();
    assert_eq!(
        pg.mark(account).await,
        Some(max_forwarded),
        "the final mark is the largest forwarded token"
    );
    assert_eq!(
        max_forwarded,
        *tokens.iter().max().unwrap(),
        "the largest token always passes"
    );
    fenced
}

#[tokio::test]
async fn fifty_concurrent_requests_reach_the_rail_in_token_order() {
    // A slow rail behind a jittery path: requests overlap, and without the proxy's ordering
    // they would arrive out of order. Four accounts' bursts run at once to widen the net.
    let World { pg, rail, rg, .. } = World::postgres_on(
        Rail::with_jitter(Duration::from_millis(5), Duration::from_millis(15)).await,
        &[],
    )
    .await;
    let bursts = ["hot-0", "hot-1", "hot-2", "hot-3"]
        .map(|a| fifty_concurrent_random_tokens(&pg, &rail, &rg, a));
    let fenced: usize = futures_join_all(bursts).await.into_iter().sum();
    assert_eq!(rg.metrics().await.get(FENCED), fenced as f64);
}

/// Polls every future to completion concurrently (no `futures` crate in the tree).
async fn futures_join_all<F: std::future::Future>(futures: [F; 4]) -> Vec<F::Output> {
    let [a, b, c, d] = futures;
    let (a, b, c, d) = tokio::join!(a, b, c, d);
    vec![a, b, c, d]
}

#[tokio::test]
async fn marks_survive_a_railguard_restart_and_a_postgres_restart() {
    let (mut pg, rail, mut rg) = world().await;
    let http = rg.http();
    assert_eq!(
        http.pay_with(&rg, 57, "k").await.status,
        StatusCode::CREATED
    );

    rg.restart().await;
    // A fresh process has an empty cache: the database alone fences.
    assert_eq!(
        http.pay_with(&rg, 42, "k").await.status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        http.pay_with(&rg, 57, "k").await.status,
        StatusCode::CREATED
    );

    // A PostgreSQL restart cannot be told from one that lost commits (a rewound data
    // directory): every token from before it is fenced once, above as below the mark, and
    // grants start again at the floor (store::epoch).
    pg.server.stop().await;
    pg.server.start().await.unwrap();
    rg.restart().await;
    let floor = pg
        .floor()
        .await
        .expect("railguard met the restarted server at its start");
    assert!(floor > 58);
    for token in [56, 58] {
        let reply = http.pay_with(&rg, token, "k").await;
        assert_eq!(reply.status, StatusCode::CONFLICT);
        assert_eq!(reply.json()["error"], "fenced_out");
    }
    // Forwards of newer grants wait out the hold after the change of server: 503, nothing sent.
    let paid = eventually(
        Duration::from_secs(30),
        "a payment of the floor's grant past the hold (not 503)",
        || async {
            let reply = http.pay_with(&rg, floor, "k").await;
            (reply.status != StatusCode::SERVICE_UNAVAILABLE).then_some(reply)
        },
    )
    .await;
    paid.assert_status(StatusCode::CREATED);
    assert_eq!(pg.mark("k").await, Some(floor));
    let tokens: Vec<_> = rail
        .ledger()
        .iter()
        .map(|e| e.token.clone().unwrap())
        .collect();
    assert_eq!(tokens, ["57".to_string(), "57".into(), floor.to_string()]);
}

#[tokio::test]
async fn postgres_down_means_503_and_nothing_forwarded_then_recovery() {
    let (mut pg, rail, rg) = world().await;
    let http = rg.http();
    assert_eq!(
        http.pay_with(&rg, 10, "k").await.status,
        StatusCode::CREATED
    );

    // A crash: connections die, nothing answers.
    pg.kill().await;
    for token in [11, 12] {
        let reply = http.pay_with(&rg, token, "k").await;
        reply.assert_status(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(reply.json()["error"], "database_unavailable");
        assert_eq!(reply.headers.get("retry-after").unwrap(), "1");
    }
    let (status, _) = http
        .get(&format!("http://{}/readyz", rg.admin))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    rail.assert_paid(1, "nothing was forwarded without a fence check");

    // The same railguard recovers on its own; the restart raised the fencing floor, and a
    // token above it pays.
    pg.server.start().await.unwrap();
    // The first request to meet the restarted server has it fenced; tokens above the new
    // floor pay.
    let recovered = support::within(Duration::from_secs(5), || async {
        let floor = pg.floor().await.unwrap_or(0);
        (http.pay_with(&rg, floor + 13, "k").await.status == StatusCode::CREATED).then_some(())
    })
    .await;
    assert!(
        recovered.is_ok(),
        "railguard recovers when PostgreSQL returns:\n{}",
        rg.log()
    );
    assert_eq!(
        http.pay_with(&rg, 9, "k").await.status,
        StatusCode::CONFLICT
    );
    rail.assert_paid(2, "payments at the rail");
    assert!(
        rg.metrics()
            .await
            .get("railguard_requests_total{outcome=\"database_unavailable\"}")
            >= 2.0
    );
}

#[tokio::test]
async fn postgres_that_stops_answering_gets_503_within_the_database_timeout() {
    let (pg, rail, rg) = world().await;
    let http = rg.http();
    assert_eq!(
        http.pay_with(&rg, 10, "k").await.status,
        StatusCode::CREATED
    );
    pg.pause().await;
    let reply = http.pay_with(&rg, 11, "k").await;
    pg.resume().await;
    reply.assert_status(StatusCode::SERVICE_UNAVAILABLE);
    rail.assert_paid(1, "payments at the rail");
    // The compare-and-set that timed out may have committed once PostgreSQL resumed: the
    // mark is 10 or 11, never anything else, and 11 is accepted either way.
    let mark = pg.mark("k").await;
    assert!(mark == Some(10) || mark == Some(11), "{mark:?}");
    assert_eq!(
        http.pay_with(&rg, 11, "k").await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn kill_switch_forwards_stale_tokens_and_counts_them() {
    let World { pg, rail, rg, .. } = World::postgres_process(
        Rail::start().await,
        &[("RAILGUARD__FENCING__ENFORCE", "false")],
    )
    .await;
    let http = rg.http();
    assert_eq!(rg.metrics().await.get("railguard_fencing_enforced"), 0.0);
    assert!(
        rg.log().contains("FENCING IS DISABLED"),
        "a loud warning at start:\n{}",
        rg.log()
    );

    assert_eq!(
        http.pay_with(&rg, 57, "k").await.status,
        StatusCode::CREATED
    );
    let reply = http.pay_with(&rg, 42, "k").await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "the stale request is forwarded: {}",
        reply.body
    );
    let tokens: Vec<_> = rail
        .ledger()
        .iter()
        .map(|e| e.token.clone().unwrap())
        .collect();
    assert_eq!(
        tokens,
        ["57", "42"],
        "the duplicate the switch exists to demonstrate"
    );
    let m = rg.metrics().await;
    assert_eq!(m.get("railguard_would_have_fenced_total"), 1.0);
    assert_eq!(m.get(FENCED), 0.0, "nothing was fenced out");
    assert_eq!(pg.mark("k").await, Some(57), "the mark never goes down");
}

#[tokio::test]
async fn upstream_failures_are_502_and_504() {
    init_tracing();
    let pg = Pg::start().await;
    let dead = format!("http://127.0.0.1:{}", support::free_loopback_port());
    let rg = Railguard::start(&pg.url(), &dead, &[]).await;
    let reply = Http::new().pay_with(&rg, 5, "k").await;
    reply.assert_status(StatusCode::BAD_GATEWAY);
    assert_eq!(reply.json()["error"], "upstream_unavailable");
    assert_eq!(reply.json()["origin"], "upstream");

    let slow = Rail::with_latency(Duration::from_secs(5)).await;
    let rg = Railguard::start(
        &pg.url(),
        &slow.url(),
        &[("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "300")],
    )
    .await;
    let reply = Http::new().pay_with(&rg, 6, "k").await;
    reply.assert_status(StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(reply.json()["error"], "upstream_timeout");
    let m = rg.metrics().await;
    assert_eq!(
        m.get("railguard_requests_total{outcome=\"upstream_timeout\"}"),
        1.0
    );
}

#[tokio::test]
async fn http2_clients_are_proxied_and_hop_by_hop_headers_dropped() {
    let (_pg, rail, rg) = world().await;
    let first = Http::http2().pay_with(&rg, 3, "h2").await;
    first.assert_status(StatusCode::CREATED);
    assert!(first.headers.contains_key("x-request-id"));

    let reply = rg
        .http()
        .pay(
            &rg.proxy_url("/payments?x=1"),
            &[
                ("Fencing-Token", "3"),
                ("Fencing-Account", "h2"),
                ("Connection", "x-private, keep-alive"),
                ("Keep-Alive", "timeout=5"),
                ("TE", "trailers"),
                ("Proxy-Authorization", "Basic eDp5"),
                ("X-Private", "secret"),
                ("X-Forwarded-For", "10.1.2.3"),
                ("X-Request-Id", "client-7"),
            ],
            "{}",
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let ledger = rail.ledger();
    assert_eq!(ledger.len(), 2);
    // The id railguard gave the first request is the one the rail saw; the client's own id
    // goes to the rail and comes back.
    assert_eq!(
        ledger[0].header("x-request-id"),
        first
            .headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
    );
    assert_eq!(reply.headers["x-request-id"], "client-7");
    let seen = &ledger[1];
    assert_eq!(seen.header("x-request-id"), Some("client-7"));
    assert_eq!(seen.path, "/payments?x=1", "path and query reach the rail");
    assert_eq!(seen.header("x-forwarded-for"), Some("10.1.2.3, 127.0.0.1"));
    for hop in [
        "connection",
        "keep-alive",
        "te",
        "proxy-authorization",
        "transfer-encoding",
        "x-private",
    ] {
        assert_eq!(
            seen.header(hop),
            None,
            "{hop} is hop-by-hop and must not be forwarded"
        );
    }
    assert_eq!(
        seen.header("host"),
        Some(rail.addr.to_string().as_str()),
        "Host is the rail's"
    );
    assert_eq!(
        seen.header("x-forwarded-host"),
        Some(rg.proxy.to_string().as_str())
    );
    assert_eq!(seen.header("via"), Some("1.1 railguard"));
    assert_eq!(
        seen.header("fencing-token"),
        Some("3"),
        "end-to-end headers pass"
    );
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests() {
    let (_pg, rail, mut rg) =
        World::postgres_process(Rail::with_latency(Duration::from_millis(500)).await, &[])
            .await
            .parts();
    let in_flight = rg.payment("d", 1).body("{}").spawn();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let status = rg.stop().await;
    assert!(status.success(), "clean exit: {status}");
    assert_eq!(
        in_flight.await.unwrap().status,
        StatusCode::CREATED,
        "the in-flight request finished"
    );
    rail.assert_paid(1, "payments at the rail");
}

#[tokio::test]
async fn bad_config_stops_start_up_naming_the_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[proxy]\nlisten = \"127.0.0.1:1\"\nupstrem = \"http://x\"\n",
    )
    .unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("upstrem"),
        "{stderr}"
    );

    std::fs::write(&path, "").unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("RAILGUARD__DATABASE__POOL_SIZE", "lots")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("RAILGUARD__DATABASE__POOL_SIZE") && stderr.contains("database.pool_size"),
        "{stderr}"
    );
}

#[tokio::test]
async fn unreachable_database_url_fails_start_up_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = support::config_without_a_database(dir.path(), "");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_railguard"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot connect to PostgreSQL") && !stderr.contains(":pw@"),
        "{stderr}"
    );
}

/// What a reverse proxy must refuse or say: `CONNECT` and bad `Host` headers are refused, and
/// `Via` names the protocol.
#[tokio::test]
async fn connect_and_bad_host_headers_are_refused_and_via_names_the_protocol() {
    let (pg, rail, rg) = World::postgres(&[]).await.parts();
    // Raw HTTP/1.1, so that Host can be left out or repeated.
    async fn raw(addr: std::net::SocketAddr, head: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut answer)).await;
        String::from_utf8_lossy(&answer).into_owned()
    }
    let fencing =
        "Fencing-Token: 5\r\nFencing-Account: acct-h\r\nContent-Length: 2\r\nConnection: close\r\n";
    for (case, host) in [
        ("no Host", String::new()),
        (
            "two Hosts",
            "Host: a.example\r\nHost: b.example\r\n".to_string(),
        ),
        ("invalid Host", "Host: a b/c\r\n".to_string()),
        ("empty Host", "Host: \r\n".to_string()),
        (
            "Host with userinfo",
            "Host: user@rail.example\r\n".to_string(),
        ),
        (
            "Host with a port over 65535",
            "Host: rail.example:99999\r\n".to_string(),
        ),
        ("Host with port 0", "Host: rail.example:0\r\n".to_string()),
        (
            "Host with an empty port",
            "Host: rail.example:\r\n".to_string(),
        ),
        ("Host with only a port", "Host: :8080\r\n".to_string()),
    ] {
        let answer = raw(
            rg.proxy,
            &format!("POST /payments HTTP/1.1\r\n{host}{fencing}\r\n{{}}"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{case}: {answer}");
        assert!(answer.contains("\"error\""), "{case}: JSON body: {answer}");
        assert!(
            answer.contains("header host"),
            "{case}: names the header: {answer}"
        );
    }
    // Valid forms are forwarded: a name with a port, and an IPv6 literal with one.
    for (i, host) in ["rail.example:8443", "[::1]:9090", "127.0.0.1"]
        .iter()
        .enumerate()
    {
        let account = format!("acct-host-{i}");
        let proof = rg.proof(&account, 5);
        let answer = raw(
            rg.proxy,
            &format!(
                "POST /payments HTTP/1.1\r\nHost: {host}\r\nFencing-Token: 5\r\n\
                 Fencing-Account: {account}\r\nFencing-Proof: {proof}\r\n\
                 Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 201"), "{host}: {answer}");
    }
    let answer = raw(
        rg.proxy,
        &format!(
            "CONNECT rail.example:443 HTTP/1.1\r\nHost: rail.example:443\r\n{fencing}\r\n{{}}"
        ),
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 405"),
        "CONNECT refused: {answer}"
    );
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nallow: get, head, post, put, delete, options, trace, patch\r\n"),
        "a 405 names the methods forwarded: {answer}"
    );
    rail.assert_paid(3, "only the valid Hosts reached the rail");
    assert_eq!(pg.mark("acct-h").await, None, "no mark moved");

    // HTTP/2 arrives at the rail as HTTP/1.1, and Via says what railguard received.
    let reply = Http::http2().pay_with(&rg, 5, "acct-h2").await;
    reply.assert_status(StatusCode::CREATED);
    let via = rail.ledger()[3].header("via").map(str::to_string);
    assert_eq!(via.as_deref(), Some("2 railguard"));
}

/// `runtime.worker_threads` sets how many threads `railguard serve` runs its tasks on (0, the
/// default, is one per CPU; `railguard_runtime_worker_threads` says what the runtime has), and
/// a process on one thread still fences and forwards. tokio's `TOKIO_WORKER_THREADS` is not
/// read: the configuration alone decides, and a value tokio would panic on cannot stop
/// railguard.
#[tokio::test]
async fn serve_runs_on_the_configured_worker_threads() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let cpus = std::thread::available_parallelism().unwrap().get();
    for (setting, threads) in [("1", 1), ("3", 3), ("0", cpus)] {
        let rg = Railguard::start_process(
            &pg.url(),
            &rail.url(),
            &[
                ("RAILGUARD__RUNTIME__WORKER_THREADS", setting),
                ("TOKIO_WORKER_THREADS", "lots"),
            ],
        )
        .await;
        assert_eq!(
            rg.metrics().await.get("railguard_runtime_worker_threads"),
            threads as f64,
            "worker_threads = {setting}"
        );
        let http = rg.http();
        let token = 10 + threads as i64;
        let account = format!("threads-{setting}");
        assert_eq!(
            http.pay_with(&rg, token, &account).await.status,
            StatusCode::CREATED
        );
        assert_eq!(
            http.pay_with(&rg, token - 1, &account).await.status,
            StatusCode::CONFLICT
        );
    }
}

/// When the system refuses the worker threads `runtime.worker_threads` asks for (here an
/// address-space limit too small for 256 thread stacks), `serve` says so and exits 1 — tokio
/// panics in that case, and an unwinding that waited for the threads it had started would
/// wait forever.
#[tokio::test]
async fn serve_refused_its_worker_threads_says_so_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("railguard.toml");
    std::fs::write(
        &config,
        "[database]\nurl = \"postgres://nobody@127.0.0.1:1/none\"\n[runtime]\nworker_threads = 256\n",
    )
    .unwrap();
    let mut child = tokio::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -v 300000 && exec \"$0\" serve --config \"$1\"",
        ])
        .arg(support::railguard_binary())
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("serve neither started nor exited within 30 s")
        .unwrap();
    let mut text = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.contains("cannot start the async runtime with 256 worker threads"),
        "{text}"
    );
}
