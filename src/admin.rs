//! The admin listener: `/metrics`, `/healthz`, `/readyz`, and the operator's way out of an
//! idempotency record in doubt (`POST /idempotency/forget`).
//!
//! It has its own port (loopback by default) so that a scrape or a health probe never queues
//! behind payment traffic, and so that the proxy's port carries nothing but the rail's API.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::Deserialize;

use crate::http::{ResponseBody, full};
use crate::metrics::Metrics;
use crate::proxy::fence::HighWaterStore;
use crate::proxy::idempotency::{Forgot, IdempotencyStore};
use crate::token::AccountId;

#[derive(Clone)]
pub struct Admin {
    pub metrics: Arc<Metrics>,
    pub store: HighWaterStore,
    pub idempotency: IdempotencyStore,
    pub max_account_len: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForgetRequest {
    account: String,
    key: String,
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<ResponseBody> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(full(body))
        .expect("static response parts")
}

impl Admin {
    pub async fn handle(
        self,
        request: Request<Incoming>,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let path = request.uri().path().to_string();
        Ok(match (request.method().clone(), path.as_str()) {
            (Method::GET, "/metrics") => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            (Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n".into()),
            (Method::GET, "/readyz") => match self.store.ready().await {
                Ok(()) => reply(StatusCode::OK, "text/plain", "ready\n".into()),
                Err(why) => reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                ),
            },
            (Method::POST, "/idempotency/forget") => self.forget(request).await,
            (_, "/metrics" | "/healthz" | "/readyz" | "/idempotency/forget") => reply(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "method not allowed\n".into(),
            ),
            _ => reply(
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found; try /metrics, /healthz, /readyz, POST /idempotency/forget\n".into(),
            ),
        })
    }

    async fn forget(&self, request: Request<Incoming>) -> Response<ResponseBody> {
        let body = match Limited::new(request.into_body(), 4096).collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) => {
                return reply(
                    StatusCode::BAD_REQUEST,
                    "text/plain",
                    format!("cannot read the body: {e}\n"),
                );
            }
        };
        let asked: ForgetRequest = match serde_json::from_slice(&body) {
            Ok(asked) => asked,
            Err(e) => {
                return reply(
                    StatusCode::BAD_REQUEST,
                    "text/plain",
                    format!("expected {{\"account\", \"key\"}}: {e}\n"),
                );
            }
        };
        let account = match AccountId::parse(&asked.account, self.max_account_len) {
            Ok(account) => account,
            Err(e) => {
                return reply(
                    StatusCode::BAD_REQUEST,
                    "text/plain",
                    format!("account {e}\n"),
                );
            }
        };
        let (status, message) = match self.idempotency.forget_in_doubt(&account, &asked.key).await {
            Ok(Forgot::Forgotten) => {
                tracing::warn!(account = %account, key = asked.key, "an operator forgot an idempotency record in doubt");
                (StatusCode::OK, "forgotten: the next retry of this key will be forwarded".to_string())
            }
            Ok(Forgot::Completed) => (
                StatusCode::CONFLICT,
                "the record is complete: the rail answered and repeats get its response; nothing to forget".into(),
            ),
            Ok(Forgot::StillInFlight) => (
                StatusCode::CONFLICT,
                "the record is in flight and not yet in doubt: its owner's deadline has not passed, and its forward may still be running".into(),
            ),
            Ok(Forgot::OwnerMayStillSend) => (
                StatusCode::CONFLICT,
                "the railguard process that owns the record is still running (it may be paused, or still writing the request to the rail): it may still send it. Stop or restart that process, then retry".into(),
            ),
            Ok(Forgot::OwnerUnknown) => (
                StatusCode::CONFLICT,
                "PostgreSQL restarted since the record was made, so whether its owning railguard process still runs cannot be seen; the record is left as it is".into(),
            ),
            Ok(Forgot::NotFound) => (StatusCode::NOT_FOUND, "no record for this account and key".into()),
            Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}")),
        };
        reply(status, "text/plain", format!("{message}\n"))
    }
}

/// The `idempotency-forget` command: asks the railguard whose admin listener is `admin` to
/// forget `key` of `account`. Returns its answer, as an error unless it forgot the record.
pub async fn forget_idempotency_key(
    admin: SocketAddr,
    account: &str,
    key: &str,
) -> Result<String, String> {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let host = if admin.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], admin.port()))
    } else {
        admin
    };
    let body = serde_json::json!({ "account": account, "key": key }).to_string();
    let request = Request::post(format!("http://{host}/idempotency/forget"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
        .await
        .map_err(|_| format!("railguard's admin listener at {host} did not answer"))?
        .map_err(|e| {
            format!("cannot reach railguard's admin listener at {host} (is it running?): {e}")
        })?;
    let status = response.status();
    let text = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    if status == StatusCode::OK {
        Ok(text)
    } else {
        Err(format!("{status}: {text}"))
    }
}
