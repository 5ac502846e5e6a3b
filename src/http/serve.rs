//! Accept loop shared by every listener: the proxy, the lock API, the admin endpoint and the
//! rail simulator.
//!
//! Takes an already-bound [`Listener`] (so tests bind port 0 and callers choose the address),
//! a service per connection, and a shutdown future. On shutdown it stops accepting, lets every
//! open connection finish its in-flight requests within the grace period, then closes what
//! is left and returns.
//!
//! The listener's limits keep one client from holding it (`config::listener` has the keys):
//!
//! - past `max_connections` open connections, a new one is accepted and closed at once, with
//!   no response: the accept loop keeps accepting, so the kernel's backlog never fills
//!   silently, and a client learns at once that it must go elsewhere or retry. Nothing of the
//!   request was read, so nothing of it was acted on. (A 503 would need the request read
//!   first, and for TLS a handshake: the work the limit exists to refuse.)
//! - past `max_in_flight` requests being served, a request is answered by the listener's
//!   overload response (503, `Retry-After: 1`) without reaching the service.
//! - a request head over `max_header_bytes` or `max_headers` is answered 431: by hyper for
//!   HTTP/1, which closes the connection; over HTTP/2, hyper bounds the header bytes and the
//!   header count is checked here, per stream.
//! - while a request is in flight the connection's timeouts do not run (a lock acquire may
//!   wait for minutes); the lock and admin APIs read their small bodies within
//!   `header_read_timeout_ms` ([`super::Arrival::body_timeout`]), the proxy within its request timeout.
//! - a request head, or a TLS handshake, slower than `header_read_timeout_ms`, and a
//!   connection idle for `idle_timeout_ms`, are closed (see `connection` for when each runs).
//!   hyper's own HTTP/1 header timer is not used: it also runs between requests, which would
//!   make the idle timeout the header timeout.
//!
//! Each of these is counted in `railguard_listener_refusals_total{listener, reason}`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use prometheus::IntCounterVec;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::connection::{Activity, GuardedBody, InFlight, RequestGuard, Tracked};
use super::framing::{Framing, Requests};
use super::{Arrival, BoxError, Peer, Refusal, ResponseBody, full};
use crate::config::{ListenerLimits, MIN_HEADER_BYTES};
use crate::tls::server::{TlsServer, fingerprint};

/// A bound socket and what the accept loop must know to serve it: its name in metrics and
/// logs, its limits, TLS, and how it answers a request it has no room for.
pub struct Listener {
    tcp: TcpListener,
    name: &'static str,
    limits: ListenerLimits,
    tls: Option<Arc<TlsServer>>,
    refusals: IntCounterVec,
    overloaded: fn() -> Response<ResponseBody>,
}

impl Listener {
    /// Plain TCP with the default limits, refusals counted in a counter nobody exports, and
    /// a JSON 503 for overload. `name` is the `listener` label.
    pub fn new(tcp: TcpListener, name: &'static str) -> Listener {
        Listener {
            tcp,
            name,
            limits: ListenerLimits::default(),
            tls: None,
            refusals: Refusal::counter(),
            overloaded,
        }
    }

    pub fn with_limits(mut self, limits: ListenerLimits) -> Listener {
        self.limits = limits;
        self
    }

    /// Serves TLS only, with this configuration.
    pub fn with_tls(mut self, tls: Arc<TlsServer>) -> Listener {
        self.tls = Some(tls);
        self
    }

    /// The TLS configuration it serves, if it serves TLS (SIGHUP checks its files).
    pub fn tls(&self) -> Option<Arc<TlsServer>> {
        self.tls.clone()
    }

    /// Counts refusals in `refusals` (labels `listener`, `reason`; see [`Refusal::counter`]).
    pub fn counting_refusals_in(mut self, refusals: IntCounterVec) -> Listener {
        self.refusals = refusals;
        self
    }

    /// Answers a request refused for `max_in_flight` with `respond()`.
    pub fn answering_overload_with(mut self, respond: fn() -> Response<ResponseBody>) -> Listener {
        self.overloaded = respond;
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

impl From<TcpListener> for Listener {
    fn from(tcp: TcpListener) -> Listener {
        Listener::new(tcp, "http")
    }
}

/// The default overload response: 503, a JSON body, `Retry-After: 1`.
fn overloaded() -> Response<ResponseBody> {
    let mut response = Response::new(full(
        r#"{"error":"overloaded","message":"too many requests in flight on this listener; nothing was done, retry later","outcome":"none"}"#,
    ));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// What every connection task of one listener shares.
struct Shared {
    name: &'static str,
    limits: ListenerLimits,
    tls: Option<Arc<TlsServer>>,
    refusals: IntCounterVec,
    overloaded: fn() -> Response<ResponseBody>,
    builder: Builder<TokioExecutor>,
    in_flight: Arc<InFlight>,
    open: AtomicUsize,
}

impl Shared {
    fn refused(&self, reason: Refusal) {
        self.refusals
            .with_label_values(&[self.name, reason.as_str()])
            .inc();
    }
}

/// Serves HTTP/1.1 and HTTP/2 (over TLS when the listener has it, cleartext h2c otherwise) on
/// `listener` until `shutdown` resolves, then drains. `make_service` makes the service of one
/// connection from its [`Peer`]; each request also carries the `Peer` as an extension.
pub async fn serve<F, S, B>(
    listener: impl Into<Listener>,
    make_service: F,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) where
    F: Fn(Peer) -> S + Clone + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static,
{
    let Listener {
        tcp,
        name,
        limits,
        tls,
        refusals,
        overloaded,
    } = listener.into();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        // hyper panics below its minimum; the config refuses such values with the key named.
        .max_buf_size(limits.max_header_bytes.max(MIN_HEADER_BYTES))
        .max_headers(limits.max_headers);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.h2_max_concurrent_streams)
        // A hard cap at twice the limit: h2 refuses a larger head itself, uncounted; a head
        // between the two reaches `Limited`, which answers 431 and counts it.
        .max_header_list_size(
            u32::try_from(limits.max_header_bytes.saturating_mul(2)).unwrap_or(u32::MAX),
        );
    for reason in Refusal::ALL {
        refusals.with_label_values(&[name, reason.as_str()]);
    }
    let shared = Arc::new(Shared {
        name,
        in_flight: InFlight::new(limits.max_in_flight),
        limits,
        tls,
        refusals,
        overloaded,
        builder,
        open: AtomicUsize::new(0),
    });
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let local = tcp.local_addr().ok();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = tcp.accept() => {
                let (stream, addr) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if shared.open.fetch_add(1, Ordering::AcqRel) >= shared.limits.max_connections {
                    shared.open.fetch_sub(1, Ordering::AcqRel);
                    shared.refused(Refusal::Connections);
                    tracing::debug!(listener = name, client.addr = %addr,
                        "max_connections reached: connection closed");
                    drop(stream);
                    continue;
                }
                let _ = stream.set_nodelay(true);
                connections.spawn(connection(
                    shared.clone(),
                    make_service.clone(),
                    stream,
                    addr,
                    stopping.clone(),
                ));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(tcp);
    tracing::info!(listener = ?local, "stopped accepting; draining open connections");
    let _ = stop.send(true);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, drained).await.is_err() {
        tracing::warn!(listener = ?local, ?grace, "grace period over; closing remaining connections");
        connections.shutdown().await;
    }
}

/// Serves one accepted connection: the TLS handshake if any, then HTTP until the client
/// leaves, a timeout closes it, or shutdown drains it.
async fn connection<F, S, B>(
    shared: Arc<Shared>,
    make_service: F,
    stream: TcpStream,
    addr: SocketAddr,
    stopping: watch::Receiver<bool>,
) where
    F: Fn(Peer) -> S + Clone + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static,
{
    struct Open<'a>(&'a AtomicUsize);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _open = Open(&shared.open);
    let Some(tls) = shared.tls.clone() else {
        let peer = Peer {
            addr,
            client_cert_sha256: None,
        };
        return http(&shared, make_service(peer), stream, peer, stopping).await;
    };
    // The wait for a certificate check (bounded by CHECK_WAIT) is the server's own, not the
    // client's: it does not count against the client's time for the handshake.
    let handshake = tls.acceptor().await.accept(stream);
    let stream = match tokio::time::timeout(shared.limits.header_read_timeout, handshake).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            shared.refused(Refusal::TlsHandshake);
            tracing::debug!(listener = shared.name, client.addr = %addr, error = %e,
                "TLS handshake failed");
            return;
        }
        Err(_) => {
            shared.refused(Refusal::TlsHandshake);
            tracing::debug!(listener = shared.name, client.addr = %addr,
                "TLS handshake not done within header_read_timeout_ms");
            return;
        }
    };
    // Only a certificate the verifier accepted is ever here: rustls fails the handshake
    // otherwise.
    let client_cert_sha256 = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(fingerprint);
    let peer = Peer {
        addr,
        client_cert_sha256,
    };
    http(&shared, make_service(peer), stream, peer, stopping).await;
}

async fn http<S, B, T>(
    shared: &Arc<Shared>,
    service: S,
    stream: T,
    peer: Peer,
    mut stopping: watch::Receiver<bool>,
) where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::new();
    let (framing, requests) = Framing::new();
    let service = Limited {
        requests,
        inner: service,
        peer,
        activity: activity.clone(),
        in_flight: shared.in_flight.clone(),
        refusals: shared.refusals.clone(),
        name: shared.name,
        overloaded: shared.overloaded,
        max_headers: shared.limits.max_headers,
        max_header_bytes: shared.limits.max_header_bytes,
        body_timeout: shared.limits.header_read_timeout,
    };
    let io = TokioIo::new(Tracked::new(stream, activity.clone(), framing));
    let connection = shared.builder.serve_connection(io, service);
    tokio::pin!(connection);
    let limits = &shared.limits;
    let closing = tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                let too_large = e
                    .downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_parse_too_large);
                if too_large {
                    shared.refused(Refusal::HeadersTooLarge);
                }
                tracing::debug!(listener = shared.name, client.addr = %peer.addr, error = %e,
                    "connection ended with an error");
            }
            return;
        }
        reason = activity.expired(limits.header_read_timeout, limits.idle_timeout) => Some(reason),
        _ = stopping.wait_for(|stop| *stop) => None,
    };
    if let Some(reason) = closing {
        shared.refused(reason);
        tracing::debug!(listener = shared.name, client.addr = %peer.addr,
            reason = reason.as_str(), "closing the connection");
    }
    // HTTP/1: closes at once, as no request is in flight (or, on shutdown, after the one in
    // flight); HTTP/2: GOAWAY, then the open streams finish.
    connection.as_mut().graceful_shutdown();
    match closing {
        // Nothing is in flight: what is left is a client that does not read or close.
        Some(_) => {
            let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
        }
        // The serve loop bounds the drain by the grace period and then aborts this task.
        None => {
            let _ = connection.await;
        }
    }
}

/// A connection's service behind the listener's in-flight limit.
struct Limited<S> {
    inner: S,
    /// Numbers the requests, to give each what its HTTP/1 body declared.
    requests: Requests,
    peer: Peer,
    activity: Arc<Activity>,
    in_flight: Arc<InFlight>,
    refusals: IntCounterVec,
    name: &'static str,
    overloaded: fn() -> Response<ResponseBody>,
    /// hyper counts HTTP/1 header lines and bytes itself; an HTTP/2 request's headers are
    /// counted and measured here.
    max_headers: usize,
    max_header_bytes: usize,
    body_timeout: Duration,
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Limited<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static,
{
    type Response = Response<GuardedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        let entered = RequestGuard::enter(&self.in_flight, &self.activity);
        // Every request hyper hands over takes its number, answered here or not.
        let declared = self.requests.next();
        // hyper refuses an HTTP/1 head with too many lines or bytes before parsing it; an
        // HTTP/2 request's headers are counted and measured here, before anything else looks
        // at them.
        if request.headers().len() > self.max_headers
            || (request.version() == http::Version::HTTP_2
                && header_list_size(&request) > self.max_header_bytes)
        {
            self.refused(Refusal::HeadersTooLarge);
            let guard = entered.unwrap_or_else(|guard| guard);
            let response = too_many_headers(self.max_headers);
            return Box::pin(async move { Ok(response.map(|body| GuardedBody::new(body, guard))) });
        }
        match entered {
            Ok(guard) => {
                request.extensions_mut().insert(Arrival {
                    peer: self.peer,
                    body_timeout: self.body_timeout,
                    declared,
                });
                let future = self.inner.call(request);
                Box::pin(async move {
                    let response = future.await?;
                    Ok(response.map(|body| GuardedBody::new(body, guard)))
                })
            }
            Err(guard) => {
                self.refused(Refusal::InFlight);
                let response = (self.overloaded)();
                Box::pin(async move { Ok(response.map(|body| GuardedBody::new(body, guard))) })
            }
        }
    }
}

impl<S> Limited<S> {
    fn refused(&self, reason: Refusal) {
        self.refusals
            .with_label_values(&[self.name, reason.as_str()])
            .inc();
    }
}

/// An HTTP/2 request head's size as HTTP/1 would send it, so that `max_header_bytes` means
/// the same on both: a field's name, value and 4 octets (`: ` and CRLF), the pseudo-headers
/// standing for the request line. (SETTINGS_MAX_HEADER_LIST_SIZE adds 32 octets a field, RFC
/// 9113 §6.5.2; h2's own cap, at twice the limit, counts that way.)
fn header_list_size<B>(request: &Request<B>) -> usize {
    let uri = request.uri();
    let pseudo = [
        (":method", request.method().as_str().len()),
        (
            ":path",
            uri.path_and_query().map_or(1, |p| p.as_str().len()),
        ),
        (":scheme", uri.scheme_str().map_or(0, str::len)),
        (
            ":authority",
            uri.authority().map_or(0, |a| a.as_str().len()),
        ),
    ];
    let pseudo: usize = pseudo.iter().map(|(n, v)| n.len() + v + 4).sum();
    pseudo
        + request
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum::<usize>()
}

/// 431 for a request head over the listener's limits: nothing of it was acted on.
fn too_many_headers(max: usize) -> Response<ResponseBody> {
    let mut response = Response::new(full(format!(
        "request head too large (at most {max} headers and max_header_bytes); nothing was done\n"
    )));
    *response.status_mut() = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}
