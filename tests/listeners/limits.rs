//! The limits of a listener, over real sockets: oversized or too many headers get 431, a
//! connection past `max_connections` is closed at once, a request past `max_in_flight` gets
//! 503, clients trickling a request head a byte at a time are cut off by the header-read
//! timeout while normal requests are served, idle connections are closed — and each refusal
//! is counted.

use railguard_testkit as support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use prometheus::IntCounterVec;
use railguard::config::ListenerLimits;
use railguard::http::{Listener, Refusal, serve};
use support::{Http, Pg, Rail, Railguard, World, init_tracing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, oneshot};

/// A plain listener in this process. `GET /hold` is answered only once the test calls
/// [`Server::release`]; anything else at once with `ok`.
struct Server {
    addr: SocketAddr,
    refusals: IntCounterVec,
    /// A permit per `/hold` request that reached the service.
    held: Arc<Semaphore>,
    release: Arc<Notify>,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start(limits: ListenerLimits) -> Server {
        init_tracing();
        let refusals = Refusal::counter();
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let listener = Listener::new(tcp, "proxy")
            .with_limits(limits)
            .counting_refusals_in(refusals.clone());
        let held = Arc::new(Semaphore::new(0));
        let release = Arc::new(Notify::new());
        let (stop, stopped) = oneshot::channel::<()>();
        let (h, r) = (held.clone(), release.clone());
        tokio::spawn(serve(
            listener,
            move |_peer| {
                let (held, release) = (h.clone(), r.clone());
                hyper::service::service_fn(move |request: http::Request<_>| {
                    let (held, release) = (held.clone(), release.clone());
                    async move {
                        if request.uri().path() == "/hold" {
                            let released = release.notified();
                            held.add_permits(1);
                            released.await;
                        }
                        Ok::<_, Infallible>(Response::new(
                            Full::new(Bytes::from_static(b"ok")).map_err(|never| match never {}),
                        ))
                    }
                })
            },
            async move {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Server {
            addr,
            refusals,
            held,
            release,
            _stop: stop,
        }
    }

    fn refused(&self, reason: Refusal) -> u64 {
        crate::refusals::refused(&self.refusals, reason)
    }

    async fn wait_refused(&self, reason: Refusal, n: u64) {
        crate::refusals::wait_refused(&self.refusals, reason, n).await
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Sends `request` on a new connection and reads until the server closes it.
async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the server answers and closes");
    // A reset after the answer is the server closing with our unread bytes: fine.
    let _ = read;
    String::from_utf8_lossy(&answer).into_owned()
}

/// Reads from `stream` until the server closes it (bounded), discarding what it sent.
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    let wait = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .is_ok()
}

#[tokio::test]
async fn oversized_headers_and_too_many_headers_get_431() {
    let server = Server::start(ListenerLimits {
        max_header_bytes: 8192,
        max_headers: 10,
        ..ListenerLimits::default()
    })
    .await;
    let normal = raw(
        server.addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(normal.starts_with("HTTP/1.1 200"), "{normal}");

    let big = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let answer = raw(server.addr, big.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    server.wait_refused(Refusal::HeadersTooLarge, 1).await;

    let many: String = (0..20).map(|i| format!("X-H{i}: v\r\n")).collect();
    let answer = raw(
        server.addr,
        format!("GET / HTTP/1.1\r\nHost: x\r\n{many}\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    server.wait_refused(Refusal::HeadersTooLarge, 2).await;

    // Nine headers are within the limit of ten.
    let nine: String = (0..8).map(|i| format!("X-H{i}: v\r\n")).collect();
    let answer = raw(
        server.addr,
        format!("GET / HTTP/1.1\r\nHost: x\r\n{nine}Connection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
}

#[tokio::test]
async fn a_connection_past_max_connections_is_closed_at_once_and_the_listener_recovers() {
    let server = Server::start(ListenerLimits {
        max_connections: 2,
        ..ListenerLimits::default()
    })
    .await;
    // Two keep-alive connections, each proven accepted by an answer.
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = stream.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        open.push(stream);
    }
    // The third is accepted and closed without an answer.
    let answer = raw(server.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(answer, "", "closed without a response");
    server.wait_refused(Refusal::Connections, 1).await;
    let refused = Http::new().get(&server.url("/")).await;
    assert!(refused.is_err(), "{refused:?}");
    server.wait_refused(Refusal::Connections, 2).await;

    // One leaves: there is room again.
    drop(open.pop());
    let served = support::eventually(
        Duration::from_secs(3),
        "a connection served again",
        || async { Http::new().get(&server.url("/")).await.ok() },
    )
    .await;
    assert_eq!(served.0, StatusCode::OK);
}

/// A burst of 60 connections at a listener just started with `max_connections = 50`: exactly
/// the 10 past the limit are closed and the 50 stay open, on each of twenty starts, with the
/// accept loop and the connections on several threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_max_connections_right_after_start_closes_exactly_the_excess() {
    for start in 0..20 {
        let server = Server::start(ListenerLimits {
            max_connections: 50,
            ..ListenerLimits::default()
        })
        .await;
        let closed = burst(server.addr, 60).await;
        server.wait_refused(Refusal::Connections, 10).await;
        assert_eq!(
            closed, 10,
            "start {start}: 60 connections at 50 closed {closed}"
        );
    }
}

/// The same through railguard's proxy listener (`proxy.max_connections = 50`), on each of
/// five starts, counted by the client and in `railguard_listener_refusals_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_proxys_max_connections_right_after_start_closes_exactly_the_excess() {
    init_tracing();
    let pg = Pg::start().await;
    let rail = Rail::start().await;
    let key = "railguard_listener_refusals_total{listener=\"proxy\",reason=\"connections\"}";
    for start in 0..5 {
        let mut rg = Railguard::start(
            &pg.url(),
            &rail.url(),
            &[("RAILGUARD__PROXY__MAX_CONNECTIONS", "50")],
        )
        .await;
        let closed = burst(rg.proxy, 60).await;
        assert_eq!(
            closed, 10,
            "start {start}: 60 connections at 50 closed {closed}"
        );
        assert_eq!(rg.metrics().await.get(key), 10.0, "start {start}");
        rg.stop().await;
    }
}

/// Opens `n` connections at once to `addr` and returns how many the server closed within a
/// second, sending nothing on any (the header-read timeout is far longer).
async fn burst(addr: SocketAddr, n: usize) -> usize {
    let mut connecting = tokio::task::JoinSet::new();
    for _ in 0..n {
        connecting.spawn(async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut byte));
            // Keep every stream open until all are counted.
            (matches!(read.await, Ok(Ok(0) | Err(_))), stream)
        });
    }
    let mut closed = 0;
    let mut open = Vec::new();
    while let Some(joined) = connecting.join_next().await {
        let (was_closed, stream) = joined.unwrap();
        closed += usize::from(was_closed);
        open.push(stream);
    }
    closed
}

#[tokio::test]
async fn a_request_past_max_in_flight_gets_503_and_is_not_served() {
    let server = Server::start(ListenerLimits {
        max_in_flight: 1,
        ..ListenerLimits::default()
    })
    .await;
    let url = server.url("/hold");
    let holding = tokio::spawn(async move { Http::new().get(&url).await });
    let _permit = tokio::time::timeout(Duration::from_secs(10), server.held.acquire())
        .await
        .expect("the first request reaches the service")
        .unwrap();
    let (status, body) = Http::new().get(&server.url("/hold")).await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"], "overloaded");
    assert_eq!(server.refused(Refusal::InFlight), 1);
    assert_eq!(
        server.held.available_permits(),
        0,
        "the refused request never reached the service"
    );
    server.release.notify_waiters();
    let (status, _) = holding.await.unwrap().unwrap();
    assert_eq!(status, StatusCode::OK);
    // Its slot is free again once its response is done.
    let (status, _) = Http::new().get(&server.url("/")).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server.refused(Refusal::InFlight), 1);
}

#[tokio::test]
async fn clients_sending_one_header_byte_at_a_time_do_not_stop_others_and_are_cut_off() {
    let server = Server::start(ListenerLimits {
        header_read_timeout: Duration::from_millis(800),
        ..ListenerLimits::default()
    })
    .await;
    // Three slow clients, each trickling a request head that would never end, a byte every
    // 100 ms, until the server closes on them.
    let mut slow = Vec::new();
    for _ in 0..3 {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        slow.push(tokio::spawn(async move {
            let head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ";
            let mut sent = 0usize;
            for byte in head.iter().copied().chain(std::iter::repeat(b'a')) {
                if stream.write_all(&[byte]).await.is_err() {
                    break;
                }
                sent += 1;
                // Bounded: the header-read timeout ends this long before.
                if sent > 300 {
                    return Err(sent);
                }
                let mut buf = [0u8; 64];
                match tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buf)).await
                {
                    Err(_) => {}
                    Ok(Ok(0)) | Ok(Err(_)) => break,
                    Ok(Ok(_)) => return Err(sent),
                }
            }
            Ok(sent)
        }));
    }
    // Meanwhile normal requests are served, one after another, until every slow client has
    // been cut off.
    let http = Http::new();
    let mut served = 0;
    while slow.iter().any(|task| !task.is_finished()) {
        let (status, body) = http.get(&server.url("/")).await.unwrap();
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
        served += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served > 0);
    for task in slow {
        let sent = task.await.unwrap().expect("cut off, with no answer");
        assert!(sent > 1, "the slow client got a few bytes in first");
    }
    assert_eq!(server.refused(Refusal::HeaderTimeout), 3);
    assert_eq!(server.refused(Refusal::Idle), 0);
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed_but_a_long_request_is_not() {
    let server = Server::start(ListenerLimits {
        idle_timeout: Duration::from_millis(300),
        header_read_timeout: Duration::from_secs(5),
        ..ListenerLimits::default()
    })
    .await;
    // A request in flight for longer than the idle timeout is not idleness.
    let mut busy = TcpStream::connect(server.addr).await.unwrap();
    busy.write_all(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let _permit = server.held.acquire().await.unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    server.release.notify_waiters();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(10), busy.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    assert_eq!(server.refused(Refusal::Idle), 0);
    // Then, with nothing in flight, it is idle and closed.
    assert!(closed_by_server(&mut busy).await);
    server.wait_refused(Refusal::Idle, 1).await;
    assert_eq!(server.refused(Refusal::HeaderTimeout), 0);
}

#[tokio::test]
async fn railguard_answers_oversized_headers_431_and_counts_it_per_listener() {
    let (_pg, rail, rg) = World::postgres(&[("RAILGUARD__PROXY__MAX_HEADER_BYTES", "8192")])
        .await
        .parts();
    let big = format!(
        "POST /pay HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(10_000)
    );
    let answer = raw(rg.proxy, big.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    let key = "railguard_listener_refusals_total{listener=\"proxy\",reason=\"headers_too_large\"}";
    assert_eq!(rg.metric_reaches(key, 1.0).await, 1.0);
    assert!(rail.ledger().is_empty(), "nothing was forwarded");
    // The lock listener has its own limits and counts.
    assert_eq!(
        rg.metrics().await.get(
            "railguard_listener_refusals_total{listener=\"lock\",reason=\"headers_too_large\"}"
        ),
        0.0
    );
}
