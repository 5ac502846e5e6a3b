//! A `database.url` that names several servers, as a client of a failover cluster writes it,
//! whose first server does not answer: a paused process, whose kernel still accepts
//! connections and nothing answers them (a primary stopped by SIGSTOP), or a frozen machine,
//! which does not even complete the TCP handshake (a VM stopped by its host). railguard passes
//! over it to the server that answers, for its start-up and for every pool's sessions, and says
//! which servers failed when none answers.

use railguard_testkit as support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::StatusCode;
use support::{Pg, Rail, Railguard, init_tracing};

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
        &[("RAILGUARD__DATABASE__TIMEOUT_MS", "1000")],
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
    let Err(error) = railguard::db::connect(&url, Duration::from_millis(300)).await else {
        panic!("no server answered, and yet a connection was made");
    };
    let text = error.to_string();
    for server in [first.addr, second.addr] {
        assert!(
            // Each of the two servers has half of the 300 ms.
            text.contains(&format!("{server}: no connection within 150 ms")),
            "{server} is named with what it did not do: {text}"
        );
    }
    assert!(
        first.accepted() > 0 && second.accepted() > 0,
        "both were tried"
    );
}

/// A pool tries first the server that answered its last new session: only its first session
/// pays for the paused server.
#[tokio::test]
async fn a_pool_goes_first_to_the_server_that_answered_it_last() {
    let pg = Pg::start().await;
    let paused = Paused::start().await;
    let url = first_named(paused.addr, &pg.url());
    let pool = railguard::db::build_pool(&url, 4, Duration::from_millis(1000)).unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        let session = pool
            .get()
            .await
            .expect("a session on the server that answers");
        let row = session.query_one("SELECT 1", &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 1);
        held.push(session); // held, so that the next one is a new session
    }
    assert_eq!(
        paused.accepted(),
        1,
        "four new sessions, and only the first went to the paused server"
    );
}
