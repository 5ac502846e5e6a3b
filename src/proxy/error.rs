//! The one place where a failed request becomes an HTTP response.
//!
//! Inside the stack every failure travels as a boxed error of its own small type, defined next
//! to the layer that produces it. [`rejection`] walks the error's cause chain, finds the first
//! type it knows, and decides the status, the JSON body and the `outcome` metric label. Who
//! caused the failure — the client, the rail, the database, or the proxy itself — is part of
//! that decision and of the body. An error nobody recognises is a bug: it is logged once,
//! in full, and the client gets a generic 500.
//!
//! The 409 body names the account and the presented token and never the current high-water
//! mark (C2 §2.2): a client that learned the mark could present it, which is ADR-002 §A2.3.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

use super::extract::{BadProof, BadRequest, BodyTooLarge, ClientTimeout, MethodRefused};
use super::fence::{FenceUnavailable, FencedOut};
use super::forward::{UpstreamTimeout, UpstreamUnavailable};
use super::idempotency::{IdempotencyConflict, IdempotencyUnavailable};
use super::{BoxError, ResponseBody, full};
use crate::metrics::Outcome;

/// Who a failure is attributed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    Client,
    Database,
    Upstream,
    Proxy,
}

/// A refusal, ready to be rendered.
#[derive(Debug, Serialize)]
pub struct Rejection {
    #[serde(skip)]
    pub status: StatusCode,
    #[serde(skip)]
    pub outcome: Outcome,
    /// Stable, machine-readable code.
    pub error: &'static str,
    pub message: String,
    pub origin: Origin,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl Rejection {
    fn new(
        status: StatusCode,
        outcome: Outcome,
        error: &'static str,
        origin: Origin,
        message: String,
    ) -> Self {
        Self {
            status,
            outcome,
            error,
            message,
            origin,
            account: None,
            token: None,
            request_id: None,
        }
    }

    pub fn into_response(self) -> Response<ResponseBody> {
        let body = serde_json::to_vec(&self).expect("rejection serializes");
        let mut response = Response::new(full(Bytes::from(body)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// Decides the response for `error`.
pub fn rejection(error: &BoxError) -> Rejection {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error.as_ref());
    while let Some(e) = cause {
        if let Some(e) = e.downcast_ref::<FencedOut>() {
            let mut r = Rejection::new(
                StatusCode::CONFLICT,
                Outcome::FencedOut,
                "fenced_out",
                Origin::Client,
                "the fencing token is below the account's high-water mark: this grant has been \
                 superseded and must stop; do not retry with another token"
                    .into(),
            );
            r.account = Some(e.account.to_string());
            r.token = Some(e.token.get());
            return r;
        }
        if let Some(e) = e.downcast_ref::<BadRequest>() {
            return Rejection::new(
                StatusCode::BAD_REQUEST,
                Outcome::BadRequest,
                "bad_request",
                Origin::Client,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<BadProof>() {
            return Rejection::new(
                StatusCode::BAD_REQUEST,
                Outcome::BadProof,
                "invalid_fencing_proof",
                Origin::Client,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<MethodRefused>() {
            return Rejection::new(
                StatusCode::METHOD_NOT_ALLOWED,
                Outcome::BadRequest,
                "method_not_allowed",
                Origin::Client,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<BodyTooLarge>() {
            return Rejection::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                Outcome::BodyTooLarge,
                "body_too_large",
                Origin::Client,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<ClientTimeout>() {
            return Rejection::new(
                StatusCode::REQUEST_TIMEOUT,
                Outcome::Timeout,
                "request_timeout",
                Origin::Client,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<FenceUnavailable>() {
            // The database's own words stay in the log: they describe our infrastructure.
            tracing::warn!(error = %e, "fence check unavailable");
            return Rejection::new(
                StatusCode::SERVICE_UNAVAILABLE,
                Outcome::DatabaseUnavailable,
                "database_unavailable",
                Origin::Database,
                "the fence check could not be made; nothing was forwarded, retry later".into(),
            );
        }
        if let Some(e) = e.downcast_ref::<IdempotencyConflict>() {
            let (status, code) = match e {
                IdempotencyConflict::InFlight => (StatusCode::CONFLICT, "in_flight"),
                IdempotencyConflict::InDoubt => (StatusCode::CONFLICT, "in_doubt"),
                IdempotencyConflict::Mismatch => {
                    (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
                }
            };
            return Rejection::new(
                status,
                Outcome::IdempotentRefused,
                code,
                Origin::Client,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<IdempotencyUnavailable>() {
            tracing::warn!(error = %e, "idempotency record unavailable");
            return Rejection::new(
                StatusCode::SERVICE_UNAVAILABLE,
                Outcome::DatabaseUnavailable,
                "database_unavailable",
                Origin::Database,
                "the idempotency record could not be read; nothing was forwarded, retry later"
                    .into(),
            );
        }
        if let Some(e) = e.downcast_ref::<UpstreamUnavailable>() {
            return Rejection::new(
                StatusCode::BAD_GATEWAY,
                Outcome::UpstreamUnavailable,
                "upstream_unavailable",
                Origin::Upstream,
                e.to_string(),
            );
        }
        if let Some(e) = e.downcast_ref::<UpstreamTimeout>() {
            return Rejection::new(
                StatusCode::GATEWAY_TIMEOUT,
                Outcome::UpstreamTimeout,
                "upstream_timeout",
                Origin::Upstream,
                e.to_string(),
            );
        }
        cause = e.source();
    }
    tracing::error!(error = %error, debug = ?error, "unexpected error in the proxy stack");
    Rejection::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        Outcome::Internal,
        "internal",
        Origin::Proxy,
        "internal error".into(),
    )
}
