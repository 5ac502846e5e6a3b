//! The outermost layer of the proxy's own stack: turns every error into its one response
//! (through `error::rejection`), counts the request's outcome and logs refusals.
//!
//! Below this layer a refusal is an `Err`; above it there are only responses.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tower::{Layer, Service};

use super::error::rejection;
use super::{BoxError, ProxyResponse};
use crate::metrics::{Metrics, Outcome};

#[derive(Clone)]
pub struct RespondLayer {
    metrics: Arc<Metrics>,
}

impl RespondLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self { metrics }
    }
}

impl<S> Layer<S> for RespondLayer {
    type Service = Respond<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Respond {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Respond<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B> Service<Request<B>> for Respond<S>
where
    S: Service<Request<B>, Response = ProxyResponse, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = ProxyResponse;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<ProxyResponse, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The inner services are always ready; an error here would be a bug below, and the
        // request it belongs to is answered by `call`.
        match self.inner.poll_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(_) => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let metrics = self.metrics.clone();
        // A shared handle to the header's bytes; text only for a refusal's body.
        let request_id = request.headers().get("x-request-id").cloned();
        Box::pin(async move {
            match inner.call(request).await {
                Ok(response) => {
                    let replayed = response.headers().contains_key("idempotency-replayed");
                    metrics.record_outcome(if replayed {
                        Outcome::Replayed
                    } else {
                        Outcome::Forwarded
                    });
                    Ok(response)
                }
                Err(error) => {
                    let mut rejection = rejection(&error);
                    metrics.record_outcome(rejection.outcome);
                    if rejection.outcome != Outcome::FencedOut {
                        tracing::info!(status = rejection.status.as_u16(), error = rejection.error,
                            message = %rejection.message, "request refused");
                    }
                    rejection.request_id = request_id
                        .as_ref()
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string);
                    Ok(rejection.into_response())
                }
            }
        })
    }
}
