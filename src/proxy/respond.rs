//! The outermost layer of the proxy's own stack: names the request (`x-request-id`, the client's
//! or one of ours, sent on to the rail and back with the answer) and opens its span
//! (`proxy.request`, which carries `lock.token` and `account` once they are read), turns every
//! error into its one response (through `error::rejection`), counts the request's outcome and
//! logs refusals.
//!
//! Below this layer a refusal is an `Err`; above it there are only responses.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderName, Request};
use tokio::time::Instant;
use tower::{Layer, Service};
use tracing::Instrument;

use super::error::rejection;
use super::{ProxyResponse, RequestIds, Step};
use crate::metrics::{Metrics, Outcome};

/// The header that names a request: the client's, or one this process makes.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

#[derive(Clone)]
pub struct RespondLayer {
    metrics: Arc<Metrics>,
    ids: RequestIds,
}

impl RespondLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            ids: RequestIds::default(),
        }
    }
}

impl<S> Layer<S> for RespondLayer {
    type Service = Respond<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Respond(Arc::new(Responding {
            inner,
            metrics: self.metrics.clone(),
            ids: self.ids.clone(),
        }))
    }
}

/// The tower service at the top of the proxy's steps: each request's way down them is the one
/// future this boxes.
pub struct Respond<S>(Arc<Responding<S>>);

struct Responding<S> {
    inner: S,
    metrics: Arc<Metrics>,
    ids: RequestIds,
}

impl<S> Clone for Respond<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S, B> Service<Request<B>> for Respond<S>
where
    S: Step<Request<B>>,
    B: Send + 'static,
{
    type Response = ProxyResponse;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<ProxyResponse, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Steps are always ready: they hold no per-request capacity of their own (limits are
        // the listener's, before this).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let this = self.0.clone();
        // The client's id for the request, or one of ours: sent on to the rail with it, and
        // back to the client with the answer.
        let request_id = match request.headers().get(X_REQUEST_ID) {
            Some(id) => Some(id.clone()),
            None => this.ids.next().inspect(|id| {
                request.headers_mut().insert(X_REQUEST_ID, id.clone());
            }),
        };
        let span = tracing::info_span!("proxy.request",
            method = %request.method(),
            path = request.uri().path(),
            request_id = request_id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or(""),
            lock.token = tracing::field::Empty,
            account = tracing::field::Empty);
        Box::pin(
            async move {
                // The clock is read for the log line only when it is written.
                let started = tracing::enabled!(tracing::Level::DEBUG).then(Instant::now);
                tracing::debug!("started processing request");
                let mut response = match this.inner.handle(request).await {
                    Ok(response) => {
                        let replayed = response.headers().contains_key("idempotency-replayed");
                        this.metrics.record_outcome(if replayed {
                            Outcome::Replayed
                        } else {
                            Outcome::Forwarded
                        });
                        response
                    }
                    Err(error) => {
                        let mut rejection = rejection(&error);
                        this.metrics.record_outcome(rejection.outcome);
                        if rejection.outcome != Outcome::FencedOut {
                            tracing::info!(status = rejection.status.as_u16(), error = rejection.error,
                                message = %rejection.message, "request refused");
                        }
                        rejection.request_id = request_id
                            .as_ref()
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        rejection.into_response()
                    }
                };
                // The rail's own id for its answer, if it gave one, is left as it is.
                if let Some(id) = request_id
                    && !response.headers().contains_key(X_REQUEST_ID)
                {
                    response.headers_mut().insert(X_REQUEST_ID, id);
                }
                if let Some(started) = started {
                    tracing::debug!(latency_ms = started.elapsed().as_secs_f64() * 1000.0,
                        status = response.status().as_u16(), "finished processing request");
                }
                Ok(response)
            }
            .instrument(span),
        )
    }
}
