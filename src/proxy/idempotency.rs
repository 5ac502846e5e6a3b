//! Idempotency keys at the proxy (C3 §3.1), below the fence and above the forward.
//!
//! The fence's compare-and-set has already tried to create the request's record, in the same
//! transaction. So by the time a request gets here:
//! - it carries no key: it passes through;
//! - its record was created (`recorded`): it is the first, and is forwarded; the rail's
//!   response is stored (status, end-to-end headers, body up to `max_response_bytes`) before
//!   it is returned — or, if the database cannot take it now, as soon as it can. A forward
//!   that failed before any of the request was sent removes the record again, since the rail
//!   cannot have seen the request; one that failed after (a timeout, a broken connection)
//!   declares the record in doubt at once;
//! - its record already existed: it is a repeat, and never reaches the rail. The same key with
//!   a different request is 422; a repeat while the first is in flight is 409 `in_flight`; a
//!   record in doubt is 409 `in_doubt` (see `crate::idempotency`); a completed one is
//!   replayed, marked `Idempotency-Replayed: true`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::Frame;
use tower::{Layer, Service};

use super::forward::{self, Sent, UpstreamTimeout};
use super::{BoxError, FencedRequest, ProxyBody, ProxyResponse, full};
use crate::high_water::StoreError;
use crate::idempotency::{IdempotencyStore, RecordState, StoredResponse};

/// A repeat that must not be forwarded.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyConflict {
    #[error("a request with this idempotency key is still in flight; retry later")]
    InFlight,
    #[error(
        "a request with this idempotency key was forwarded, and its forward ended without the \
         rail's answer (a timeout, a broken connection, or a proxy that stopped): whether the \
         rail acted is unknown, so it will not be forwarded again. Ask the rail about this \
         idempotency key; an operator can then run `railguard idempotency-forget`"
    )]
    InDoubt,
    #[error("this idempotency key was used for a different request (method, path or body)")]
    Mismatch,
}

/// The idempotency record could not be read.
#[derive(Debug, thiserror::Error)]
#[error("the idempotency record could not be read: {0}")]
pub struct IdempotencyUnavailable(#[from] pub StoreError);

/// Settings of the layer.
#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    pub max_response_bytes: usize,
}

#[derive(Clone)]
pub struct IdempotencyLayer {
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
}

impl IdempotencyLayer {
    pub fn new(store: IdempotencyStore, config: IdempotencyConfig) -> Self {
        Self {
            store,
            config: Arc::new(config),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    store: IdempotencyStore,
    config: Arc<IdempotencyConfig>,
}

const REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");
const BODY_OMITTED: HeaderName = HeaderName::from_static("idempotency-replay-body");

impl<S> Service<FencedRequest> for Idempotency<S>
where
    S: Service<FencedRequest, Response = ProxyResponse, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = ProxyResponse;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<ProxyResponse, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: FencedRequest) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (store, config) = (self.store.clone(), self.config.clone());
        Box::pin(async move {
            let Some(key) = request.idempotency.clone() else {
                return inner.call(request).await;
            };
            let account = request.account.clone();
            let deadline = request.deadline;
            if !key.recorded {
                return repeat(&store, &request, &key.fingerprint, &key.key).await;
            }
            let in_doubt = |error: BoxError| {
                match forward::sent(&error) {
                    Sent::Never => store.forget_unsent(vec![key.owner.clone()]),
                    Sent::Maybe => store.declare_in_doubt_eventually(
                        account.clone(),
                        key.key.clone(),
                        key.owner.clone(),
                    ),
                }
                error
            };
            let response = inner.call(request).await.map_err(in_doubt)?;
            // The rail has answered; its body must arrive within the deadline too, or the
            // record is in doubt (the rail acted, but its answer is not known).
            let captured =
                tokio::time::timeout_at(deadline, capture(response, config.max_response_bytes))
                    .await
                    .map_err(|_| -> BoxError { UpstreamTimeout::no_answer(Sent::Maybe).into() })
                    .and_then(|captured| captured);
            let (response, stored) = captured.inspect_err(|_| {
                store.declare_in_doubt_eventually(
                    account.clone(),
                    key.key.clone(),
                    key.owner.clone(),
                );
            })?;
            if let Err(e) = store
                .complete(&account, &key.key, &key.owner, &stored)
                .await
            {
                // The rail acted; the client hears its answer now, and the record is completed
                // as soon as the database takes it (a repeat meanwhile gets in_flight).
                tracing::warn!(error = %e, account = %account,
                    "could not store the rail's response for replay yet; retrying in the background");
                store.complete_eventually(account, key.key, key.owner, stored);
            }
            Ok(response)
        })
    }
}

/// A repeat of a key whose record already exists.
async fn repeat(
    store: &IdempotencyStore,
    request: &FencedRequest,
    fingerprint: &str,
    key: &str,
) -> Result<ProxyResponse, BoxError> {
    let record = store
        .find(&request.account, key)
        .await
        .map_err(IdempotencyUnavailable)?;
    // Gone since the compare-and-set saw it (retention, or an operator): ask for a retry
    // rather than forward on a guess.
    let Some(record) = record else {
        return Err(IdempotencyConflict::InFlight.into());
    };
    if record.fingerprint != fingerprint {
        return Err(IdempotencyConflict::Mismatch.into());
    }
    match record.state {
        RecordState::InDoubt => Err(IdempotencyConflict::InDoubt.into()),
        RecordState::InFlight => Err(IdempotencyConflict::InFlight.into()),
        RecordState::Done(stored) => Ok(replay(stored)),
    }
}

fn replay(stored: StoredResponse) -> ProxyResponse {
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
async fn capture(
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
            let body: ProxyBody = StreamBody::new(head.chain(rest)).boxed_unsync();
            let stored = StoredResponse {
                status,
                headers,
                body: None,
            };
            Ok((Response::from_parts(parts, body), stored))
        }
    }
}
