//! A forward delayed in the network past its request deadline (the client got 504) keeps its
//! account's turn until the rail's late answer arrives: a newer grant's request sent meanwhile
//! waits, and reaches the rail after the late one — never before it (INV-05). The fault
//! harness's `rail-past-deadline` fault exercises this under load; these tests pin it over real
//! sockets.

use railguard_testkit as support;

use std::time::Duration;

use http::StatusCode;
use support::{Pg, Railguard, World, init_tracing};

/// A positive wait longer than the delay keeps the order too (a clock, but one the network did
/// not beat here).
#[tokio::test]
async fn a_newer_grant_never_overtakes_a_forward_that_is_late_in_the_network() {
    init_tracing();
    assert_eq!(
        arrival_order("30000", Duration::from_millis(1600)).await,
        ["5", "7"],
        "the late request reached the rail first, the newer one after it"
    );
}

/// The order the rail sees when token 5's request spends `delay` on its way there (its client
/// gets 504 at 1 s) and token 7 pays on the same account right after that 504.
async fn arrival_order(late_answer_wait_ms: &str, delay: Duration) -> Vec<String> {
    let (
        World {
            pg: _pg, rail, rg, ..
        },
        slow_path,
    ) = World::postgres_via_relay(&[
        ("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "1000"),
        ("RAILGUARD__PROXY__LATE_ANSWER_WAIT_MS", late_answer_wait_ms),
    ])
    .await;
    let http = rg.http();
    slow_path.set_delay(delay);
    let late = http.pay_with(&rg, 5, "acct-late").await;
    late.assert_status(StatusCode::GATEWAY_TIMEOUT);
    slow_path.set_delay(Duration::ZERO);
    let newer = http.pay_with(&rg, 7, "acct-late").await;
    newer.assert_status(StatusCode::CREATED);
    // Both have reached the rail before the ledger is read.
    tokio::time::sleep(delay).await;
    rail.ledger()
        .iter()
        .filter_map(|e| e.token.clone())
        .collect()
}

/// A request without an idempotency key runs in its client connection's task. If a client
/// that hangs up while the request is on its way to the rail took the account's turn with it,
/// a newer grant's request could reach the rail first. Its forward goes on without its client,
/// holding the turn.
#[tokio::test]
async fn a_client_that_hangs_up_does_not_let_a_newer_grant_overtake_its_forward() {
    let (
        World {
            pg: _pg, rail, rg, ..
        },
        slow_path,
    ) = World::postgres_via_relay(&[]).await;
    let http = rg.http();
    let delay = Duration::from_millis(1600);
    slow_path.set_delay(delay);
    let hung_up = tokio::time::timeout(
        Duration::from_millis(500),
        http.pay_with(&rg, 5, "acct-hangup"),
    )
    .await;
    assert!(hung_up.is_err(), "the client was to give up first");
    slow_path.set_delay(Duration::ZERO);
    let newer = http.pay_with(&rg, 7, "acct-hangup").await;
    newer.assert_status(StatusCode::CREATED);
    tokio::time::sleep(delay).await;
    let order: Vec<String> = rail
        .ledger()
        .iter()
        .filter_map(|e| e.token.clone())
        .collect();
    assert_eq!(
        order,
        ["5", "7"],
        "the newer grant's request overtook the one its client left"
    );
}

/// The model checker's "upstream timeout" scenario (docs/protocol.md): a finite
/// `late_answer_wait_ms` is a clock, and a forward held in the network longer than it is
/// overtaken by a newer grant's. With 0 (no limit) the turn passes on only when the rail
/// answers, so the same delay cannot reorder.
#[tokio::test]
async fn with_no_limit_on_the_late_answer_wait_no_delay_reorders_the_rail() {
    init_tracing();
    let delay = Duration::from_millis(1600);
    assert_eq!(
        arrival_order("1", delay).await,
        ["7", "5"],
        "a 1 ms wait passes the turn on while token 5 is still in the network"
    );
    assert_eq!(
        arrival_order("0", delay).await,
        ["5", "7"],
        "with no limit token 7 waited for the rail's answer to token 5"
    );
}

#[tokio::test]
async fn a_graceful_stop_waits_for_a_late_answer_within_its_grace() {
    let (world, slow_path) =
        World::postgres_process_via_relay(&[("RAILGUARD__PROXY__REQUEST_TIMEOUT_MS", "500")]).await;
    let (_pg, rail, mut rg) = world.parts();
    slow_path.set_delay(Duration::from_millis(1200));
    let late = rg.http().pay_with(&rg, 5, "acct-stop").await;
    late.assert_status(StatusCode::GATEWAY_TIMEOUT);
    // SIGTERM while the forward is still in the network: railguard waits for the rail's
    // answer (grace 3 s) before it exits.
    let status = rg.stop().await;
    assert!(status.success(), "{status}");
    rail.assert_paid(1, "the late request arrived before the exit");
    assert!(
        rg.log()
            .contains("waiting for the rail's answers to forwards still on their way"),
        "{}",
        rg.log()
    );
}

/// A keyed forward runs in a task of its own, which stopping the listeners does not end: it is
/// counted among the forwards a graceful stop waits for from its start, as a keyless one is, so
/// that the process does not exit under it — even once its client has left, when the
/// listeners have nothing left to drain.
#[tokio::test]
async fn a_graceful_stop_waits_for_a_keyed_forward_still_on_its_way() {
    let (world, slow_path) =
        World::postgres_process_via_relay(&[("RAILGUARD__SHUTDOWN__GRACE_MS", "4000")]).await;
    let (_pg, rail, mut rg) = world.parts();
    // The relay holds the keyed request once railguard has written it to the rail's connection.
    slow_path.stall_first(|chunk| chunk.windows(12).any(|w| w == b"keyed-stop-1"));
    let proof = rg.proof("acct-keyed-stop", 5);
    let url = rg.proxy_url("/payments");
    let http = rg.http();
    let paying = tokio::spawn(async move {
        http.pay(
            &url,
            &[
                ("Fencing-Token", "5"),
                ("Fencing-Account", "acct-keyed-stop"),
                ("Fencing-Proof", &proof),
                ("Idempotency-Key", "keyed-stop-1"),
            ],
            r#"{"account":"acct-keyed-stop","amount":100}"#,
        )
        .await
    });
    // The forward is on its way (the relay holds it) when its client leaves and SIGTERM comes:
    // no connection is left to drain, yet its forward counts.
    support::until(
        Duration::from_secs(10),
        "the keyed request written towards the rail",
        || async { slow_path.has_stalled() },
    )
    .await;
    paying.abort();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopping = tokio::spawn(async move {
        let status = rg.stop().await;
        (rg, status)
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !stopping.is_finished(),
        "the stop did not wait for the keyed forward"
    );
    slow_path.release_stalled();
    let (rg, status) = stopping.await.unwrap();
    assert!(status.success(), "{status}");
    assert!(
        rg.log()
            .contains("waiting for the rail's answers to forwards still on their way"),
        "the stop did not wait for the keyed forward: {}",
        rg.log()
    );
    rail.assert_paid(1, "the keyed request reached the rail before the exit");
}

/// A request without a body is marked "may have been sent" as soon as it is handed on (nothing
/// will ever ask for its body), yet one whose client hangs up while railguard is still
/// connecting to the rail must not be sent after its client has gone. Only a request handed to
/// a connection goes on without its client; one still connecting is dropped, and nothing
/// reaches the rail.
#[tokio::test]
async fn a_bodiless_request_whose_client_left_while_connecting_is_never_sent() {
    use bytes::Bytes;
    use http_body_util::Full;
    use tokio::io::AsyncReadExt;

    init_tracing();
    let pg = Pg::start().await;
    // A rail that does not accept yet, with its accept queue full: the kernel drops the SYN of
    // a new connection, and the connecting side tries again a second later.
    let mut rail = support::FullRail::start().await;
    let rg = Railguard::start(
        &pg.url(),
        &rail.url(),
        &[("RAILGUARD__PROXY__UPSTREAM_CONNECT_TIMEOUT_MS", "5000")],
    )
    .await;
    let request = http::Request::post(rg.proxy_url("/payments"))
        .header("Fencing-Token", "5")
        .header("Fencing-Account", "acct-bodiless")
        .header("Fencing-Proof", rg.proof("acct-bodiless", 5))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let gave_up = tokio::time::timeout(Duration::from_millis(700), rg.http().send(request)).await;
    assert!(
        gave_up.is_err(),
        "the client was to give up while railguard connected"
    );
    // The rail accepts now, long enough for railguard's connect to be tried again twice.
    rail.release();
    let mut received = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    while let Ok(Ok((mut stream, _))) =
        tokio::time::timeout_at(deadline, rail.listener.accept()).await
    {
        let mut bytes = vec![0; 4096];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(300), stream.read(&mut bytes)).await
        {
            received.extend_from_slice(&bytes[..n]);
        }
    }
    let received = String::from_utf8_lossy(&received);
    assert!(
        !received.contains("POST /payments"),
        "a request whose client had gone reached the rail:\n{received}"
    );
}
