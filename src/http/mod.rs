//! What every listener shares, whatever it serves: the response body type, a body from bytes,
//! and the accept loop. It knows nothing of fencing, locks or the rail, so that the proxy, the
//! lock API, the admin listener and the rail simulator can all build on it without importing
//! one another.

mod serve;

pub use serve::serve;

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
