//! What every listener shares, whatever it serves: the response body type, a body from bytes,
//! the accept loop with its limits, and who is on the other end of a connection ([`Peer`]). It knows nothing of fencing, locks or the rail, so that the proxy, the
//! lock API, the admin listener and the rail simulator can all build on it without importing
//! one another.

mod connection;
mod framing;
mod serve;

pub use connection::Refusal;
pub use framing::DeclaredBody;
pub use serve::{Listener, serve};

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

/// `text` with every `%` and two hex digits replaced by the byte they name; anything else,
/// a `%` without two hex digits after it included, as it is.
pub fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// An error of any layer, as tower and hyper pass them around.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response railguard sends: a rail's streamed answer or bytes of its own.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// A response body holding `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Who is on the other end of a connection: given to the factory of each connection's service,
/// and carried by each of its requests in its [`Arrival`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The SHA-256 of the DER of the client's leaf certificate, verified against the
    /// listener's client CA during the TLS handshake. `None` on plain TCP, or when the client
    /// sent no certificate (`tls_client_auth = "optional"`).
    pub client_cert_sha256: Option<[u8; 32]>,
}

/// What the accept loop knows of a request and puts on every one, as one extension (one
/// allocation, not one a fact).
#[derive(Debug, Clone)]
pub struct Arrival {
    /// The connection's other end.
    pub peer: Peer,
    /// How long the body may take to arrive once the head has: the listener's
    /// `header_read_timeout_ms`. While a request is in flight the connection's own timeouts do
    /// not run (a lock acquire may wait for minutes with nothing to read), so a reader of a
    /// body bounds the read with this.
    pub body_timeout: Duration,
    /// What the request's chunked body declared so far (HTTP/1).
    pub declared: DeclaredBody,
}

impl Arrival {
    /// The request's [`Arrival`], when it came through the accept loop.
    pub fn of(extensions: &http::Extensions) -> Option<&Self> {
        extensions.get::<Self>()
    }
}

/// Why a small request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SmallBodyError {
    /// The client sent the head and then not the whole body in time: 408, nothing was done.
    #[error("the request body did not arrive within {} ms", .0.as_millis())]
    TimedOut(Duration),
    /// Larger than allowed, or broken off: 400.
    #[error("cannot read the body (at most {max} bytes): {why}")]
    Unreadable { max: usize, why: String },
}

/// Reads a request body of at most `max` bytes whole, within the request's
/// [`Arrival::body_timeout`] (10 s on a request that carries none).
pub async fn read_small_body(
    request: Request<Incoming>,
    max: usize,
) -> Result<Bytes, SmallBodyError> {
    let timeout =
        Arrival::of(request.extensions()).map_or(Duration::from_secs(10), |a| a.body_timeout);
    let read = Limited::new(request.into_body(), max).collect();
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) => Err(SmallBodyError::Unreadable {
            max,
            why: e.to_string(),
        }),
        Err(_) => Err(SmallBodyError::TimedOut(timeout)),
    }
}
