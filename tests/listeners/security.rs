//! Authentication, authorisation, TLS and the listener limits under attack, over real
//! sockets: each test is one way a hostile client, a careless operator command or an
//! unauthenticated probe could get past them, and checks that it does not. (Renew and release
//! by another identity, one identity's waits, the account in the path and credential reloads
//! are tested in the `auth` module beside this one and `auth`'s unit tests.)

use railguard_testkit as support;
use support::World;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use railguard::auth::secret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::identities::{EU, EU2, JSON, READER, call, mark, setup};

async fn acquire(rg: &support::Railguard, secret: &str, key: &str) -> serde_json::Value {
    let reply = call(
        Method::POST,
        &format!("{}/v1/locks/{key}/acquire", rg.lock_url()),
        Some(secret),
        &JSON,
        r#"{"ttl_ms":10000}"#,
    )
    .await;
    reply.assert_status(StatusCode::OK);
    reply.json()
}

async fn pay(
    rg: &support::Railguard,
    secret: &str,
    account: &str,
    token: &str,
    proof: &str,
    key: &str,
) -> support::Reply {
    call(
        Method::POST,
        &rg.proxy_url("/payments"),
        Some(secret),
        &[
            ("content-type", "application/json"),
            ("fencing-token", token),
            ("fencing-account", account),
            ("fencing-proof", proof),
            ("idempotency-key", key),
        ],
        r#"{"amount":1}"#,
    )
    .await
}

/// A grant for key K is no grant for account A (the proof binds the key), another
/// identity's grant is refused even on an account it may pay on, and a 403 for a guessed
/// token reads the same whether the token is the live grant's or made up (§A2.3: nothing
/// confirms a token). Nothing forwarded, no mark moved.
#[tokio::test]
async fn grants_are_bound_to_key_and_identity_and_403s_confirm_no_token() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let g = acquire(rg, EU, "acct-eu-1").await;
    let token = g["token"].as_i64().unwrap().to_string();
    let proof = g["fencing_proof"].as_str().unwrap().to_string();

    // Key/account mismatch: eu's own grant of acct-eu-1, presented for acct-eu-2.
    let r = pay(rg, EU, "acct-eu-2", &token, &proof, "k1").await;
    r.assert_status(StatusCode::FORBIDDEN);
    // eu2 may pay on acct-eu-*, but the grant is eu's.
    let r = pay(rg, EU2, "acct-eu-1", &token, &proof, "k2").await;
    r.assert_status(StatusCode::FORBIDDEN);
    // Guessing: the live token and a made-up one, with a made-up proof, answer alike.
    let fake = format!("v2.{}", "0".repeat(64));
    let live = pay(rg, EU2, "acct-eu-1", &token, &fake, "k3").await;
    let made_up = pay(rg, EU2, "acct-eu-1", "999999", &fake, "k4").await;
    assert_eq!(live.status, made_up.status);
    let strip = |r: &support::Reply| {
        let mut v = r.json();
        v.as_object_mut().unwrap().remove("request_id");
        v.as_object_mut().unwrap().remove("token");
        v
    };
    assert_eq!(strip(&live), strip(&made_up));
    // Casing and near-misses of the account pattern.
    for account in ["acct-eu", "ACCT-EU-1", "acct-EU-1", "xacct-eu-1"] {
        let r = pay(rg, EU, account, &token, &proof, "k5").await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{account}: {}", r.body);
    }
    // Inside the pattern but not eu's granted key: dot segments, percent-encoding. No grant
    // can exist for them (a lock key is [A-Za-z0-9._:-]), so no proof can be made either, and
    // with proofs required such an account is refused as one that can never be paid.
    for account in [
        "acct-eu-1/../acct-us-1",
        "acct-eu-%31",
        "acct-eu-1%2F..%2Fx",
    ] {
        let r = pay(rg, EU, account, &token, &proof, "k8").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{account}: {}", r.body);
        assert!(
            r.body.contains("A-Z a-z 0-9 . _ : -"),
            "{account}: {}",
            r.body
        );
    }
    let denied = call(
        Method::GET,
        &format!("{}/v1/locks/acct-eu-1%2F..%2Fx", rg.lock_url()),
        Some(EU),
        &[],
        "",
    )
    .await;
    denied.assert_status(StatusCode::BAD_REQUEST);
    // No credentials, unknown credentials: 401.
    for secret in ["rgs_nobody"] {
        let r = pay(rg, secret, "acct-eu-1", &token, &proof, "k7").await;
        r.assert_status(StatusCode::UNAUTHORIZED);
    }
    assert!(s.rail.ledger().is_empty(), "nothing forwarded");
    assert_eq!(mark(rg, "acct-eu-1").await, 0, "no mark moved");
    let records: i64 =
        s.pg.one("SELECT count(*) FROM idempotency_record", &[])
            .await;
    assert_eq!(records, 0, "a 401 or 403 created an idempotency record");
    let ok = pay(rg, EU, "acct-eu-1", &token, &proof, "k6").await;
    ok.assert_status(StatusCode::CREATED);
}

/// While a request is in flight neither the header-read nor the idle timeout applies
/// (`http::connection::Activity::expired`), so the lock API's request body has a deadline of
/// its own (`lock::api::read_body`). Without it a client that sends a request head and then
/// nothing would hold a `max_in_flight` slot and a `max_connections` slot for ever: with
/// `max_in_flight` of them, every later lock request would get 503 until the attacker let go.
/// Here the attacker is an authenticated worker; with authentication off, anyone. Each silent
/// client is answered 408, saying that nothing was done.
#[tokio::test]
async fn lock_api_a_silent_request_body_does_not_hold_the_listener() {
    let s = setup(
        &[
            ("RAILGUARD__LOCK__MAX_IN_FLIGHT", "2"),
            ("RAILGUARD__LOCK__HEADER_READ_TIMEOUT_MS", "500"),
            ("RAILGUARD__LOCK__IDLE_TIMEOUT_MS", "1000"),
        ],
        false,
    )
    .await;
    let rg = &s.rg;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(rg.lock).await.unwrap();
        c.write_all(
            format!(
                "POST /v1/locks/acct-eu-9/acquire HTTP/1.1\r\nhost: x\r\n\
                 authorization: Bearer {EU}\r\ncontent-type: application/json\r\n\
                 content-length: 100\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        held.push(c);
    }
    // Well past both timeouts and any reasonable request deadline.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = call(
        Method::GET,
        &format!("{}/v1/locks/acct-eu-1", rg.lock_url()),
        Some(EU2),
        &[],
        "",
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "two silent request bodies still hold the lock listener after 4 s: {}",
        r.body
    );
    // Each silent client was told why, and that nothing was done.
    for mut c in held {
        let mut answer = vec![0; 512];
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut answer))
            .await
            .expect("an answer")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("nothing was done"), "{answer}");
    }
}

/// The operator commands (`marks`, `recover-account`, `idempotency-forget`, and `inspect` on
/// the lock listener) speak TLS to a listener that has TLS on. A command that spoke plain
/// `http://` to it would send `Authorization: Bearer $RAILGUARD_SECRET` in clear text to the
/// TLS port — over the network when `admin.listen` is not loopback — and only then fail.
#[tokio::test]
async fn operator_commands_never_send_the_secret_in_clear_to_a_tls_listener() {
    let pki = support::Pki::new();
    let server = pki.server("admin");
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("railguard.toml");
    std::fs::write(
        &config,
        format!(
            "[admin]\nlisten = \"{addr}\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n\
             [database]\nurl = \"postgres://127.0.0.1:1/x\"\n",
            server.cert.display(),
            server.key.display()
        ),
    )
    .unwrap();
    let received = tokio::spawn(async move {
        let mut seen = Vec::new();
        // A command that refuses to call sends nothing at all.
        let Ok(Ok((mut c, _))) = tokio::time::timeout(Duration::from_secs(8), tcp.accept()).await
        else {
            return seen;
        };
        let mut buf = vec![0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while let Ok(n) = c.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
                if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
        })
        .await;
        seen
    });
    let config2 = config.clone();
    let out = tokio::task::spawn_blocking(move || {
        support::railguard_command(
            &["marks", "acct-eu-1"],
            &config2,
            &[("RAILGUARD_SECRET", READER)],
        )
    })
    .await
    .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(15), received)
        .await
        .unwrap()
        .unwrap();
    assert!(!out.status.success(), "the command cannot have succeeded");
    let text = String::from_utf8_lossy(&seen);
    assert!(
        !text.contains(READER),
        "the operator's secret went to the TLS admin listener in clear text:\n{text}\n\
         (command said: {})",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// No secret, digest of a secret or Authorization header value reaches the
/// JSON log at debug level, for accepted, unknown and malformed credentials on all three
/// listeners.
#[tokio::test]
async fn no_secret_reaches_the_log() {
    let s = setup(&[("RAILGUARD__LOG__LEVEL", "debug")], true).await;
    let rg = &s.rg;
    const UNKNOWN: &str = "rgs_unknown_00000000000000000000000000000000000000000000000000000009";
    let g = acquire(rg, EU, "acct-eu-4").await;
    let token = g["token"].as_i64().unwrap().to_string();
    let proof = g["fencing_proof"].as_str().unwrap();
    assert_eq!(
        pay(rg, EU, "acct-eu-4", &token, proof, "k1").await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        pay(rg, UNKNOWN, "acct-eu-4", &token, proof, "k2")
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    for secret in [UNKNOWN, EU, READER] {
        let _ = call(
            Method::GET,
            &format!("http://{}/metrics", rg.admin),
            Some(secret),
            &[],
            "",
        )
        .await;
        let _ = call(
            Method::GET,
            &format!("{}/v1/locks/acct-eu-4", rg.lock_url()),
            Some(secret),
            &[],
            "",
        )
        .await;
    }
    let lease_secret = g["lease_secret"].as_str().unwrap();
    let log = rg.log();
    assert!(log.len() > 100, "a log was written");
    for needle in [
        EU,
        UNKNOWN,
        READER,
        &secret::digest_text(EU)[7..],
        lease_secret,
    ] {
        assert!(!log.contains(needle), "{needle} is in the log");
    }
    let ledger = s.rail.ledger();
    assert_eq!(ledger.len(), 1);
    assert!(ledger[0].header("authorization").is_none());
}

/// An `https://` rail whose certificate is from the trusted CA but names
/// another host is refused at the handshake; nothing reaches the rail.
#[tokio::test]
async fn an_https_rail_whose_certificate_names_another_host_is_refused() {
    support::init_tracing();
    let pki = support::Pki::new();
    let pg = support::Pg::start().await;
    let rail = support::Rail::start().await;
    let front =
        support::TlsFront::start(rail.addr, &pki.server_for("rail", "rail.example"), None).await;
    let rg = support::Railguard::start(
        &pg.url(),
        &front.url(),
        &[(
            "RAILGUARD__PROXY__UPSTREAM_CA_FILE",
            pki.ca.to_str().unwrap(),
        )],
    )
    .await;
    let reply = rg.http().pay_with(&rg, 7, "acct-wrong-host").await;
    reply.assert_status(StatusCode::BAD_GATEWAY);
    assert!(
        reply.json()["message"]
            .as_str()
            .unwrap()
            .contains("not sent"),
        "{}",
        reply.body
    );
    assert!(rail.ledger().is_empty(), "nothing reached the rail");
}

/// `max_headers` (431 past 100 headers by default) holds on HTTP/2 as on HTTP/1: hyper's
/// HTTP/1 builder enforces it there (`http::serve::serve`), and over HTTP/2 (h2c prior
/// knowledge here; `h2` by ALPN on a TLS listener) a request with 300 small headers must be
/// refused the same way, not read and served.
#[tokio::test]
async fn too_many_headers_over_http2_get_431_too() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let mut count = Vec::new();
    for http2 in [false, true] {
        count.push((http2, get_with_headers(rg, http2, 300, "v").await));
    }
    for (http2, status) in &count {
        assert!(
            matches!(status, Ok(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)),
            "http2={http2}: 300 headers were answered {status:?}"
        );
    }
}

/// The status of a lock-API GET with `count` extra headers of `value`, over HTTP/1 or HTTP/2.
async fn get_with_headers(
    rg: &support::Railguard,
    http2: bool,
    count: usize,
    value: &str,
) -> Result<StatusCode, String> {
    let mut request = Request::get(format!("{}/v1/locks/acct-eu-1", rg.lock_url()))
        .header("authorization", format!("Bearer {EU}"));
    for i in 0..count {
        request = request.header(format!("x-h{i:02}"), value);
    }
    let request = request.body(Full::new(Bytes::new())).unwrap();
    let client = if http2 {
        support::Http::http2()
    } else {
        support::Http::new()
    };
    tokio::time::timeout(Duration::from_secs(10), client.send(request))
        .await
        .unwrap()
        .map(|r| r.status)
        .map_err(|e| format!("{e:?}"))
}

/// An HTTP/2 frame: 9-byte header and payload.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A HEADERS frame without END_HEADERS followed by a CONTINUATION every
/// 200 ms for ever (the CONTINUATION trickle) is cut off by the header-read timeout, and
/// normal requests are served meanwhile.
#[tokio::test]
async fn a_never_ending_http2_continuation_is_cut_off() {
    let s = setup(
        &[("RAILGUARD__LOCK__HEADER_READ_TIMEOUT_MS", "1000")],
        false,
    )
    .await;
    let rg = &s.rg;
    let mut c = TcpStream::connect(rg.lock).await.unwrap();
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    c.write_all(&h2_frame(4, 0, 0, &[])).await.unwrap();
    // :method GET, :scheme http, :path / — indexed; no END_HEADERS (flag 0x4), END_STREAM.
    c.write_all(&h2_frame(1, 0x1, 1, &[0x82, 0x86, 0x84]))
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut closed_after = None;
    let mut buf = [0u8; 4096];
    let mut i = 0u32;
    while started.elapsed() < Duration::from_secs(6) {
        // A literal header without indexing: name "x-a", value "b".
        let sent = c
            .write_all(&h2_frame(
                9,
                0,
                1,
                &[0x00, 0x03, b'x', b'-', b'a', 0x01, b'b'],
            ))
            .await;
        if sent.is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        if i.is_multiple_of(5) {
            let r = call(
                Method::GET,
                &format!("{}/v1/locks/acct-eu-1", rg.lock_url()),
                Some(EU),
                &[],
                "",
            )
            .await;
            assert_eq!(r.status, StatusCode::OK, "served meanwhile");
        }
        i += 1;
        match tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed_after = Some(started.elapsed());
                break;
            }
            _ => {}
        }
    }
    let closed_after = closed_after.expect("the trickling connection was never closed");
    assert!(closed_after < Duration::from_secs(4), "{closed_after:?}");
}

/// An HTTP/2 request head over `max_header_bytes` is refused (by h2's
/// SETTINGS_MAX_HEADER_LIST_SIZE) and, like HTTP/1's parse error (`http::serve::http`),
/// counted in `railguard_listener_refusals_total{reason="headers_too_large"}`: every refusal
/// is counted, whichever protocol it came over.
#[tokio::test]
async fn an_oversized_http2_head_is_refused_and_counted() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let big = "a".repeat(40 * 1024);
    let request = Request::get(format!("{}/v1/locks/acct-eu-1", rg.lock_url()))
        .header("authorization", format!("Bearer {EU}"))
        .header("x-big", big.as_str())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        support::Http::http2().send(request),
    )
    .await
    .unwrap();
    let status = reply.as_ref().map(|r| r.status);
    assert!(
        !matches!(status, Ok(StatusCode::OK)),
        "a 40 KiB head was served over HTTP/2"
    );
    let m = call(
        Method::GET,
        &format!("http://{}/metrics", rg.admin),
        Some(READER),
        &[],
        "",
    )
    .await
    .body;
    let counted = m
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "railguard_listener_refusals_total{listener=\"lock\",reason=\"headers_too_large\"} ",
            )
        })
        .map(|v| v.trim().to_string());
    assert_eq!(
        counted.as_deref(),
        Some("1"),
        "answered {status:?}; the refusal was not counted"
    );
}

/// Clients that send a payment and hang up while the rail is slow do not
/// leak the proxy's `max_in_flight` slots: once the rail has answered, the listener serves
/// again (no permanent 503).
#[tokio::test]
async fn clients_that_hang_up_mid_payment_do_not_leak_in_flight_slots() {
    let World {
        pg: _pg,
        rail: _rail,
        rg,
        ..
    } = World::postgres_on(
        support::Rail::with_latency(Duration::from_millis(1500)).await,
        &[("RAILGUARD__PROXY__MAX_IN_FLIGHT", "2")],
    )
    .await;
    for (i, token) in [(0, 10), (1, 11)] {
        let mut c = TcpStream::connect(rg.proxy).await.unwrap();
        let account = format!("acct-hang-{i}");
        let proof = rg.proof(&account, token);
        let body = "{\"amount\":1}";
        c.write_all(
            format!(
                "POST /payments HTTP/1.1\r\nhost: x\r\nfencing-token: {token}\r\n\
                 fencing-account: {account}\r\nfencing-proof: {proof}\r\n\
                 content-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(c);
    }
    // The rail answers the two abandoned forwards after 1.5 s; then slots must be free.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for token in [20, 21, 22] {
        let reply = rg.http().pay_with(&rg, token, "acct-after").await;
        reply.assert_status(StatusCode::CREATED);
    }
}

/// `/readyz` needs no credentials (health probes), so while the token source is behind it
/// says so without numbers (`admin::Admin::ready`): the guard's log line has the position and
/// the highest fencing mark. The threat model says an unauthenticated caller reads nothing and
/// a mark is for operators only (ADR-002 §A2.3). With proofs required a mark alone pays for
/// nothing, but an unauthenticated read path is one the project promises not to have.
#[tokio::test]
async fn readyz_without_credentials_does_not_reveal_a_mark() {
    let s = setup(&[("RAILGUARD__GUARD__INTERVAL_MS", "200")], false).await;
    let rg = &s.rg;
    const POISON: i64 = 987_654_321_012;
    s.pg.client()
        .await
        .execute(
            "INSERT INTO rail_high_water (account_id, highest_token) VALUES ('acct-x', $1)",
            &[&POISON],
        )
        .await
        .unwrap();
    let body = support::eventually(
        Duration::from_secs(5),
        "the guard noticing the poisoned mark",
        || async {
            let r = call(
                Method::GET,
                &format!("http://{}/readyz", rg.admin),
                None,
                &[],
                "",
            )
            .await;
            (r.status == StatusCode::SERVICE_UNAVAILABLE).then_some(r.body)
        },
    )
    .await;
    assert!(
        !body.contains(&POISON.to_string()),
        "an unauthenticated /readyz revealed the highest mark: {body}"
    );
}

/// A head that HTTP/1 serves is served over HTTP/2 too. HTTP/1 applies `max_header_bytes`
/// to the bytes sent; measuring an HTTP/2 head as SETTINGS_MAX_HEADER_LIST_SIZE does (32
/// octets more a field, RFC 9113 §6.5.2) would refuse over HTTP/2, with 431, an 80-header,
/// ~31 KiB request that HTTP/1 answers 200.
#[tokio::test]
async fn a_head_served_over_http1_is_served_over_http2() {
    let s = setup(&[], false).await;
    let rg = &s.rg;
    let value = "v".repeat(380);
    let mut answers = Vec::new();
    for http2 in [false, true] {
        answers.push((http2, get_with_headers(rg, http2, 80, value.as_str()).await));
    }
    for (http2, status) in &answers {
        assert!(
            matches!(status, Ok(StatusCode::OK)),
            "http2={http2}: answered {status:?}"
        );
    }
}
