//! Sends an admitted request to the rail and streams the rail's answer back.
//!
//! A reverse proxy's duties: hop-by-hop headers (RFC 9110 §7.6.1 — the fixed list plus any
//! named in `Connection`) are dropped both ways; the client's address is appended to
//! `X-Forwarded-For`; the client's `Host` moves to `X-Forwarded-Host` and the rail's authority
//! becomes the new `Host`; `Via` names railguard. Requests from HTTP/2 clients go to the rail as HTTP/1.1 over a
//! pooled keep-alive connection — over TLS for an `https://` rail (`tls::client`): a failed
//! handshake is a failed connect, so the request was not sent.
//!
//! The rail's connections are driven by the requests that use them (`connections`), not by
//! tasks of their own.
//!
//! A failure here happens *after* the mark advanced; `fence` explains why that is safe. The
//! client cannot tell whether the rail acted on a request that timed out, which is what
//! idempotency keys are for.

mod connections;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, Uri, Version, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Body as _;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::ClientConfig;
use tokio::time::Instant;
use tracing::Instrument;

use self::connections::{RailBody, RailConnections, SendError};
use super::admission::{Admission, Admitted};
use super::fence::Turn;
use super::idempotency::{AskTheRail, LateAnswer, MaybeSent};
use super::{BoxError, FencedRequest, ProxyResponse, Step};
use crate::config::Upstream;
use crate::metrics::Metrics;
use crate::store::records::BoxFuture;
use crate::tls::client::RailConnector;
use crate::work::{self, Work, Working};

/// The rail could not be reached, or broke off its answer. Its message gives the causes (a
/// refused connection, a TLS certificate the CA does not vouch for) and whether the request
/// can have reached the rail.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(.0, *.1))]
pub struct UpstreamUnavailable(#[source] pub BoxError, pub Sent);

fn describe(error: &BoxError, sent: Sent) -> String {
    let mut causes = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        causes.push_str(": ");
        causes.push_str(&e.to_string());
        cause = e.source();
    }
    match sent {
        Sent::Never => {
            format!("the rail could not be reached ({causes}); the request was not sent")
        }
        Sent::Maybe => format!(
            "the rail could not be reached or broke off its answer ({causes}); it may have \
             received the request"
        ),
    }
}

/// Whether a failed request can have reached the rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// Not one byte of its body was handed to a connection (or no connection was made): the
    /// rail cannot have acted on it.
    Never,
    /// The rail may have received it.
    Maybe,
}

/// The rail did not answer in time.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct UpstreamTimeout {
    message: &'static str,
    pub sent: Sent,
}

impl UpstreamTimeout {
    pub fn no_answer(sent: Sent) -> Self {
        let message = match sent {
            Sent::Maybe => {
                "the rail did not answer before the request deadline; it may or may not have acted"
            }
            Sent::Never => {
                "the request deadline passed before the request was sent; the rail did not see it"
            }
        };
        Self { message, sent }
    }
    pub fn waiting_for_turn() -> Self {
        Self {
            message: "the request deadline passed while an earlier token's forward was still at \
                      the rail; this request was not sent",
            sent: Sent::Never,
        }
    }
}

/// The request body as handed to the client, marking the request [`MaybeSent`] when a
/// connection first asks for it: hyper asks for the body only after it has a connection and
/// has encoded the request head, so a body never asked for means the rail cannot have received
/// a complete request.
struct Tracked {
    body: Full<Bytes>,
    /// Also marked when the request is handed to a connection (`connections`): before that,
    /// nothing of it can reach the rail, whatever it says of an empty body.
    asked: MaybeSent,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.asked.set();
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Forwards whose request may be on its way to the rail and whose answer has not come: every
/// fenced request from before its compare-and-set (`fence`: a keyed one owns a record from its
/// commit, and its forward is to come) until its forward ends, and those past their deadline or
/// left by their client that still wait for a late answer, each holding its account's turn. A
/// graceful shutdown waits for them within its grace — a keyed forward runs in a task of its
/// own that stopping the listeners does not end — as stopping earlier would let a newer grant's
/// request, sent by the next process, overtake one of them. Only once none is left may the
/// process say it sends nothing more (`idempotency::record_clean_stop`).
///
/// A forward that may have been written and ended without the rail's answer — its connection
/// reset or closed, or let go by `proxy.late_answer_wait_ms` — sent nothing more after it
/// ended, but what it wrote may still be on its way for `proxy.rail_transit_ms`: the latest such
/// end is kept ([`LateForwards::quiet_in`]), and a clean stop says when the rail can receive
/// nothing more from this process.
#[derive(Clone)]
pub struct LateForwards(Arc<Outstanding>);

struct Outstanding {
    /// Where the forwards are counted: the process's work tracker ([`crate::work`]).
    counted: work::Tracked,
    /// When the latest forward that may have been written ended without the rail's answer.
    unanswered: Mutex<Option<Instant>>,
}

impl Default for LateForwards {
    /// Counted in a tracker of their own (a forward built alone, in tests).
    fn default() -> Self {
        Self::counted_in(work::Tracked::alone(Work::Forward))
    }
}

impl LateForwards {
    /// Forwards counted in `counted`, the process's tracker of [`Work::Forward`].
    pub fn counted_in(counted: work::Tracked) -> Self {
        Self(Arc::new(Outstanding {
            counted,
            unanswered: Mutex::default(),
        }))
    }

    /// Counts one forward, or one request whose forward is to come, until the returned value
    /// is dropped.
    pub(crate) fn start(&self) -> Working {
        self.0.counted.start()
    }

    pub fn count(&self) -> usize {
        self.0.counted.count()
    }

    /// A forward that may have been written ended now without the rail's answer: what it wrote
    /// may still reach the rail for the network's transit time.
    pub(crate) fn ended_unanswered(&self) {
        let now = Instant::now();
        let mut unanswered = self
            .0
            .unanswered
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *unanswered = Some(unanswered.map_or(now, |at| at.max(now)));
    }

    /// How long from now something this process wrote to the rail may still arrive there:
    /// `transit` (`proxy.rail_transit_ms`) after the latest forward that ended without the
    /// rail's answer, zero if none did or that time has passed. Only meaningful once no
    /// forward is outstanding ([`Self::count`] is zero): an outstanding one may still write.
    pub fn quiet_in(&self, transit: Duration) -> Duration {
        let unanswered = *self
            .0
            .unanswered
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        unanswered.map_or(Duration::ZERO, |at| {
            (at + transit).saturating_duration_since(Instant::now())
        })
    }
}

/// How long a connection to the rail may stay idle before it is closed.
const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);
/// How many idle connections to the rail are kept.
const MAX_IDLE_CONNECTIONS: usize = 4096;

/// Forwards to the rail. Cloned for every request, so everything it holds is behind one `Arc`.
#[derive(Clone)]
pub struct Forward(Arc<Rail>);

/// What every forward shares: the rail's connections, its address, and the late forwards.
struct Rail {
    connections: Arc<RailConnections>,
    /// The `Host` every request to the rail carries: the upstream's authority, made once.
    host: HeaderValue,
    late_answer_wait: Duration,
    late: LateForwards,
    metrics: Arc<Metrics>,
}

impl Forward {
    /// `tls` is the client configuration for an `https://` upstream
    /// (`tls::client::rail_client_config`); the handshake gets `connect_timeout` too.
    pub fn new(
        upstream: Upstream,
        tls: Option<Arc<ClientConfig>>,
        connect_timeout: Duration,
        late_answer_wait: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        http.set_keepalive(Some(Duration::from_secs(30)));
        let connector = RailConnector::new(http, tls, connect_timeout);
        let target = Uri::builder()
            .scheme(upstream.scheme.clone())
            .authority(upstream.authority.clone())
            .path_and_query("/")
            .build()
            .expect("a scheme and an authority make a URI");
        let connections = RailConnections::new(
            connector,
            target,
            IDLE_CONNECTION_TIMEOUT,
            MAX_IDLE_CONNECTIONS,
        );
        // An authority is visible ASCII, which is always a valid header value.
        let host = HeaderValue::from_str(upstream.authority.as_str())
            .expect("an authority is a valid header value");
        Self(Arc::new(Rail {
            connections,
            host,
            late_answer_wait,
            late: LateForwards::default(),
            metrics,
        }))
    }

    /// Counts this stack's forwards in `forwards`, the process's tracker of [`Work::Forward`]
    /// (by default a tracker of their own).
    pub fn counting_in(mut self, forwards: work::Tracked) -> Self {
        Arc::get_mut(&mut self.0)
            .expect("counted in a tracker before the stack is cloned")
            .late = LateForwards::counted_in(forwards);
        self
    }
}

impl Forward {
    /// The forwards of this stack still waiting for a late answer (for a graceful shutdown).
    pub fn late_forwards(&self) -> LateForwards {
        self.0.late.clone()
    }
}

/// The rail's lookup by idempotency key (`idempotency::resolve`): a `GET` of its own on the
/// rail's connections, outside any account's turn — it pays nothing.
impl AskTheRail for Forward {
    fn get(&self, path: PathAndQuery) -> BoxFuture<'static, Result<ProxyResponse, BoxError>> {
        let rail = self.0.clone();
        Box::pin(async move {
            let request = Request::get(Uri::from(path))
                .header(header::HOST, rail.host.clone())
                .body(Tracked {
                    body: Full::new(Bytes::new()),
                    asked: MaybeSent::default(),
                })?;
            let response = rail
                .connections
                .clone()
                .send(request)
                .await
                .map_err(|e| -> BoxError { e.into() })?;
            Ok(proxy_response(response))
        })
    }
}

impl Step<Admitted> for Forward {
    fn handle(
        &self,
        admitted: Admitted,
    ) -> impl Future<Output = Result<ProxyResponse, BoxError>> + Send {
        let this = &self.0;
        // At debug, as `fence.check`: `proxy.request` carries the token at info.
        let span = tracing::debug_span!("rail.forward",
            lock.token = admitted.request.token.get(), account = %admitted.request.account,
            status = tracing::field::Empty);
        // Where the rail's status goes: this span (a copy of nothing when it is off), not
        // whichever is current.
        let recorded = span.clone();
        async move {
            let Admitted {
                request:
                    FencedRequest {
                        request,
                        mut deadline,
                        ..
                    },
                admission:
                    Admission {
                        record,
                        sent: asked,
                        turn,
                        ..
                    },
            } = admitted;
            // A record never reaches the forward (the idempotency layer keeps it); were
            // one here, it would be dropped — and forgotten — before the rail answered.
            debug_assert!(record.is_none(), "the forward never owns a record");
            let mut request = request;
            // Where the rail's answer goes should it come after the deadline.
            let late_answer = request.extensions_mut().remove::<LateAnswer>();
            let request = this.upstream_request(*request, asked.clone());
            // An empty body is never asked for although the request goes out whole, so
            // such a request may have been sent from the moment it is handed to the client.
            // Marked now, not when the client returns: a forward whose future is dropped
            // mid-way (its client hung up, with the kill switch on) must not leave its
            // record looking unsent. A connect failure un-marks it: no connection, nothing
            // received (`MaybeSent::never_connected`).
            if request.body().is_end_stream() {
                asked.set();
            }
            let sent = |connect_failed: bool| {
                if connect_failed {
                    asked.never_connected();
                }
                if asked.is_set() {
                    Sent::Maybe
                } else {
                    Sent::Never
                }
            };
            let started = Instant::now();
            let mut in_flight = InFlight {
                exchange: Some(Box::pin(this.connections.clone().send(request))),
                turn,
                asked: asked.clone(),
                counted: Some(this.late.start()),
                late_answer,
                rail: this.clone(),
            };
            let answer = match (&mut in_flight.exchange, &in_flight.turn) {
                (Some(exchange), turn) => {
                    tokio::select! {
                        answer = deadline.bound(exchange) => answer,
                        () = silenced(turn.as_ref()) => Ok(Err(SendError::Silenced)),
                    }
                }
                (None, _) => unreachable!("the exchange was just started"),
            };
            this.metrics
                .upstream_seconds
                .observe(started.elapsed().as_secs_f64());
            let response = match answer {
                Err(_) => {
                    let sent = sent(false);
                    in_flight.hand_off(PAST_DEADLINE);
                    return Err(UpstreamTimeout::no_answer(sent).into());
                }
                Ok(Err(e)) => {
                    let sent = sent(matches!(e, SendError::Connect(_)));
                    if sent == Sent::Maybe {
                        // Written, perhaps, and the connection failed before an answer:
                        // what was written may still reach the rail (a middlebox may hold
                        // it). Noted before the forward stops counting as outstanding.
                        this.late.ended_unanswered();
                    }
                    let turn = in_flight.settle();
                    if let (Some(turn), Sent::Maybe) = (turn, sent) {
                        turn.unanswered();
                    }
                    return Err(UpstreamUnavailable(e.into(), sent).into());
                }
                Ok(Ok(response)) => {
                    drop(in_flight.settle());
                    // The rail answered: it has seen the request, whatever its body.
                    asked.set();
                    response
                }
            };
            recorded.record("status", response.status().as_u16());
            Ok(proxy_response(response))
        }
        .instrument(span)
    }
}

/// Resolves when `turn`'s process must close its connections to the rail: it could not write
/// its forwards' row for too long (`store::handover`).
async fn silenced(turn: Option<&Turn>) {
    match turn {
        Some(turn) => turn.silenced().await,
        None => std::future::pending().await,
    }
}

/// The rail's answer as the proxy passes it on: hop-by-hop headers dropped, a body that breaks
/// off reported as the rail's.
fn proxy_response(response: Response<RailBody>) -> ProxyResponse {
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let body = body
        .map_err(|e| -> BoxError { UpstreamUnavailable(e.into(), Sent::Maybe).into() })
        .boxed_unsync();
    ProxyResponse::from_parts(parts, body)
}

const PAST_DEADLINE: &str = "past its deadline";

/// An exchange with the rail: the request, and the answer's head once it comes.
type Exchange = Pin<Box<dyn Future<Output = Result<Response<RailBody>, SendError>> + Send>>;

/// A forward whose request may be on its way to the rail, with its account's turn. Dropped
/// before the rail answered — past the deadline, or its client hung up and nothing else holds
/// it (a request without an idempotency key runs in its client connection's task) — what is
/// left of it goes on in a task of its own, still holding the turn, until the rail answers,
/// the connection ends or `proxy.late_answer_wait_ms` runs out: a newer grant's request must
/// not overtake one the rail may still receive (INV-05). One that cannot have been sent is
/// just dropped, and the turn passes on. A keyed request's late answer is stored as its
/// record's ([`LateAnswer`]) before the forward stops counting as outstanding, so a graceful
/// stop that waits for it stores it too.
struct InFlight {
    /// `None` once the rail answered or the exchange failed.
    exchange: Option<Exchange>,
    turn: Option<Turn>,
    /// Whether the request was handed to a connection, and may have been sent.
    asked: MaybeSent,
    /// Counted among the outstanding forwards until the exchange ends.
    counted: Option<Working>,
    /// Where a keyed request's late answer goes.
    late_answer: Option<LateAnswer>,
    rail: Arc<Rail>,
}

impl InFlight {
    /// The exchange ended: nothing more can reach the rail. Returns the turn, to be dropped
    /// when the caller is done.
    fn settle(&mut self) -> Option<Turn> {
        self.exchange = None;
        self.counted = None;
        self.turn.take()
    }

    /// Lets what is left of the exchange go on without its caller, if the request may be on
    /// its way.
    fn hand_off(&mut self, why: &'static str) {
        let (Some(exchange), turn, counted) =
            (self.exchange.take(), self.turn.take(), self.counted.take())
        else {
            return;
        };
        // Not handed to a connection (still connecting, say): dropping it sends nothing.
        if !(self.asked.was_handed() && self.asked.is_set()) {
            return;
        }
        // Only a runtime shutting down has none; nothing can be waited for then.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let wait = self.rail.late_answer_wait;
        let late = self.rail.late.clone();
        let late_answer = self.late_answer.take();
        runtime.spawn(
            async move {
                // Zero is no limit: only the rail's answer, or the end of the connection
                // (after which nothing more of the request can reach the rail), passes the
                // turn on.
                let mut turn = turn;
                let waited = Instant::now();
                let held = async {
                    tokio::select! {
                        answer = exchange => answer,
                        () = silenced(turn.as_ref()) => Err(SendError::Silenced),
                    }
                };
                let ended = if wait.is_zero() {
                    Ok(held.await)
                } else {
                    tokio::time::timeout(wait, held).await
                };
                let answered = match ended {
                    Ok(Ok(response)) => {
                        // The rail has the request: nothing more of it is on its way, and the
                        // next token's forward may start.
                        drop(turn.take());
                        if let Some(late_answer) = late_answer {
                            let stored = late_answer.store(proxy_response(response));
                            let stored = if wait.is_zero() {
                                Ok(stored.await)
                            } else {
                                tokio::time::timeout_at(waited + wait, stored).await
                            };
                            match stored {
                                Ok(Ok(status)) => tracing::info!(
                                    status,
                                    "the rail answered a forward after its caller had stopped \
                                     waiting; its answer is stored as the idempotency record's"
                                ),
                                Ok(Err(e)) => tracing::warn!(error = %e,
                                    "the rail's late answer broke off; the idempotency record \
                                     stays in doubt"),
                                Err(_) => tracing::warn!(
                                    "the rail's late answer did not arrive whole within \
                                     proxy.late_answer_wait_ms; the idempotency record stays \
                                     in doubt"
                                ),
                            }
                        }
                        true
                    }
                    // The connection failed, or was let go: what was written may still be on
                    // its way.
                    Ok(Err(_)) | Err(_) => {
                        late.ended_unanswered();
                        false
                    }
                };
                // Past its deadline is worth a line; a client hanging up is the client's doing,
                // and a crowd of them would write one line each.
                if why == PAST_DEADLINE {
                    tracing::info!(
                        answered,
                        why,
                        "a forward left by its caller ended; the account's turn passes on"
                    );
                } else {
                    tracing::debug!(
                        answered,
                        why,
                        "a forward left by its caller ended; the account's turn passes on"
                    );
                }
                match turn {
                    Some(turn) if !answered => turn.unanswered(),
                    turn => drop(turn),
                }
                drop(counted);
            }
            .in_current_span(),
        );
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.hand_off("its client went away");
    }
}

impl Rail {
    fn upstream_request(&self, request: Request<Bytes>, asked: MaybeSent) -> Request<Tracked> {
        let (mut parts, body) = request.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let client_host = parts.headers.remove(header::HOST).or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // Origin form: the connection is the rail's already.
        parts.uri = Uri::from(path);
        // RFC 9110 §7.6.3: Via names the protocol railguard *received*.
        let via = match parts.version {
            Version::HTTP_2 => "2 railguard",
            Version::HTTP_10 => "1.0 railguard",
            _ => "1.1 railguard",
        };
        parts.version = Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        // The body was read whole; its length is set from it.
        parts.headers.remove(header::CONTENT_LENGTH);
        let headers = &mut parts.headers;
        headers.insert(header::HOST, self.host.clone());
        if let Some(host) = client_host {
            headers.insert(HeaderName::from_static("x-forwarded-host"), host);
        }
        // RFC 9110 §7.6.3: a gateway appends itself to Via.
        headers.append(header::VIA, HeaderValue::from_static(via));
        headers.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static("http"),
        );
        // The client connection's peer, which the accept loop puts on every request.
        if let Some(arrival) = crate::http::Arrival::of(&parts.extensions) {
            append_forwarded_for(headers, arrival.peer.addr.ip());
        }
        let body = Tracked {
            body: Full::new(body),
            asked,
        };
        Request::from_parts(parts, body)
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// Appends `ip` to the `X-Forwarded-For` chain, folding repeated headers into one.
fn append_forwarded_for(headers: &mut HeaderMap, ip: std::net::IpAddr) {
    use std::fmt::Write as _;
    // One buffer: the chain so far, then this client.
    let mut chain = String::with_capacity(48);
    for earlier in headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
    {
        chain.push_str(earlier);
        chain.push_str(", ");
    }
    let _ = write!(chain, "{ip}");
    if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(chain)) {
        headers.insert(X_FORWARDED_FOR, value);
    }
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including every header named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages name nothing in `Connection` (or carry none): collecting nothing
    // allocates nothing.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests;
