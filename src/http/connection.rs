//! What one connection carries through the accept loop: its activity, which decides when it
//! has been idle or slow for too long, and the guard each request holds while it is served.
//!
//! A connection is either serving (at least one request in flight, its response not yet
//! finished) or between requests. Between requests it is idle until a byte arrives, and from
//! that byte on a request head is on its way and must be complete within the header-read
//! timeout. A new connection starts with a head on its way, so a client that connects and
//! sends nothing gets the header-read timeout, not the idle one. While a request is in
//! flight neither timeout applies: the services' own deadlines do.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::framing::Framing;
use super::{BoxError, ResponseBody};

/// Why the accept loop closed or refused a connection or a request: the `reason` label of
/// `railguard_listener_refusals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `max_connections` were open: the new connection was closed at once.
    Connections,
    /// `max_in_flight` requests were being served: the request got 503.
    InFlight,
    /// A request head over `max_header_bytes` or `max_headers`: 431.
    HeadersTooLarge,
    /// A request head (or the TLS handshake) took longer than `header_read_timeout_ms`.
    HeaderTimeout,
    /// No request and nothing received for `idle_timeout_ms`.
    Idle,
    /// The TLS handshake failed: not TLS, no shared protocol, or a client certificate that
    /// is missing (when required) or does not verify.
    TlsHandshake,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::Connections,
        Refusal::InFlight,
        Refusal::HeadersTooLarge,
        Refusal::HeaderTimeout,
        Refusal::Idle,
        Refusal::TlsHandshake,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Connections => "connections",
            Refusal::InFlight => "in_flight",
            Refusal::HeadersTooLarge => "headers_too_large",
            Refusal::HeaderTimeout => "header_timeout",
            Refusal::Idle => "idle",
            Refusal::TlsHandshake => "tls_handshake",
        }
    }

    /// The counter of refusals, by `listener` and `reason`, not yet registered anywhere.
    pub fn counter() -> prometheus::IntCounterVec {
        prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "railguard_listener_refusals_total",
                "Connections and requests a listener refused or closed to protect itself, by \
                 listener and reason (connections, in_flight, headers_too_large, \
                 header_timeout, idle, tls_handshake).",
            ),
            &["listener", "reason"],
        )
        .expect("valid metric")
    }
}

/// One connection's activity; see the module docs.
pub(super) struct Activity {
    state: Mutex<State>,
}

struct State {
    in_flight: usize,
    /// When the last response finished (or the connection was accepted).
    idle_since: Instant,
    /// When the first byte of the next request head arrived, while no request was in flight.
    head_since: Option<Instant>,
}

impl Activity {
    pub(super) fn new() -> Arc<Activity> {
        let now = Instant::now();
        Arc::new(Activity {
            state: Mutex::new(State {
                in_flight: 0,
                idle_since: now,
                head_since: Some(now),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn received(&self) {
        let mut state = self.state();
        if state.in_flight == 0 && state.head_since.is_none() {
            state.head_since = Some(Instant::now());
        }
    }

    fn request_started(&self) {
        let mut state = self.state();
        state.in_flight += 1;
        state.head_since = None;
    }

    fn request_finished(&self) {
        let mut state = self.state();
        state.in_flight = state.in_flight.saturating_sub(1);
        if state.in_flight == 0 {
            state.idle_since = Instant::now();
            state.head_since = None;
        }
    }

    /// Resolves when the connection has waited too long for a request head or been idle too
    /// long, with which of the two.
    pub(super) async fn expired(&self, header_read: Duration, idle: Duration) -> Refusal {
        loop {
            let (deadline, reason) = {
                let state = self.state();
                if state.in_flight > 0 {
                    // Look again later: when the last response finishes, its time is kept.
                    (Instant::now() + header_read.min(idle), None)
                } else if let Some(head) = state.head_since {
                    (head + header_read, Some(Refusal::HeaderTimeout))
                } else {
                    (state.idle_since + idle, Some(Refusal::Idle))
                }
            };
            match reason {
                Some(reason) if deadline <= Instant::now() => return reason,
                _ => tokio::time::sleep_until(deadline).await,
            }
        }
    }
}

/// A connection's byte stream, telling its [`Activity`] when bytes arrive, and following its
/// HTTP/1 framing ([`Framing`]).
pub(super) struct Tracked<T> {
    inner: T,
    activity: Arc<Activity>,
    framing: Framing,
}

impl<T> Tracked<T> {
    pub(super) fn new(inner: T, activity: Arc<Activity>, framing: Framing) -> Self {
        Self {
            inner,
            activity,
            framing,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.received();
            self.framing.read(&buf.filled()[before..]);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Requests in flight across one listener.
pub(super) struct InFlight {
    count: AtomicUsize,
    max: usize,
}

impl InFlight {
    pub(super) fn new(max: usize) -> Arc<InFlight> {
        Arc::new(InFlight {
            count: AtomicUsize::new(0),
            max,
        })
    }
}

/// Held from a request's arrival until its response body is finished or dropped.
pub(super) struct RequestGuard {
    /// `None` for a request refused for `max_in_flight`: it counts on its connection (it is
    /// not idleness) but not on the listener.
    listener: Option<Arc<InFlight>>,
    connection: Arc<Activity>,
}

impl RequestGuard {
    /// Counts a request in; `Err` holds the guard of a request to refuse, because the
    /// listener already serves `max_in_flight`.
    pub(super) fn enter(
        listener: &Arc<InFlight>,
        connection: &Arc<Activity>,
    ) -> Result<Self, Self> {
        connection.request_started();
        if listener.count.fetch_add(1, Ordering::AcqRel) >= listener.max {
            listener.count.fetch_sub(1, Ordering::AcqRel);
            return Err(RequestGuard {
                listener: None,
                connection: connection.clone(),
            });
        }
        Ok(RequestGuard {
            listener: Some(listener.clone()),
            connection: connection.clone(),
        })
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.count.fetch_sub(1, Ordering::AcqRel);
        }
        self.connection.request_finished();
    }
}

/// A response body that holds its request's guard until it is finished.
pub(super) struct GuardedBody {
    inner: ResponseBody,
    _guard: RequestGuard,
}

impl GuardedBody {
    pub(super) fn new<B>(inner: B, guard: RequestGuard) -> Self
    where
        B: Body<Data = Bytes, Error = BoxError> + Send + 'static,
    {
        Self {
            inner: inner.boxed_unsync(),
            _guard: guard,
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
