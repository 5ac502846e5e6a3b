//! What every listener shares, whatever it serves: the response body type, a body from bytes,
//! the accept loop with its limits, and who is on the other end of a connection ([`Peer`]). It knows nothing of fencing, locks or the rail, so that the proxy, the
//! lock API, the admin listener and the rail simulator can all build on it without importing
//! one another.

mod connection;
mod serve;

pub use connection::Refusal;
pub use serve::{Listener, serve};

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

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
/// and carried by each of its requests as an extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The SHA-256 of the DER of the client's leaf certificate, verified against the
    /// listener's client CA during the TLS handshake. `None` on plain TCP, or when the client
    /// sent no certificate (`tls_client_auth = "optional"`).
    pub client_cert_sha256: Option<[u8; 32]>,
}
