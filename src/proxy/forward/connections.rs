//! The rail's HTTP/1.1 connections, each driven by the task of the request that uses it.
//!
//! hyper-util's pooled client runs every connection as a task of its own: a forward handed its
//! request to that task through a channel and was woken by it with the answer, whose body came
//! over another channel — two hand-offs between tasks per forward, often between the runtime's
//! threads, on the path of every payment. Here a connection is hyper's [`SendRequest`] and
//! its [`Connection`] kept together ([`Conn`]): the forward's own task polls the connection
//! while it waits for the answer's head, and the answer's body ([`RailBody`]) polls it while
//! it is read, so the rail's bytes wake the task that needs them and nothing else.
//!
//! A connection goes back to the idle list only once its answer was read to the end and hyper
//! says it can take another request (not while it still writes the request, say, to a rail
//! that answered early). One dropped before that is closed: HTTP/1 cannot abandon an
//! exchange and keep its connection, and hyper's client does the same. Before an idle
//! connection is used it is polled once, so that a close the rail sent while it sat idle is
//! seen and it is discarded rather than written to, and a request a connection handed back
//! before writing any of it (hyper returns it) is tried on another one, as hyper-util's
//! client does for a connection it reuses.
//!
//! Nobody's request polls an idle connection, so the idle ones wake the reaper instead: what
//! the rail does to one (a close, a stray byte) wakes it, and it closes those that cannot be
//! used any more, at most ten times a second; it also closes those idle past the idle timeout.

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

use super::Tracked;
use crate::proxy::BoxError;
use crate::tls::client::{RailConnector, RailStream};

/// A request could not be sent, or its answer not received.
#[derive(Debug, thiserror::Error)]
pub(super) enum SendError {
    /// No connection could be made (TCP or TLS): nothing was written.
    #[error("connect error")]
    Connect(#[source] BoxError),
    /// The connection failed while the request was written or its answer awaited.
    #[error(transparent)]
    Exchange(#[from] hyper::Error),
    /// Closed unanswered by railguard itself: it could not tell the database for too long
    /// which forwards it has on their way, and other railguard processes stop waiting for
    /// them (`store::handover`).
    #[error(
        "closed before the rail answered: this railguard could not write which forwards it has on their way for too long"
    )]
    Silenced,
}

/// One connection to the rail: the side that sends requests and the state machine that
/// drives the socket, owned by whoever is using the connection.
struct Conn {
    send: SendRequest<Tracked>,
    /// `None` once it finished: the connection is closed.
    driver: Option<Connection<RailStream, Tracked>>,
}

impl Conn {
    /// Lets hyper read and write what it can, registering `cx` for what it waits on. A
    /// finished driver is dropped, which also fails any request it never took.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(driver) = &mut self.driver
            && Pin::new(driver).poll(cx).is_ready()
        {
            self.driver = None;
        }
    }

    fn is_open(&self) -> bool {
        self.driver.is_some()
    }

    /// Whether it can take another request now, after polling it once with `waker` so that a
    /// close or an error that arrived while nobody polled it is seen.
    fn reusable(&mut self, waker: &Waker) -> bool {
        self.drive(&mut Context::from_waker(waker));
        self.is_open() && self.send.is_ready()
    }
}

/// Wakes the reaper: what an idle connection registers, as nobody's request polls it.
struct ReaperBell(Notify);

impl Wake for ReaperBell {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify_one();
    }
}

/// An idle connection and since when.
struct Idle {
    conn: Conn,
    since: Instant,
}

/// The rail's connections: opens them, lends them to requests and keeps the idle ones.
pub(super) struct RailConnections {
    connector: RailConnector,
    /// Scheme and authority of the rail, for the connector.
    target: Uri,
    /// Most recently used last.
    idle: Mutex<VecDeque<Idle>>,
    idle_timeout: Duration,
    max_idle: usize,
    /// The waker idle connections are polled with: it rings the reaper's bell.
    idle_waker: Waker,
}

/// The reaper runs at most this often, so that a burst of closes costs one pass.
const REAP_PAUSE: Duration = Duration::from_millis(100);

impl RailConnections {
    /// When called inside a tokio runtime, also starts the reaper of idle connections, which
    /// ends when the returned value is dropped.
    pub(super) fn new(
        connector: RailConnector,
        target: Uri,
        idle_timeout: Duration,
        max_idle: usize,
    ) -> Arc<Self> {
        let bell = Arc::new(ReaperBell(Notify::new()));
        let connections = Arc::new(Self {
            connector,
            target,
            idle: Mutex::new(VecDeque::new()),
            idle_timeout,
            max_idle,
            idle_waker: Waker::from(bell.clone()),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let every = (idle_timeout / 4).max(REAP_PAUSE);
            runtime.spawn(reap(Arc::downgrade(&connections), bell, every));
        }
        connections
    }

    /// Sends `request` and resolves with the rail's answer, whose body drives the connection
    /// until it is read. The request is written by this future's task: dropping the future
    /// before the answer came closes the connection.
    pub(super) async fn send(
        self: Arc<Self>,
        mut request: Request<Tracked>,
    ) -> Result<Response<RailBody>, SendError> {
        loop {
            let (mut conn, reused) = match self.checkout() {
                Some(conn) => (conn, true),
                // Boxed: rarely taken, and its future (TCP, TLS, hyper's handshake) would
                // otherwise make every forward's larger.
                None => (Box::pin(self.connect()).await?, false),
            };
            request.body().asked.handed_to_connection();
            let mut answer = std::pin::pin!(conn.send.try_send_request(request));
            let answer = poll_fn(|cx| {
                conn.drive(cx);
                answer.as_mut().poll(cx)
            })
            .await;
            match answer {
                Ok(response) => {
                    let connections = Arc::downgrade(&self);
                    return Ok(response.map(|inner| RailBody {
                        inner,
                        conn: Some(conn),
                        connections,
                    }));
                }
                Err(mut refused) => match refused.take_message() {
                    // Not one byte of it was written: a connection that had sat idle was
                    // closed under it. Another one may take it.
                    Some(unsent) if reused => {
                        unsent.body().asked.taken_back();
                        request = unsent;
                    }
                    _ => return Err(refused.into_error().into()),
                },
            }
        }
    }

    async fn connect(&self) -> Result<Conn, SendError> {
        let io = self
            .connector
            .clone()
            .oneshot(self.target.clone())
            .await
            .map_err(SendError::Connect)?;
        let (send, driver) = http1::handshake(io)
            .await
            .map_err(|e| SendError::Connect(e.into()))?;
        Ok(Conn {
            send,
            driver: Some(driver),
        })
    }

    fn idle(&self) -> MutexGuard<'_, VecDeque<Idle>> {
        // Nothing is left half-changed under this lock: a panic elsewhere cannot poison what
        // it guards.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used idle connection that can take a request, if any.
    fn checkout(&self) -> Option<Conn> {
        loop {
            let Idle { mut conn, since } = self.idle().pop_back()?;
            if since.elapsed() >= self.idle_timeout {
                // The rest are older still.
                let expired = std::mem::take(&mut *self.idle());
                drop(expired);
                return None;
            }
            if conn.reusable(Waker::noop()) {
                return Some(conn);
            }
        }
    }

    /// Keeps `conn` for the next request if it can take one; closes it otherwise.
    fn checkin(&self, mut conn: Conn) {
        if !conn.reusable(&self.idle_waker) {
            return;
        }
        let evicted = {
            let mut idle = self.idle();
            let evicted = (idle.len() >= self.max_idle)
                .then(|| idle.pop_front())
                .flatten();
            idle.push_back(Idle {
                conn,
                since: Instant::now(),
            });
            evicted
        };
        drop(evicted);
    }

    /// Closes the connections idle too long, and those the rail closed or broke. They are
    /// looked at outside the lock (requests meanwhile find the list empty and connect), and
    /// polled with the bell, so that the next thing the rail does to one rings it again.
    fn reap(&self) {
        let looked_at = std::mem::take(&mut *self.idle());
        let mut kept = VecDeque::with_capacity(looked_at.len());
        for mut entry in looked_at {
            if entry.since.elapsed() < self.idle_timeout && entry.conn.reusable(&self.idle_waker) {
                kept.push_back(entry);
            }
        }
        let evicted = {
            let mut idle = self.idle();
            // Those given back meanwhile are newer.
            kept.extend(idle.drain(..));
            let over = kept.len().saturating_sub(self.max_idle);
            let evicted: Vec<Idle> = kept.drain(..over).collect();
            *idle = kept;
            evicted
        };
        drop(evicted);
    }

    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle().len()
    }
}

/// Reaps when an idle connection rings the bell, and every `every`. The pass runs outside
/// tokio's per-task budget: a connection polled after the budget ran out would look open
/// whatever the rail did to it.
async fn reap(connections: Weak<RailConnections>, bell: Arc<ReaperBell>, every: Duration) {
    loop {
        tokio::select! {
            () = bell.0.notified() => {}
            () = tokio::time::sleep(every) => {}
        }
        let Some(connections) = connections.upgrade() else {
            return;
        };
        tokio::task::unconstrained(async { connections.reap() }).await;
        drop(connections);
        tokio::time::sleep(REAP_PAUSE).await;
    }
}

/// The rail's answer body. Reading it drives its connection, which goes back to the idle list
/// once the body was read to the end.
pub(super) struct RailBody {
    inner: Incoming,
    /// `None` once given back.
    conn: Option<Conn>,
    connections: Weak<RailConnections>,
}

impl RailBody {
    /// Gives the connection back if it can take another request; closes it otherwise.
    fn release(&mut self) {
        if let Some(conn) = self.conn.take()
            && let Some(connections) = self.connections.upgrade()
        {
            connections.checkin(conn);
        }
    }
}

impl Body for RailBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(conn) = &mut this.conn {
            conn.drive(cx);
        }
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.release();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for RailBody {
    fn drop(&mut self) {
        // A body whose end is known without reading on (an empty one, or one whose length was
        // all received) may never be polled to its end; its connection can still be reused.
        if self.inner.is_end_stream() {
            self.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::connect::HttpConnector;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::proxy::idempotency::MaybeSent;

    /// A rail that answers each request on a connection with `answer`, counting connections;
    /// `close_after` answers and `linger` later, it closes the connection without a word.
    async fn rail(
        answer: &'static str,
        close_after: usize,
        linger: Duration,
    ) -> (Uri, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target: Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(stream, answer, close_after, linger));
            }
        });
        (target, accepted)
    }

    async fn serve(
        mut stream: TcpStream,
        answer: &'static str,
        close_after: usize,
        linger: Duration,
    ) {
        let mut buf = Vec::new();
        let mut answered = 0;
        let mut chunk = [0u8; 4096];
        while answered < close_after {
            let n = match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            // Requests here carry `content-length: 2` and a two-byte body.
            while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                if buf.len() < end + 4 + 2 {
                    break;
                }
                buf.drain(..end + 4 + 2);
                stream.write_all(answer.as_bytes()).await.unwrap();
                answered += 1;
            }
        }
        tokio::time::sleep(linger).await;
    }

    fn connections(target: Uri) -> Arc<RailConnections> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        RailConnections::new(
            RailConnector::new(http, None, Duration::from_secs(1)),
            target,
            Duration::from_secs(60),
            16,
        )
    }

    fn request() -> Request<Tracked> {
        Request::post("/payments")
            .header("host", "rail")
            .body(Tracked {
                body: Full::new(Bytes::from_static(b"{}")),
                asked: MaybeSent::default(),
            })
            .unwrap()
    }

    const OK: &str = "HTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\nhello";

    #[tokio::test]
    async fn a_read_answer_gives_its_connection_back_for_the_next_request() {
        let (target, accepted) = rail(OK, usize::MAX, Duration::ZERO).await;
        let connections = connections(target);
        for _ in 0..20 {
            let answer = connections.clone().send(request()).await.unwrap();
            assert_eq!(answer.status(), 201);
            let body = answer.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(connections.idle_count(), 1);
    }

    #[tokio::test]
    async fn an_empty_answer_dropped_unread_gives_its_connection_back() {
        let (target, accepted) = rail(
            "HTTP/1.1 204 No Content\r\n\r\n",
            usize::MAX,
            Duration::ZERO,
        )
        .await;
        let connections = connections(target);
        for _ in 0..5 {
            let answer = connections.clone().send(request()).await.unwrap();
            assert_eq!(answer.status(), 204);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_answer_dropped_before_its_end_closes_its_connection() {
        let (target, accepted) = rail(
            "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial",
            usize::MAX,
            Duration::ZERO,
        )
        .await;
        let connections = connections(target);
        for _ in 0..3 {
            let answer = connections.clone().send(request()).await.unwrap();
            drop(answer);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!(connections.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_connection_the_rail_closed_while_idle_is_not_written_to() {
        // One answer per connection, then the rail closes it without saying so first. Either
        // the check before reuse or the retry of a request handed back unwritten keeps every
        // request here from failing; without both, they fail (checked).
        let (target, accepted) = rail(OK, 1, Duration::ZERO).await;
        let connections = connections(target);
        for _ in 0..5 {
            let answer = connections.clone().send(request()).await.unwrap();
            answer.into_body().collect().await.unwrap();
            // Time for the close to arrive before the next request.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn a_connection_still_writing_its_request_is_not_reused() {
        // The rail answers as soon as it has the head and never reads the 8 MB body.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target: Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                stream.read_exact(&mut byte).await.unwrap();
                head.push(byte[0]);
            }
            stream.write_all(OK.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let connections = connections(target);
        let mut large = request();
        *large.body_mut() = Tracked {
            body: Full::new(Bytes::from(vec![b'x'; 8 << 20])),
            asked: MaybeSent::default(),
        };
        let answer = connections.clone().send(large).await.unwrap();
        assert_eq!(answer.status(), 201);
        answer.into_body().collect().await.unwrap();
        assert_eq!(
            connections.idle_count(),
            0,
            "kept with its request unwritten"
        );
    }

    #[tokio::test]
    async fn an_idle_connection_the_rail_closes_is_closed_at_once() {
        // Answers one request, closes 100 ms later: after the answer was given back.
        let (target, _) = rail(OK, 1, Duration::from_millis(100)).await;
        let connections = connections(target);
        let answer = connections.clone().send(request()).await.unwrap();
        answer.into_body().collect().await.unwrap();
        assert_eq!(connections.idle_count(), 1);
        // The reaper runs every 15 s on its own; the close must ring it well before that.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(connections.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target: Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(listener);
        let Err(error) = connections(target).send(request()).await else {
            panic!("no rail listens there");
        };
        assert!(matches!(error, SendError::Connect(_)), "{error:?}");
    }

    #[tokio::test]
    async fn the_idle_list_is_bounded_and_the_reaper_closes_what_the_rail_closed() {
        // One answer per connection, closed 100 ms later: still open when given back.
        let (target, _) = rail(OK, 1, Duration::from_millis(100)).await;
        let connections = connections(target);
        // Eighteen answers held at once: eighteen connections, of which 16 may idle.
        let mut answers = Vec::new();
        for _ in 0..18 {
            answers.push(connections.clone().send(request()).await.unwrap());
        }
        for answer in answers {
            answer.into_body().collect().await.unwrap();
        }
        assert_eq!(connections.idle_count(), 16);
        connections.reap();
        assert_eq!(connections.idle_count(), 16, "open connections are kept");
        tokio::time::sleep(Duration::from_millis(300)).await;
        connections.reap();
        assert_eq!(connections.idle_count(), 0);
    }
}
