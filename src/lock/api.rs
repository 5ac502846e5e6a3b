//! The lock service's HTTP/JSON API (FR-08), on its own listener.
//!
//! | request | body | success |
//! |---|---|---|
//! | `POST /v1/locks/{key}/acquire` | `{"holder", "ttl_ms", "wait_ms"?}` | 200 the grant, with its token |
//! | `POST /v1/locks/{key}/renew` | `{"token", "lease_secret"}` | 200 the new expiry; the token is unchanged |
//! | `POST /v1/locks/{key}/release` | `{"token", "lease_secret"}` | 200 (also for a repeated release) |
//! | `GET /v1/locks/{key}` | | 200 holder, lease remaining, grant age — **never a token** |
//!
//! Refusals: 400 bad key or body (unknown fields included), 409 `held` (revealing neither the
//! holder's token nor anything usable as one), 410 `lost` (the grant no longer holds the key),
//! 429 `too_many_waiters`, 503 `unavailable`, and on acquire 503 `token_source_behind`: the
//! token source is not known to be above every fencing mark (`super::guard`), nothing was
//! granted, and an operator must run `railguard fast-forward`.
//!
//! **Who may renew and release** (C2 §2.3): whoever holds the grant's `lease_secret`, which
//! only the acquire response carries. A wrong secret, a wrong token and a grant that ended
//! all get the same 410 `lost`: no answer confirms or denies a guessed token.
//!
//! **What a 503 means**, in its `outcome` field: for acquire `none` — nothing was granted, and
//! a grant that a late statement commits anyway is revoked; for renew and release `unknown` —
//! the change may have been made. Renew again to find out; a release may simply be repeated
//! (a grant already ended by its own release answers 200 again on PostgreSQL, 410 on etcd).
//!
//! Every grant carries a `fencing_proof`, which the proxy requires with the token (see
//! `crate::proof`). Tokens travel as JSON integers. `inspect` exists for people diagnosing a stuck key; its
//! answer is stale the moment it is read and must never feed a correctness decision (FR-07).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use railguard_sdk::wire::{AcquireRequest, GrantResponse, RenewResponse, TokenRequest};
use serde::Serialize;

use super::service::{LockLimits, LockService};
use super::{LeaseSecret, LockBackend, LockError, LockKey, parse_holder};
use crate::auth::{
    Authenticator, Identity, Listener, PeerCertificate, Refusal, Role, Unauthenticated,
};
use crate::http::{ResponseBody, SmallBodyError, full};
use crate::proof::ProofKey;
use crate::token::FencingToken;

/// Largest request body the API reads.
const MAX_BODY: usize = 16 * 1024;

/// Why a request failed, before it is rendered (the one place that picks a status).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    /// The body did not arrive in time: nothing was done.
    #[error("{0}; nothing was done")]
    BodyTimeout(String),
    #[error("no such route; see /v1/locks/{{key}}")]
    NotFound,
    /// The path exists; its operations take only these methods (the `Allow` header).
    #[error("method not allowed here; this path takes {0}")]
    MethodNotAllowed(&'static str),
    #[error(transparent)]
    Unauthenticated(#[from] Unauthenticated),
    #[error("{0}")]
    Forbidden(String),
    #[error("too many lock requests from this identity; slow down")]
    RateLimited,
    #[error(
        "this identity already has {0} lock requests open (waiting acquires included); nothing was done"
    )]
    TooManyOpen(usize),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("the lock backend did not answer in time: {why}. {meaning}")]
    Unavailable {
        why: String,
        /// `none` or `unknown`: whether the operation may have taken effect.
        outcome: &'static str,
        meaning: &'static str,
    },
}

impl ApiError {
    /// An operation's error, with a 503 saying what it means for that operation.
    fn from_lock(operation: Operation, error: LockError) -> Self {
        let LockError::Unavailable(why) = error else {
            return ApiError::Lock(error);
        };
        let (outcome, meaning) = match operation {
            Operation::Acquire => (
                "none",
                "Nothing was granted: a grant that a late statement commits anyway is revoked.",
            ),
            Operation::Renew => (
                "unknown",
                "The lease may or may not have been extended; renew again to find out.",
            ),
            Operation::Release => (
                "unknown",
                "The release may or may not have taken effect; repeat it (a grant already \
                 released answers 200 or 410, never anything that could end another grant).",
            ),
            Operation::Inspect => ("none", "Nothing changes on inspect."),
        };
        ApiError::Unavailable {
            why,
            outcome,
            meaning,
        }
    }
}

/// What a request asks for; each operation is one route (method and path after the key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    Acquire,
    Renew,
    Release,
    Inspect,
}

impl Operation {
    /// Every route the API serves: `route` finds a request's operation here, and the OpenAPI
    /// document is checked against this list (`crate::openapi`).
    pub(crate) const ALL: [Operation; 4] = [
        Operation::Acquire,
        Operation::Renew,
        Operation::Release,
        Operation::Inspect,
    ];

    /// The path segment after the key, if any.
    fn action(self) -> Option<&'static str> {
        match self {
            Operation::Acquire => Some("acquire"),
            Operation::Renew => Some("renew"),
            Operation::Release => Some("release"),
            Operation::Inspect => None,
        }
    }

    pub(crate) fn method(self) -> Method {
        match self {
            Operation::Inspect => Method::GET,
            Operation::Acquire | Operation::Renew | Operation::Release => Method::POST,
        }
    }

    /// The route as a path template, `/v1/locks/{key}/acquire`.
    #[cfg(test)]
    pub(crate) fn path(self) -> String {
        match self.action() {
            Some(action) => format!("/v1/locks/{{key}}/{action}"),
            None => "/v1/locks/{key}".into(),
        }
    }

    /// The operation at `action` (the path after the key) for `method`: 404 if no operation
    /// has that path, 405 if none there takes that method.
    fn find(action: Option<&str>, method: &Method) -> Result<Self, ApiError> {
        let mut at_path = Self::ALL
            .into_iter()
            .filter(|operation| operation.action() == action)
            .peekable();
        if at_path.peek().is_none() {
            return Err(ApiError::NotFound);
        }
        let at_path: Vec<Operation> = at_path.collect();
        at_path
            .iter()
            .copied()
            .find(|operation| operation.method() == *method)
            .ok_or(ApiError::MethodNotAllowed(
                // One operation per path today; each path takes one method.
                if at_path.iter().all(|o| o.method() == Method::GET) {
                    "GET"
                } else {
                    "POST"
                },
            ))
    }
}

impl ApiError {
    pub(crate) fn into_response(self) -> Response<ResponseBody> {
        let (status, code) = match &self {
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Unauthenticated(_) => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::RateLimited | ApiError::TooManyOpen(_) => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limited")
            }
            ApiError::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            ApiError::Lock(LockError::Held) => (StatusCode::CONFLICT, "held"),
            ApiError::Lock(LockError::Lost) => (StatusCode::GONE, "lost"),
            ApiError::Lock(LockError::OtherHolder) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::Lock(LockError::TooManyWaiters(_)) => {
                (StatusCode::TOO_MANY_REQUESTS, "too_many_waiters")
            }
            ApiError::Lock(LockError::Unavailable(_)) | ApiError::Unavailable { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
            }
            ApiError::Lock(LockError::SourceBehind(_)) => {
                (StatusCode::SERVICE_UNAVAILABLE, "token_source_behind")
            }
        };
        let mut body = serde_json::json!({ "error": code, "message": self.to_string() });
        match &self {
            ApiError::Unavailable { outcome, .. } => body["outcome"] = (*outcome).into(),
            ApiError::Lock(LockError::SourceBehind(_)) => body["outcome"] = "none".into(),
            _ => {}
        }
        let mut response = json(status, &body);
        if let ApiError::MethodNotAllowed(allow) = &self {
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        if let ApiError::Unauthenticated(e) = &self {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, e.challenge());
        }
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
impl ApiError {
    /// One of each refusal the API renders, with the operations that may answer it (none: the
    /// request matched no operation). `crate::openapi` checks each against the document; the
    /// match below stops a new variant from compiling until it has an example here.
    pub(crate) fn examples() -> Vec<(ApiError, Vec<Operation>)> {
        use Operation::{Acquire, Release, Renew};
        let mut examples = vec![
            (ApiError::BadRequest("bad".into()), Operation::ALL.to_vec()),
            (
                ApiError::BodyTimeout("the request body did not arrive".into()),
                vec![Acquire, Renew, Release],
            ),
            (ApiError::NotFound, vec![]),
            (
                ApiError::Unauthenticated(Unauthenticated::Missing),
                Operation::ALL.to_vec(),
            ),
            (ApiError::Forbidden("no".into()), Operation::ALL.to_vec()),
            (ApiError::RateLimited, Operation::ALL.to_vec()),
            (ApiError::TooManyOpen(100), Operation::ALL.to_vec()),
            (ApiError::MethodNotAllowed("POST"), vec![]),
            (ApiError::Lock(LockError::Held), vec![Acquire]),
            (ApiError::Lock(LockError::Lost), vec![Renew, Release]),
            (ApiError::Lock(LockError::OtherHolder), vec![Renew, Release]),
            (ApiError::Lock(LockError::TooManyWaiters(1)), vec![Acquire]),
            (
                ApiError::Lock(LockError::SourceBehind(crate::lock::guard::BEHIND_MESSAGE)),
                vec![Acquire],
            ),
        ];
        for operation in Operation::ALL {
            let down = LockError::Unavailable("down".into());
            examples.push((ApiError::from_lock(operation, down), vec![operation]));
        }
        for (example, _) in &examples {
            match example {
                ApiError::BadRequest(_)
                | ApiError::BodyTimeout(_)
                | ApiError::NotFound
                | ApiError::Unauthenticated(_)
                | ApiError::Forbidden(_)
                | ApiError::RateLimited
                | ApiError::TooManyOpen(_)
                | ApiError::MethodNotAllowed(_)
                | ApiError::Unavailable { .. }
                | ApiError::Lock(
                    LockError::Held
                    | LockError::Lost
                    | LockError::OtherHolder
                    | LockError::TooManyWaiters(_)
                    | LockError::SourceBehind(_),
                ) => {}
                // Never rendered: `from_lock` turns it into `Unavailable`, with its outcome.
                ApiError::Lock(LockError::Unavailable(_)) => unreachable!(),
            }
        }
        examples
    }
}

fn json(status: StatusCode, value: &impl Serialize) -> Response<ResponseBody> {
    let body = serde_json::to_vec(value).expect("serializable");
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-store")
        .body(full(Bytes::from(body)))
        .expect("static response parts")
}

/// Who asks (with authentication on), and their request's slot in its in-flight bound.
type Caller = (
    Option<Arc<Identity>>,
    Option<crate::auth::concurrency::InFlightGuard>,
);

pub struct LockApi<B> {
    service: Arc<LockService<B>>,
    proofs: Arc<ProofKey>,
    /// `None`: authentication is off and every caller is anonymous.
    auth: Option<Arc<Authenticator>>,
}

impl<B> Clone for LockApi<B> {
    fn clone(&self) -> Self {
        Self {
            service: self.service.clone(),
            proofs: self.proofs.clone(),
            auth: self.auth.clone(),
        }
    }
}

impl<B: LockBackend> LockApi<B> {
    /// `proofs` signs every grant for the proxy (the key every railguard on the database
    /// shares); `auth`, when set, decides who may call and which keys they may touch.
    pub fn new(
        service: Arc<LockService<B>>,
        proofs: Arc<ProofKey>,
        auth: Option<Arc<Authenticator>>,
    ) -> Self {
        Self {
            service,
            proofs,
            auth,
        }
    }

    /// The caller's identity, if authentication is on, and its request counted in its
    /// in-flight bound until the guard is dropped: 401 without one, 429 over its rate or with
    /// `auth.lock_in_flight_per_identity` requests already open.
    fn authenticate(&self, request: &Request<Incoming>) -> Result<Caller, ApiError> {
        let Some(auth) = &self.auth else {
            return Ok((None, None));
        };
        let identity = auth
            .identify(
                request.headers(),
                PeerCertificate::of(request.extensions()).as_ref(),
            )
            .map_err(|e| {
                auth.metrics
                    .refused(Listener::Lock, Refusal::Unauthenticated);
                ApiError::Unauthenticated(e)
            })?;
        let Role::Worker {
            lock_requests_per_s,
            ..
        } = identity.role
        else {
            auth.metrics.refused(Listener::Lock, Refusal::Forbidden);
            tracing::warn!(identity = %identity.name,
                "lock request refused: an operator credential opens nothing on the lock API");
            return Err(ApiError::Forbidden(
                "an operator credential opens nothing on the lock API".into(),
            ));
        };
        if !auth.lock_rate.admit(&identity.name, lock_requests_per_s) {
            auth.metrics.refused(Listener::Lock, Refusal::RateLimited);
            return Err(ApiError::RateLimited);
        }
        let Some(open) = auth.lock_in_flight.enter(&identity.name) else {
            auth.metrics.refused(Listener::Lock, Refusal::RateLimited);
            tracing::warn!(identity = %identity.name, max = auth.lock_in_flight.max(),
                "lock request refused: the identity has too many requests open");
            return Err(ApiError::TooManyOpen(auth.lock_in_flight.max()));
        };
        Ok((Some(identity), Some(open)))
    }

    /// A renew's or release's error as answered, a grant of another identity counted as a
    /// refusal.
    fn lock_error(&self, operation: Operation, error: LockError) -> ApiError {
        if let (LockError::OtherHolder, Some(auth)) = (&error, &self.auth) {
            auth.metrics.refused(Listener::Lock, Refusal::Forbidden);
        }
        ApiError::from_lock(operation, error)
    }

    /// 403 unless `identity` (if any) may touch `key`.
    fn authorize(&self, identity: Option<&Identity>, key: &LockKey) -> Result<(), ApiError> {
        match (identity, &self.auth) {
            (Some(identity), Some(auth)) if !identity.may_lock(key.as_str()) => {
                auth.metrics.refused(Listener::Lock, Refusal::Forbidden);
                tracing::warn!(identity = %identity.name, key = key.as_str(),
                    "lock request refused: the identity may not lock this key");
                Err(ApiError::Forbidden(format!(
                    "identity {:?} may not lock {:?}",
                    identity.name,
                    key.as_str()
                )))
            }
            _ => Ok(()),
        }
    }

    pub async fn handle(
        self,
        request: Request<Incoming>,
    ) -> Result<Response<ResponseBody>, Infallible> {
        Ok(match self.route(request).await {
            Ok(response) => response,
            Err(error) => error.into_response(),
        })
    }

    async fn route(&self, request: Request<Incoming>) -> Result<Response<ResponseBody>, ApiError> {
        // `_open` counts this request against its identity's bound until it is answered.
        let (identity, _open) = self.authenticate(&request)?;
        let path = request.uri().path().to_string();
        let rest = path.strip_prefix("/v1/locks/").ok_or(ApiError::NotFound)?;
        let (key, action) = match rest.split_once('/') {
            Some((key, action)) => (key, Some(action)),
            None => (rest, None),
        };
        // A key is read decoded: `acct%3A1` is the key `acct:1`, as a client that encodes
        // every `:` in a path segment means it.
        let key = String::from_utf8(crate::http::percent_decode(key))
            .map_err(|_| ApiError::BadRequest("the key is not valid UTF-8 once decoded".into()))
            .and_then(|key| LockKey::parse(&key).map_err(ApiError::BadRequest))?;
        let operation = Operation::find(action, request.method())?;
        self.authorize(identity.as_deref(), &key)?;
        // With authentication on, renew and release also need the grant to be the caller's:
        // a lease secret that leaked to another identity renews or ends nothing (403).
        let caller = identity.as_deref().map(|identity| identity.name.as_str());
        match operation {
            Operation::Inspect => {
                let inspection = self
                    .service
                    .inspect(&key)
                    .await
                    .map_err(|e| ApiError::from_lock(Operation::Inspect, e))?;
                Ok(json(StatusCode::OK, &inspection))
            }
            Operation::Acquire => {
                let body = read_body(request).await?;
                let asked = parse_acquire(&body, self.service.limits())?;
                self.acquire(key, asked, identity.as_deref()).await
            }
            Operation::Renew => {
                let (token, secret) = parse_token_body(&read_body(request).await?)?;
                let renewed = self
                    .service
                    .renew(&key, token, &secret, caller)
                    .await
                    .map_err(|e| self.lock_error(Operation::Renew, e))?;
                Ok(json(
                    StatusCode::OK,
                    &RenewResponse {
                        key: key.to_string(),
                        token: token.get(),
                        ttl_ms: renewed.ttl.as_millis() as u64,
                        expires_at_us: renewed.expires_at_us,
                    },
                ))
            }
            Operation::Release => {
                let (token, secret) = parse_token_body(&read_body(request).await?)?;
                let released = self
                    .service
                    .release(&key, token, &secret, caller)
                    .await
                    .map_err(|e| self.lock_error(Operation::Release, e))?;
                let mut body = serde_json::json!({
                    "key": key.as_str(),
                    "released": true,
                    "released_at_us": released.at_us,
                });
                if let Some(revision) = released.revision {
                    body["released_revision"] = revision.into();
                }
                Ok(json(StatusCode::OK, &body))
            }
        }
    }

    async fn acquire(
        &self,
        key: LockKey,
        asked: AcquireAsked,
        identity: Option<&Identity>,
    ) -> Result<Response<ResponseBody>, ApiError> {
        let AcquireAsked { holder, ttl, wait } = asked;
        // With authentication on, the holder is the authenticated identity: a request may
        // leave `holder` out or repeat the identity's name, nothing else.
        let holder = match (identity, holder) {
            (None, Some(holder)) => holder,
            (None, None) => return Err(ApiError::BadRequest("holder is empty".into())),
            (Some(identity), None) => identity.name.clone(),
            (Some(identity), Some(holder)) if holder == identity.name => holder,
            (Some(identity), Some(_)) => {
                if let Some(auth) = &self.auth {
                    auth.metrics.refused(Listener::Lock, Refusal::Forbidden);
                }
                tracing::warn!(identity = %identity.name,
                    "acquire refused: its holder is not the authenticated identity");
                return Err(ApiError::Forbidden(format!(
                    "the holder is the authenticated identity {:?}; leave `holder` out or send that",
                    identity.name
                )));
            }
        };
        let (grant, waited) = self
            .service
            .acquire(&key, &holder, ttl, wait)
            .await
            .map_err(|e| ApiError::from_lock(Operation::Acquire, e))?;
        let fencing_proof = match identity {
            Some(identity) => self
                .proofs
                .sign_for(grant.key.as_str(), grant.token, &identity.name),
            None => self.proofs.sign(grant.key.as_str(), grant.token),
        };
        // Rounded down: the client's bound on when the lease began must not be late.
        let waited_ms = waited.as_millis() as u64;
        Ok(json(
            StatusCode::OK,
            &GrantResponse {
                key: grant.key.to_string(),
                token: grant.token.get(),
                holder: grant.holder,
                // As granted: etcd rounds leases up to whole seconds.
                ttl_ms: grant.ttl.as_millis() as u64,
                granted_at_us: grant.granted_at_us,
                expires_at_us: grant.expires_at_us,
                waited_ms,
                backend: self.service.backend_name().to_string(),
                lease_secret: grant.secret.to_wire(),
                fencing_proof,
            },
        ))
    }
}

/// Reads a request body whole, refusing one larger than [`MAX_BODY`] or slower than the
/// listener's `header_read_timeout_ms` (a client that sends a head and then nothing would hold
/// an in-flight slot for ever).
async fn read_body(request: Request<Incoming>) -> Result<Bytes, ApiError> {
    crate::http::read_small_body(request, MAX_BODY)
        .await
        .map_err(|e| match e {
            SmallBodyError::TimedOut(_) => ApiError::BodyTimeout(e.to_string()),
            SmallBodyError::Unreadable { .. } => ApiError::BadRequest(e.to_string()),
        })
}

/// Parses a request body as every body of this API is read: one JSON object, with no field
/// its type does not know (`deny_unknown_fields`), and nothing after it. The error names the
/// field that was wrong.
///
/// Public, like [`parse_acquire`] and [`parse_token_body`], so that the fuzz targets
/// (`fuzz/`) and the property tests drive the API's real parsers.
pub fn parse_json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // A struct also deserializes from a JSON array of its fields in order; only an object is
    // a request body here.
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(ApiError::BadRequest(
            "invalid JSON body: expected a JSON object".into(),
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            String::new()
        } else {
            format!(" at `{path}`")
        };
        ApiError::BadRequest(format!("invalid JSON body{field}: {}", e.inner()))
    })?;
    deserializer
        .end()
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: trailing data: {e}")))?;
    Ok(value)
}

/// What an acquire asks for, checked against the service's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireAsked {
    /// A valid holder name ([`parse_holder`]), or `None` when the body leaves it out or
    /// empty (allowed only with authentication on, where the identity is the holder).
    pub holder: Option<String>,
    /// Within `limits.min_ttl..=limits.max_ttl`.
    pub ttl: Duration,
    /// At most `limits.max_wait`.
    pub wait: Duration,
}

/// Parses and checks the body of `POST /v1/locks/{key}/acquire`.
pub fn parse_acquire(body: &[u8], limits: &LockLimits) -> Result<AcquireAsked, ApiError> {
    let body: AcquireRequest = parse_json_body(body)?;
    let holder = match body.holder.as_str() {
        "" => None,
        text => Some(parse_holder(text).map_err(ApiError::BadRequest)?),
    };
    let ttl = Duration::from_millis(body.ttl_ms);
    if ttl < limits.min_ttl || ttl > limits.max_ttl {
        return Err(ApiError::BadRequest(format!(
            "ttl_ms must be between {} and {}",
            limits.min_ttl.as_millis(),
            limits.max_ttl.as_millis()
        )));
    }
    let wait = Duration::from_millis(body.wait_ms);
    if wait > limits.max_wait {
        return Err(ApiError::BadRequest(format!(
            "wait_ms must be at most {}",
            limits.max_wait.as_millis()
        )));
    }
    Ok(AcquireAsked { holder, ttl, wait })
}

/// Parses the body of renew and release: the grant's token and its lease secret.
pub fn parse_token_body(body: &[u8]) -> Result<(FencingToken, LeaseSecret), ApiError> {
    let body: TokenRequest = parse_json_body(body)?;
    let token = FencingToken::new(body.token)
        .ok_or_else(|| ApiError::BadRequest("token must be a positive integer".into()))?;
    let secret = body.lease_secret.ok_or_else(|| {
        ApiError::BadRequest(
            "missing `lease_secret`: renew and release are authorised by the secret returned \
             with the grant by acquire, not by the token. Clients that send only the token \
             predate lease secrets; upgrade the client"
                .into(),
        )
    })?;
    let secret = LeaseSecret::parse(&secret).map_err(ApiError::BadRequest)?;
    Ok((token, secret))
}

#[cfg(test)]
mod tests;

/// Properties of the request bodies, over generated requests (the fuzz target
/// `lock_api_json` checks the same on arbitrary bytes).
#[cfg(test)]
mod properties;
