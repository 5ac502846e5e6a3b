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
use super::idempotency::REPLAYED;
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
                        let replayed = response.headers().contains_key(REPLAYED);
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
                    && let http::header::Entry::Vacant(vacant) =
                        response.headers_mut().entry(X_REQUEST_ID)
                {
                    vacant.insert(id);
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

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Response, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;
    use crate::proxy::{BoxError, StepFn, full};

    /// What reaches the step below: the request id it was sent with.
    type Seen = Arc<std::sync::Mutex<Option<HeaderValue>>>;

    /// Respond over a step that notes the request's id and answers with `answer`.
    fn respond(
        seen: &Seen,
        answer: fn() -> Result<ProxyResponse, BoxError>,
    ) -> Respond<impl Step<Request<()>>> {
        let seen = seen.clone();
        RespondLayer::new(Arc::new(Metrics::new())).layer(StepFn(move |request: Request<()>| {
            *seen.lock().unwrap() = request.headers().get(X_REQUEST_ID).cloned();
            async move { answer() }
        }))
    }

    fn paid() -> Result<ProxyResponse, BoxError> {
        Ok(Response::builder().status(201).body(full("paid")).unwrap())
    }

    fn with_the_rails_own_id() -> Result<ProxyResponse, BoxError> {
        Ok(Response::builder()
            .status(201)
            .header(X_REQUEST_ID, "rail-9")
            .body(full("paid"))
            .unwrap())
    }

    fn refused() -> Result<ProxyResponse, BoxError> {
        Err(crate::proxy::fence::FencedOut {
            account: crate::token::AccountId::parse("acct-1", 64).unwrap(),
            token: crate::token::FencingToken::new(3).unwrap(),
            below_floor: false,
        }
        .into())
    }

    fn id(response: &ProxyResponse) -> &str {
        response.headers()[X_REQUEST_ID].to_str().unwrap()
    }

    // A request without an id gets one of ours, sent on with it and back with the answer; two
    // requests get two.
    #[tokio::test]
    async fn a_request_without_an_id_gets_one_that_goes_on_with_it_and_back() {
        let seen = Seen::default();
        let service = respond(&seen, paid);
        let first = service.clone().oneshot(Request::new(())).await.unwrap();
        let sent = seen
            .lock()
            .unwrap()
            .take()
            .expect("an id went down with it");
        assert_eq!(first.headers()[X_REQUEST_ID], sent);
        let second = service.oneshot(Request::new(())).await.unwrap();
        assert_ne!(id(&first), id(&second));
    }

    // The client's id is the request's: sent on, and back with the answer.
    #[tokio::test]
    async fn the_clients_id_is_sent_on_and_back() {
        let seen = Seen::default();
        let mut request = Request::new(());
        request
            .headers_mut()
            .insert(X_REQUEST_ID, HeaderValue::from_static("client-7"));
        let answer = respond(&seen, paid).oneshot(request).await.unwrap();
        assert_eq!(id(&answer), "client-7");
        assert_eq!(seen.lock().unwrap().as_ref().unwrap(), "client-7");
    }

    // The rail's own id on its answer is left as the rail sent it.
    #[tokio::test]
    async fn the_rails_own_id_on_its_answer_is_kept() {
        let seen = Seen::default();
        let mut request = Request::new(());
        request
            .headers_mut()
            .insert(X_REQUEST_ID, HeaderValue::from_static("client-7"));
        let answer = respond(&seen, with_the_rails_own_id)
            .oneshot(request)
            .await
            .unwrap();
        assert_eq!(id(&answer), "rail-9");
    }

    // A refusal names the request in its header and its body.
    #[tokio::test]
    async fn a_refusal_names_the_request() {
        let seen = Seen::default();
        let answer = respond(&seen, refused)
            .oneshot(Request::new(()))
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::CONFLICT);
        let header = id(&answer).to_string();
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["request_id"], header.as_str());
    }
}
