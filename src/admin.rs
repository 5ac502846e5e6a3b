//! The admin listener: `/metrics`, `/healthz`, `/readyz`.
//!
//! It has its own port so that a scrape or a health probe never queues behind payment
//! traffic, and so that the proxy's port carries nothing but the rail's API.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use crate::high_water::HighWaterStore;
use crate::metrics::Metrics;
use crate::proxy::{ProxyBody, full};

#[derive(Clone)]
pub struct Admin {
    pub metrics: Arc<Metrics>,
    pub store: HighWaterStore,
}

impl Admin {
    pub async fn handle(
        self,
        request: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let reply = |status: StatusCode, content_type: &'static str, body: String| {
            Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, content_type)
                .body(full(body))
                .expect("static response parts")
        };
        if request.method() != Method::GET {
            return Ok(reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "GET only\n".into(),
            ));
        }
        Ok(match request.uri().path() {
            "/metrics" => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
            "/readyz" => match self.store.ready().await {
                Ok(()) => reply(StatusCode::OK, "text/plain", "ready\n".into()),
                Err(why) => reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                ),
            },
            _ => reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found; try /metrics, /healthz, /readyz\n".into(),
            ),
        })
    }
}
