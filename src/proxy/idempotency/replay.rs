//! A rail's answer kept for replay, and a replayed answer.
//!
//! The first request's answer is read as it passes (status, end-to-end headers, body up to
//! `max_response_bytes`) and stored; a repeat gets it back marked `Idempotency-Replayed: true`.
//! A body too long to keep is passed on whole but not stored, and its replay says so.

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::Frame;

use crate::http::{BoxError, ResponseBody, full};
use crate::proxy::ProxyResponse;
use crate::store::records::StoredResponse;

pub(crate) const REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");
pub(crate) const BODY_OMITTED: HeaderName = HeaderName::from_static("idempotency-replay-body");

pub(super) fn replay(stored: StoredResponse) -> ProxyResponse {
    let omitted = stored.body.is_none();
    let mut response = Response::new(full(stored.body.unwrap_or_default()));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    if omitted {
        headers.insert(BODY_OMITTED, HeaderValue::from_static("omitted"));
    }
    response
}

/// Reads the rail's response to store it: the body up to `max` bytes is kept; a longer one is
/// passed on whole but not stored.
pub(super) async fn capture(
    response: ProxyResponse,
    max: usize,
) -> Result<(ProxyResponse, StoredResponse), BoxError> {
    let (parts, mut body) = response.into_parts();
    let headers: Vec<(String, String)> = parts
        .headers
        .iter()
        .filter(|(name, _)| !matches!(name.as_str(), "date" | "content-length"))
        .filter_map(|(name, value)| {
            Some((name.as_str().to_string(), value.to_str().ok()?.to_string()))
        })
        .collect();
    let mut kept = BytesMut::new();
    let mut overflow: Option<Bytes> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if kept.len() + data.len() > max {
            overflow = Some(data);
            break;
        }
        kept.extend_from_slice(&data);
    }
    let kept = kept.freeze();
    let status = parts.status.as_u16();
    match overflow {
        None => {
            let stored = StoredResponse {
                status,
                headers,
                body: Some(kept.clone()),
            };
            Ok((Response::from_parts(parts, full(kept)), stored))
        }
        Some(next) => {
            let head = futures_util::stream::iter([
                Ok::<_, BoxError>(Frame::data(kept)),
                Ok(Frame::data(next)),
            ]);
            let rest = BodyStream::new(body);
            let body: ResponseBody = StreamBody::new(head.chain(rest)).boxed_unsync();
            let stored = StoredResponse {
                status,
                headers,
                body: None,
            };
            Ok((Response::from_parts(parts, body), stored))
        }
    }
}
