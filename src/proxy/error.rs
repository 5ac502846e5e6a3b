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

use std::borrow::Cow;
use std::error::Error;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

use super::authorize::{Forbidden, Unauthorized};
use super::extract::{
    BadProof, BadRequest, BodyTooLarge, ClientTimeout, ImplausibleToken, MethodRefused,
    SourceUnavailable,
};
use super::fence::{FenceUnavailable, FencedOut};
use super::forward::{UpstreamTimeout, UpstreamUnavailable};
use super::idempotency::{IdempotencyConflict, IdempotencyUnavailable};
use super::{BoxError, ResponseBody, full};
use crate::metrics::Outcome;
use crate::store::marks::StoreError;

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
    pub message: Cow<'static, str>,
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
        message: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            status,
            outcome,
            error,
            message: message.into(),
            origin,
            account: None,
            token: None,
            request_id: None,
        }
    }

    pub fn into_response(self) -> Response<ResponseBody> {
        // Room for a usual refusal's body at once (serde_json's own starts at 128 bytes and
        // grows); a longer one, with a long account or request id, still grows.
        let mut body = Vec::with_capacity(384);
        serde_json::to_writer(&mut body, &self).expect("rejection serializes");
        let mut response = Response::new(full(Bytes::from(body)));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                crate::auth::Unauthenticated::Missing.challenge(),
            );
        }
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::METHOD_NOT_ALLOWED {
            // Only CONNECT is refused; every other method is forwarded.
            headers.insert(header::ALLOW, HeaderValue::from_static(PROXY_ALLOW));
        }
        response
    }
}

/// The methods the proxy forwards, for the `Allow` header of its 405 (RFC 9110 §15.5.6):
/// the standard ones but `CONNECT`.
pub const PROXY_ALLOW: &str = "GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH";

/// The answer to a request the proxy listener had no room for (`proxy.max_in_flight`): 503,
/// `overloaded`, nothing forwarded. Counted in `railguard_listener_refusals_total`, not as an
/// `outcome`: the request never entered the proxy's stack.
pub fn overloaded() -> Response<ResponseBody> {
    Rejection::new(
        StatusCode::SERVICE_UNAVAILABLE,
        Outcome::Internal,
        "overloaded",
        Origin::Proxy,
        "too many requests in flight on this listener (proxy.max_in_flight); nothing was \
         forwarded, retry later",
    )
    .into_response()
}

/// Every error type with a response of its own, one line per type, in the order each cause
/// is tried against them. `crate::openapi` checks that each one's response is documented.
const RESPONDERS: &[fn(&(dyn Error + 'static)) -> Option<Rejection>] = &[
    |e| rescue(e, Rejection::unauthorized),
    |e| rescue(e, Rejection::forbidden),
    |e| rescue(e, Rejection::fenced_out),
    |e| rescue(e, Rejection::bad_request),
    |e| rescue(e, Rejection::bad_proof),
    |e| rescue(e, Rejection::implausible_token),
    |e| rescue(e, Rejection::source_unavailable),
    |e| rescue(e, Rejection::method_refused),
    |e| rescue(e, Rejection::body_too_large),
    |e| rescue(e, Rejection::client_timeout),
    |e| rescue(e, Rejection::fence_unavailable),
    |e| rescue(e, Rejection::idempotency_conflict),
    |e| rescue(e, Rejection::idempotency_unavailable),
    |e| rescue(e, Rejection::upstream_unavailable),
    |e| rescue(e, Rejection::upstream_timeout),
];

/// Decides the response for `error`: the first error in its cause chain that has a response
/// of its own (see `RESPONDERS`).
pub fn rejection(error: &BoxError) -> Rejection {
    match responder(error) {
        Some((_, rejection)) => rejection,
        None => Rejection::internal(error),
    }
}

/// The first error in `error`'s cause chain that has a response: which responder answered it
/// (its index in [`RESPONDERS`]), and the response.
fn responder(error: &BoxError) -> Option<(usize, Rejection)> {
    let mut cause: Option<&(dyn Error + 'static)> = Some(error.as_ref());
    while let Some(e) = cause {
        let found = RESPONDERS
            .iter()
            .enumerate()
            .find_map(|(i, respond)| respond(e).map(|rejection| (i, rejection)));
        if found.is_some() {
            return found;
        }
        cause = e.source();
    }
    None
}

/// `respond(e)` if `e` is a `T`.
fn rescue<T: Error + 'static>(
    e: &(dyn Error + 'static),
    respond: fn(&T) -> Rejection,
) -> Option<Rejection> {
    e.downcast_ref::<T>().map(respond)
}

/// The response of each error type.
impl Rejection {
    fn unauthorized(e: &Unauthorized) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            Outcome::Unauthenticated,
            "unauthenticated",
            Origin::Client,
            e.to_string(),
        )
    }

    fn forbidden(e: &Forbidden) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            Outcome::Forbidden,
            "forbidden",
            Origin::Client,
            e.to_string(),
        )
    }

    fn fenced_out(e: &FencedOut) -> Self {
        let (outcome, message) = if e.below_floor {
            (
                Outcome::FencedBelowFloor,
                "the fencing token's grant was made before the fencing store last went back (a \
                 failover, a restart, a restore): this grant must stop; take a new grant",
            )
        } else {
            (
                Outcome::FencedOut,
                "the fencing token is below the account's high-water mark: this grant has been \
                 superseded and must stop; do not retry with another token",
            )
        };
        let mut r = Self::new(
            StatusCode::CONFLICT,
            outcome,
            "fenced_out",
            Origin::Client,
            message,
        );
        r.account = Some(e.account.to_string());
        r.token = Some(e.token.get());
        r
    }

    fn bad_request(e: &BadRequest) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::BAD_REQUEST,
            Outcome::BadRequest,
            "bad_request",
            Origin::Client,
            message,
        )
    }

    fn implausible_token(e: &ImplausibleToken) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            Outcome::BadProof,
            "implausible_token",
            Origin::Client,
            format!(
                "{e}: it was never granted; nothing was forwarded and no mark moved. Send the \
                 grant's fencing_proof with its token"
            ),
        )
    }

    fn source_unavailable(e: &SourceUnavailable) -> Self {
        tracing::warn!(error = %e, "cannot check an unproven token against the token source");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            Outcome::DatabaseUnavailable,
            "token_source_unavailable",
            Origin::Database,
            "a token sent without a proof could not be checked against the token source; \
             nothing was forwarded, retry later",
        )
    }

    fn bad_proof(e: &BadProof) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::BAD_REQUEST,
            Outcome::BadProof,
            "invalid_fencing_proof",
            Origin::Client,
            message,
        )
    }

    fn method_refused(e: &MethodRefused) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            Outcome::BadRequest,
            "method_not_allowed",
            Origin::Client,
            message,
        )
    }

    fn body_too_large(e: &BodyTooLarge) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            Outcome::BodyTooLarge,
            "body_too_large",
            Origin::Client,
            message,
        )
    }

    fn client_timeout(e: &ClientTimeout) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            Outcome::Timeout,
            "request_timeout",
            Origin::Client,
            message,
        )
    }

    fn fence_unavailable(e: &FenceUnavailable) -> Self {
        let message = match &e.0 {
            // A pause railguard keeps on purpose, logged where it started (`store::handover`).
            StoreError::HeldAfterStoreChange(_) => {
                "the database changed server moments ago: newer grants' payments wait until \
                 nothing sent before the change can still reach the rail; nothing was \
                 forwarded, retry later"
            }
            _ => {
                // The database's own words stay in the log: they describe our infrastructure.
                tracing::warn!(error = %e, "fence check unavailable");
                "the fence check could not be made; nothing was forwarded, retry later"
            }
        };
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            Outcome::DatabaseUnavailable,
            "database_unavailable",
            Origin::Database,
            message,
        )
    }

    fn idempotency_conflict(e: &IdempotencyConflict) -> Self {
        let (status, code) = match e {
            IdempotencyConflict::InFlight => (StatusCode::CONFLICT, "in_flight"),
            IdempotencyConflict::InDoubt
            | IdempotencyConflict::FirstAttemptLost
            | IdempotencyConflict::FirstAttemptOnTheRail => (StatusCode::CONFLICT, "in_doubt"),
            IdempotencyConflict::Mismatch => {
                (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
            }
            IdempotencyConflict::NotOnTheRail => (StatusCode::CONFLICT, "not_on_the_rail"),
        };
        Self::new(
            status,
            Outcome::IdempotentRefused,
            code,
            Origin::Client,
            e.to_string(),
        )
    }

    fn idempotency_unavailable(e: &IdempotencyUnavailable) -> Self {
        tracing::warn!(error = %e, "idempotency record unavailable");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            Outcome::DatabaseUnavailable,
            "database_unavailable",
            Origin::Database,
            "the idempotency record could not be read; nothing was forwarded, retry later",
        )
    }

    fn upstream_unavailable(e: &UpstreamUnavailable) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::BAD_GATEWAY,
            Outcome::UpstreamUnavailable,
            "upstream_unavailable",
            Origin::Upstream,
            message,
        )
    }

    fn upstream_timeout(e: &UpstreamTimeout) -> Self {
        let message = e.to_string();
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            Outcome::UpstreamTimeout,
            "upstream_timeout",
            Origin::Upstream,
            message,
        )
    }

    /// An error nobody recognises is a bug: logged once, in full; the client learns nothing.
    fn internal(error: &BoxError) -> Self {
        tracing::error!(error = %error, debug = ?error, "unexpected error in the proxy stack");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            Outcome::Internal,
            "internal",
            Origin::Proxy,
            "internal error",
        )
    }
}

/// One error of each kind that has a response (every variant of those that are enums), and one
/// that nobody knows (the 500): what `crate::openapi` checks against the document. A responder
/// without an example here fails `every_responder_has_an_example`; the matches stop a new
/// variant from compiling until it has one.
#[cfg(test)]
pub(crate) fn examples() -> Vec<BoxError> {
    use std::time::Duration;

    use http::{HeaderName, Method};

    use crate::proxy::forward::Sent;
    use crate::store::marks::StoreError;
    use crate::token::{AccountId, FencingToken};

    let header = HeaderName::from_static("fencing-token");
    let bad_requests = [
        BadRequest::Header {
            header: header.clone(),
            reason: "is missing".into(),
        },
        BadRequest::Body("reset".into()),
    ];
    for e in &bad_requests {
        match e {
            BadRequest::Header { .. } | BadRequest::Body(_) => {}
        }
    }
    let conflicts = [
        IdempotencyConflict::InFlight,
        IdempotencyConflict::InDoubt,
        IdempotencyConflict::Mismatch,
        IdempotencyConflict::FirstAttemptLost,
        IdempotencyConflict::FirstAttemptOnTheRail,
        IdempotencyConflict::NotOnTheRail,
    ];
    for e in &conflicts {
        match e {
            IdempotencyConflict::InFlight
            | IdempotencyConflict::InDoubt
            | IdempotencyConflict::Mismatch
            | IdempotencyConflict::FirstAttemptLost
            | IdempotencyConflict::FirstAttemptOnTheRail
            | IdempotencyConflict::NotOnTheRail => {}
        }
    }
    let mut examples: Vec<BoxError> = vec![
        Box::new(Unauthorized(crate::auth::Unauthenticated::Missing)),
        Box::new(Forbidden {
            reason: "identity \"eu\" may not pay on this account".into(),
        }),
        Box::new(FencedOut {
            account: AccountId::parse("acct-1", 64).expect("valid account"),
            token: FencingToken::new(41).expect("valid token"),
            below_floor: false,
        }),
        Box::new(BadProof {
            header,
            reason: "is missing",
        }),
        Box::new(ImplausibleToken {
            header: HeaderName::from_static("fencing-token"),
        }),
        Box::new(SourceUnavailable(
            crate::lock::source::SourceError::Unavailable("down".into()),
        )),
        Box::new(MethodRefused(Method::CONNECT)),
        Box::new(BodyTooLarge { limit: 16 }),
        Box::new(ClientTimeout(Duration::from_secs(1))),
        Box::new(FenceUnavailable(StoreError::Overloaded)),
        Box::new(IdempotencyUnavailable(crate::db::DbError::Pool(
            "down".into(),
        ))),
        Box::new(UpstreamUnavailable("refused".into(), Sent::Never)),
        Box::new(UpstreamTimeout::no_answer(Sent::Maybe)),
        "an error nobody knows".into(),
    ];
    examples.extend(bad_requests.map(|e| -> BoxError { Box::new(e) }));
    examples.extend(conflicts.map(|e| -> BoxError { Box::new(e) }));
    examples
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::{AccountId, FencingToken};

    fn boxed(e: impl Error + Send + Sync + 'static) -> BoxError {
        Box::new(e)
    }

    /// An error that wraps another, as layers above may.
    #[derive(Debug, thiserror::Error)]
    #[error("while forwarding: {0}")]
    struct Wrapped(#[source] BoxError);

    #[test]
    fn a_fenced_out_token_is_a_409_that_names_the_token_and_never_a_mark() {
        let r = rejection(&boxed(FencedOut {
            account: AccountId::parse("acct-1", 64).unwrap(),
            token: FencingToken::new(41).unwrap(),
            below_floor: false,
        }));
        assert_eq!(r.status, StatusCode::CONFLICT);
        assert_eq!(r.error, "fenced_out");
        assert_eq!(r.outcome, Outcome::FencedOut);
        let body = serde_json::to_value(&r).unwrap();
        assert_eq!(body["token"], 41);
        assert_eq!(body["account"], "acct-1");
        let text = body.to_string();
        assert!(!text.contains("mark\":"), "no mark field: {text}");
        let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["account", "error", "message", "origin", "token"]);
    }

    #[test]
    fn a_cause_deeper_in_the_chain_is_found() {
        let r = rejection(&boxed(Wrapped(boxed(UpstreamTimeout::waiting_for_turn()))));
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(r.origin, Origin::Upstream);
    }

    #[test]
    fn each_kind_of_failure_has_its_status_and_origin() {
        let cases: Vec<(BoxError, StatusCode, &str, Origin)> = vec![
            (
                boxed(IdempotencyConflict::InFlight),
                StatusCode::CONFLICT,
                "in_flight",
                Origin::Client,
            ),
            (
                boxed(IdempotencyConflict::InDoubt),
                StatusCode::CONFLICT,
                "in_doubt",
                Origin::Client,
            ),
            (
                boxed(IdempotencyConflict::NotOnTheRail),
                StatusCode::CONFLICT,
                "not_on_the_rail",
                Origin::Client,
            ),
            (
                boxed(IdempotencyConflict::Mismatch),
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                Origin::Client,
            ),
            (
                boxed(FenceUnavailable(
                    crate::store::marks::StoreError::Overloaded,
                )),
                StatusCode::SERVICE_UNAVAILABLE,
                "database_unavailable",
                Origin::Database,
            ),
            (
                boxed(IdempotencyUnavailable(crate::db::DbError::Pool(
                    "down".into(),
                ))),
                StatusCode::SERVICE_UNAVAILABLE,
                "database_unavailable",
                Origin::Database,
            ),
            (
                boxed(UpstreamUnavailable(
                    "refused".into(),
                    crate::proxy::forward::Sent::Never,
                )),
                StatusCode::BAD_GATEWAY,
                "upstream_unavailable",
                Origin::Upstream,
            ),
        ];
        for (error, status, code, origin) in cases {
            let r = rejection(&error);
            assert_eq!(
                (r.status, r.error, r.origin),
                (status, code, origin),
                "{error}"
            );
        }
    }

    #[test]
    fn a_database_outage_never_reaches_the_client_in_the_database_s_words() {
        let r = rejection(&boxed(FenceUnavailable(
            crate::store::marks::StoreError::Db(crate::db::DbError::Query(
                "42P01: relation secret_table does not exist".into(),
            )),
        )));
        assert!(!r.message.contains("secret_table"), "{}", r.message);
        let response = r.into_response();
        assert_eq!(response.headers()["retry-after"], "1");
    }

    #[test]
    fn every_responder_has_an_example() {
        let answered: std::collections::BTreeSet<usize> = examples()
            .iter()
            .filter_map(|e| responder(e).map(|(i, _)| i))
            .collect();
        let missing: Vec<usize> = (0..RESPONDERS.len())
            .filter(|i| !answered.contains(i))
            .collect();
        assert!(
            missing.is_empty(),
            "RESPONDERS {missing:?} have no example in `examples()`, so the OpenAPI check \
             cannot see their responses"
        );
    }

    #[test]
    fn an_unknown_error_is_a_generic_500() {
        let r = rejection(&"something odd".into());
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(r.message, "internal error");
        assert_eq!(r.origin, Origin::Proxy);
    }
}
