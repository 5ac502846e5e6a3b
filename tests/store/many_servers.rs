//! A `database.url` that names several servers, as a client of a failover cluster writes it,
//! whose first server does not answer: a paused process, whose kernel still accepts
//! connections and nothing answers them (a primary stopped by SIGSTOP), or a frozen machine,
//! which does not even complete the TCP handshake (a VM stopped by its host). railguard passes
//! over it to the server that answers, for its start-up and for every pool's sessions, and says
//! which servers failed when none answers. A slow server is still heard while the next is
//! tried, and a pool starts where it last connected only when it asks for a server that takes
//! writes.

use railguard_testkit as support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, Relay, eventually, init_tracing};

/// A server that does not answer: either its kernel accepts connections and nothing answers
/// them (a paused process; what it accepted is counted), or it does not even complete the TCP
/// handshake (a frozen machine: its accept queue is full, so the kernel drops each SYN).
struct Paused {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Paused {
    /// A paused process: its kernel accepts, nothing answers.
    async fn start() -> Paused {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(stream);
            }
        });
        Paused {
            addr,
            accepted,
            task,
        }
    }

    /// A frozen machine: a listener with no room in its accept queue, which one connection
    /// never accepted fills, so that every later connection's SYN goes unanswered.
    async fn frozen() -> Paused {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let filler = tokio::net::TcpStream::connect(addr).await.unwrap();
        let next = tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr),
        );
        assert!(
            next.await.is_err(),
            "with its accept queue full, the listener leaves a connection unopened"
        );
        let task = tokio::spawn(async move {
            let _held = (listener, filler);
            std::future::pending::<()>().await;
        });
        Paused {
            addr,
            accepted: Arc::default(),
            task,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `url` (`postgres://user@host:port/db`) with `first` named before its server, and
/// `target_session_attrs=read-write`, as a failover cluster's clients write it.
fn first_named(first: SocketAddr, url: &str) -> String {
    let at = url.find('@').expect("the URL names a user") + 1;
    format!(
        "{}{first},{}?target_session_attrs=read-write",
        &url[..at],
        &url[at..]
    )
}

/// railguard serves through `url`, whose first server is `first`: a keyed payment reaches
/// the rail once, and its repeat is answered from its record.
async fn serves_past(first: &Paused, pg: &Pg) {
    let rail = Rail::start().await;
    let url = first_named(first.addr, &pg.url());
    // Each pool's sessions, the instance lock, the handover and the lock service's listener
    // all connect through the URL: every one must get past the first server.
    let rg = Railguard::start_process(
        &url,
        &rail.url(),
        &[("RAILGUARD__DATABASE__TIMEOUT_MS", "2000")],
    )
    .await;
    for _ in 0..2 {
        rg.payment("acct-1", 5)
            .key("first-payment")
            .body("{}")
            .expect(StatusCode::CREATED)
            .send()
            .await;
    }
    assert_eq!(
        rail.tokens(),
        [5],
        "the payment reached the rail once, and its repeat was answered from its record"
    );
    let log = rg.log();
    assert!(
        log.lines()
            .any(|line| line.contains("did not connect")
                && line.contains(&format!("{}", first.addr))),
        "the server passed over is named in the log: {log}"
    );
}

#[tokio::test]
async fn a_paused_server_named_first_is_passed_over_for_the_one_that_answers() {
    init_tracing();
    let pg = Pg::start().await;
    let paused = Paused::start().await;
    serves_past(&paused, &pg).await;
    assert!(
        paused.accepted() > 0,
        "the paused server was tried first, so the test shows it was passed over"
    );
}

#[tokio::test]
async fn a_frozen_server_named_first_is_passed_over_for_the_one_that_answers() {
    init_tracing();
    let pg = Pg::start().await;
    serves_past(&Paused::frozen().await, &pg).await;
}

#[tokio::test]
async fn when_no_server_answers_the_error_names_each_of_them() {
    let first = Paused::start().await;
    let second = Paused::start().await;
    let url = format!("postgres://rg@{},{}/rg", first.addr, second.addr);
    let Err(error) = railguard::db::connect(&url, Duration::from_millis(1000)).await else {
        panic!("no server answered, and yet a connection was made");
    };
    let text = error.to_string();
    for server in [first.addr, second.addr] {
        assert!(
            text.contains(&format!("{server}: no connection within ")),
            "{server} is named with what it did not do: {text}"
        );
    }
    assert!(
        first.accepted() > 0 && second.accepted() > 0,
        "both were tried"
    );
}

/// A pool tries first the server that answered its last new connection: only its first connection
/// pays for the paused server.
#[tokio::test]
async fn a_pool_goes_first_to_the_server_that_answered_it_last() {
    let pg = Pg::start().await;
    let paused = Paused::start().await;
    let url = first_named(paused.addr, &pg.url());
    let pool = railguard::db::build_pool(&url, 4, Duration::from_millis(2000)).unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        let session = pool
            .get()
            .await
            .expect("a session on the server that answers");
        let row = session.query_one("SELECT 1", &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 1);
        held.push(session); // held, so that the next one is a new connection
    }
    assert_eq!(
        paused.accepted(),
        1,
        "four new connections, and only the first went to the paused server"
    );
}

/// A server that answers slowly (TLS and authentication over a long round trip, say) is still
/// heard while the next one is tried: here the first server's start-up is held until the
/// second, which does not answer, has been tried too, and the session is the first's.
#[tokio::test]
async fn a_slow_server_is_still_heard_while_the_next_is_tried() {
    let pg = Pg::start().await;
    let slow = Relay::start(format!("127.0.0.1:{}", pg.server.port()).parse().unwrap()).await;
    slow.stall_first(|_| true);
    let paused = Paused::start().await;
    let url = format!(
        "{}?target_session_attrs=read-write",
        slow.postgres_url(&pg.url())
    );
    let url = url.replacen(
        &format!(":{}/", slow.addr.port()),
        &format!(":{},{}/", slow.addr.port(), paused.addr),
        1,
    );
    let pool = railguard::db::build_pool(&url, 1, Duration::from_millis(4000)).unwrap();
    let session = tokio::spawn(async move {
        let session = pool.get().await.map_err(|e| e.to_string())?;
        let row = session
            .query_one("SELECT 1", &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok::<i32, String>(row.get(0))
    });
    eventually(
        Duration::from_secs(10),
        "the second server tried once the first had had its share",
        || async { (paused.accepted() == 1).then_some(()) },
    )
    .await;
    slow.release_stalled();
    assert_eq!(
        session.await.unwrap(),
        Ok(1),
        "the first server, answering after its share, gave the session"
    );
}

/// The server a pool's last new connection went to is where the next starts only when the URL
/// asks for a server that takes writes: with `target_session_attrs=any` a server that answered
/// may be a standby, so the next connection starts with the URL's first server again.
#[tokio::test]
async fn only_a_pool_that_asks_for_writes_starts_where_it_last_connected() {
    let first = Pg::start().await;
    let second = Pg::start().await;
    let path = Relay::start(
        format!("127.0.0.1:{}", first.server.port())
            .parse()
            .unwrap(),
    )
    .await;
    let both = |attrs: &str| {
        let url = path.postgres_url(&first.url());
        url.replacen(
            &format!(":{}/", path.addr.port()),
            &format!(":{},127.0.0.1:{}/", path.addr.port(), second.server.port()),
            1,
        ) + "?target_session_attrs="
            + attrs
    };
    for (attrs, then) in [
        ("any", first.server.port()),
        ("read-write", second.server.port()),
    ] {
        let pool = railguard::db::build_pool(&both(attrs), 2, Duration::from_millis(2000)).unwrap();
        // The first server cut off for a second: the pool's first connection goes to the second.
        path.cut_for(Duration::from_secs(1));
        let one = pool.get().await.unwrap();
        assert_eq!(server_port(&one).await, second.server.port(), "{attrs}");
        tokio::time::sleep(Duration::from_millis(1500)).await; // the cut is over
        let two = pool.get().await.unwrap();
        assert_eq!(
            server_port(&two).await,
            then,
            "{attrs}: where the next connection starts"
        );
    }
}

/// The port of the server `session` is on.
async fn server_port(session: &tokio_postgres::Client) -> u16 {
    let row = session
        .query_one("SELECT current_setting('port')::int", &[])
        .await
        .unwrap();
    u16::try_from(row.get::<_, i32>(0)).unwrap()
}
