//! The worker SDK (FR-08, FR-15, FR-16): what a payment worker links to take a lock and use
//! its token — and nothing that would let it use any other token.
//!
//! - [`LockClient`] talks to the lock service's HTTP API and hands out [`LockHandle`]s.
//! - [`LockHandle`] holds one grant. Its token is a private field with a getter and no setter:
//!   the token a worker presents is the token its grant was made with (ADR-002 §A2.2).
//! - [`KeepAlive`] renews a handle in the background and says promptly when the lease is lost.
//! - [`RailClient`] sends a request to the rail through the proxy with the fencing headers
//!   taken from a `&LockHandle` — there is no way to pass it a bare number.
//! - [`paydb`] is the fenced UPDATE for the worker's own database (C1 §1.6).
//!
//! There is deliberately no call that fetches "the current token" of a key: a worker that
//! re-read the token at write time would present its successor's token and defeat fencing
//! (ADR-002 §A2.3).

pub mod keep_alive;
pub mod paydb;
pub mod rail;
pub mod token;
pub mod wire;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub use keep_alive::{KeepAlive, LeaseLost};
pub use rail::{RailClient, RailResponse};

use crate::token::FencingToken;
pub use crate::wire::KeyStatus;
use crate::wire::{ErrorBody, GrantResponse, LockKey, RenewResponse};

/// Why an SDK call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SdkError {
    #[error("the key is held by another grant")]
    Held,
    #[error("the grant no longer holds the key")]
    Lost,
    #[error("the lock service has too many waiters")]
    TooManyWaiters,
    #[error("the service is unavailable: {0}")]
    Unavailable(String),
    #[error("the service refused the request: {0}")]
    BadRequest(String),
    /// 401: no credentials, or credentials railguard does not know.
    #[error("not authenticated: {0}")]
    Unauthenticated(String),
    /// 403: the identity may not touch this key or account, or the grant is another's.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// 429 from the lock API's per-identity rate limit.
    #[error("rate limited: too many lock requests from this identity")]
    RateLimited,
    /// The proxy refused the request (409): a newer grant of the account's lock exists.
    /// `body` is the proxy's answer as received; it names the account and the presented
    /// token, never the mark.
    #[error("fenced out: account {account}, token {token}: this grant has been superseded")]
    FencedOut {
        account: String,
        token: i64,
        body: String,
    },
    #[error("transport error: {0}")]
    Transport(String),
}

/// Sends `request` and reads the whole answer within `timeout`.
pub(crate) async fn exchange(
    http: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), SdkError> {
    let exchange = async {
        let response = http
            .request(request)
            .await
            .map_err(|e| SdkError::Unavailable(e.to_string()))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| SdkError::Transport(e.to_string()))?
            .to_bytes();
        Ok::<_, SdkError>((status, bytes))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| SdkError::Unavailable(format!("no answer within {timeout:?}")))?
}

/// One grant: a key, the holder it was granted to, and the token fixed when it was granted.
///
/// The token cannot be changed — not assigned, not mutated, not replaced:
///
/// ```compile_fail,E0616
/// fn steal(handle: &mut railguard_sdk::LockHandle) {
///     handle.token = railguard_sdk::token::FencingToken::new(57).unwrap(); // private field
/// }
/// ```
///
/// ```compile_fail,E0599
/// fn bump(handle: &mut railguard_sdk::LockHandle) {
///     *handle.token_mut() = railguard_sdk::token::FencingToken::new(57).unwrap(); // no such method
/// }
/// ```
///
/// It can only be read, as a value:
///
/// ```
/// fn present(handle: &railguard_sdk::LockHandle) -> i64 {
///     handle.token().get()
/// }
/// ```
///
/// Its lease secret, which alone authorises renew and release, never leaves the handle except
/// to the lock service, and is not printed by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct LockHandle {
    key: String,
    holder: String,
    token: FencingToken,
    secret: String,
    proof: String,
    ttl: Duration,
    lease_floor: tokio::time::Instant,
    granted_at_us: i64,
    expires_at_us: i64,
}

impl std::fmt::Debug for LockHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockHandle")
            .field("key", &self.key)
            .field("holder", &self.holder)
            .field("token", &self.token)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl LockHandle {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// The grant's fencing token, as fixed at grant time.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The grant's proof for the proxy (`Fencing-Proof`): that this token was granted for
    /// this key. [`RailClient`] sends it; a worker with its own HTTP client sends it too.
    pub fn fencing_proof(&self) -> &str {
        &self.proof
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The earliest moment the lease might run out if never renewed, on this process's
    /// monotonic clock: the acquire request was sent at `t0`, the service waited `waited_ms`
    /// after receiving it, so the grant was made no earlier than `t0 + waited`.
    pub fn lease_floor(&self) -> tokio::time::Instant {
        self.lease_floor
    }

    /// When the lock service says it made the grant, and when its lease runs out unless
    /// renewed: the backend's wall clock, µs since the Unix epoch. For diagnosis and for
    /// checking a recorded history against the service's own view (INV-06) — never for a
    /// correctness decision in a worker (INV-07: safety never depends on a clock).
    pub fn granted_at_us(&self) -> i64 {
        self.granted_at_us
    }

    /// See [`LockHandle::granted_at_us`].
    pub fn expires_at_us(&self) -> i64 {
        self.expires_at_us
    }
}

/// A client of the lock service's HTTP API.
#[derive(Clone)]
pub struct LockClient {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
    timeout: Duration,
    authorization: Option<http::HeaderValue>,
}

/// `Authorization: Bearer <secret>`, marked sensitive so that no debug output shows it.
pub(crate) fn bearer(secret: &str) -> Result<http::HeaderValue, SdkError> {
    let mut value = http::HeaderValue::from_str(&format!("Bearer {secret}"))
        .map_err(|_| SdkError::BadRequest("the secret is not a valid header value".into()))?;
    value.set_sensitive(true);
    Ok(value)
}

impl LockClient {
    /// `base` is the lock API's URL, e.g. `http://127.0.0.1:7070`.
    pub fn new(base: impl Into<String>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        connector.set_nodelay(true);
        Self {
            http: Client::builder(TokioExecutor::new()).build(connector),
            base: base.into().trim_end_matches('/').to_string(),
            timeout: Duration::from_secs(10),
            authorization: None,
        }
    }

    /// Authenticates every call with a bearer secret (railguard's `[auth]`).
    pub fn with_bearer(mut self, secret: &str) -> Result<Self, SdkError> {
        self.authorization = Some(bearer(secret)?);
        Ok(self)
    }

    /// Deadline for calls other than a blocking acquire (which gets its `wait` on top).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<Bytes, SdkError> {
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(authorization) = &self.authorization {
            request = request.header(http::header::AUTHORIZATION, authorization.clone());
        }
        let request = request
            .body(Full::new(body))
            .map_err(|e| SdkError::BadRequest(e.to_string()))?;
        let (status, bytes) = exchange(&self.http, request, timeout).await?;
        if status.is_success() {
            return Ok(bytes);
        }
        let error: ErrorBody = serde_json::from_slice(&bytes).unwrap_or(ErrorBody {
            error: status.to_string(),
            message: String::from_utf8_lossy(&bytes).into(),
            outcome: None,
        });
        Err(match (status, error.error.as_str()) {
            (StatusCode::CONFLICT, "held") => SdkError::Held,
            (StatusCode::GONE, _) => SdkError::Lost,
            (StatusCode::TOO_MANY_REQUESTS, "rate_limited") => SdkError::RateLimited,
            (StatusCode::TOO_MANY_REQUESTS, _) => SdkError::TooManyWaiters,
            (StatusCode::UNAUTHORIZED, _) => SdkError::Unauthenticated(error.message),
            (StatusCode::FORBIDDEN, _) => SdkError::Forbidden(error.message),
            (StatusCode::BAD_REQUEST, _) => SdkError::BadRequest(error.message),
            _ => SdkError::Unavailable(format!("{status}: {}", error.message)),
        })
    }

    /// FR-01: a handle on `key`, waiting up to `wait` for it to be free.
    fn check_key(key: &str) -> Result<(), SdkError> {
        LockKey::parse(key)
            .map(|_| ())
            .map_err(SdkError::BadRequest)
    }

    pub async fn acquire(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<LockHandle, SdkError> {
        Self::check_key(key)?;
        let body = serde_json::json!({ "holder": holder, "ttl_ms": ttl.as_millis() as u64, "wait_ms": wait.as_millis() as u64 });
        let sent = tokio::time::Instant::now();
        let bytes = self
            .call(
                Method::POST,
                &format!("/v1/locks/{key}/acquire"),
                Some(body),
                self.timeout + wait,
            )
            .await?;
        let grant: GrantResponse =
            serde_json::from_slice(&bytes).map_err(|e| SdkError::Transport(e.to_string()))?;
        let token = FencingToken::new(grant.token)
            .ok_or_else(|| SdkError::Transport("non-positive token".into()))?;
        let ttl = Duration::from_millis(grant.ttl_ms);
        let lease_floor = sent + Duration::from_millis(grant.waited_ms) + ttl;
        Ok(LockHandle {
            key: grant.key,
            holder: grant.holder,
            token,
            secret: grant.lease_secret,
            proof: grant.fencing_proof,
            ttl,
            lease_floor,
            granted_at_us: grant.granted_at_us,
            expires_at_us: grant.expires_at_us,
        })
    }

    /// FR-03: extends the lease. The handle's token does not change; `Lost` means stop.
    pub async fn renew(&self, handle: &LockHandle) -> Result<(), SdkError> {
        let body =
            serde_json::json!({ "token": handle.token.get(), "lease_secret": handle.secret });
        let bytes = self
            .call(
                Method::POST,
                &format!("/v1/locks/{}/renew", handle.key),
                Some(body),
                self.timeout,
            )
            .await?;
        let renewed: RenewResponse =
            serde_json::from_slice(&bytes).map_err(|e| SdkError::Transport(e.to_string()))?;
        debug_assert_eq!(
            renewed.token,
            handle.token.get(),
            "a renewal never changes the token"
        );
        Ok(())
    }

    /// FR-04: ends the grant, if it still holds the key.
    ///
    /// `Unavailable` means the outcome is unknown; calling `release` again with a clone of
    /// the handle is safe (it can only ever end this grant).
    pub async fn release(&self, handle: LockHandle) -> Result<(), SdkError> {
        let body =
            serde_json::json!({ "token": handle.token.get(), "lease_secret": handle.secret });
        self.call(
            Method::POST,
            &format!("/v1/locks/{}/release", handle.key),
            Some(body),
            self.timeout,
        )
        .await?;
        Ok(())
    }

    /// FR-07: who holds `key`, for people diagnosing it. Never use this to decide anything.
    pub async fn inspect(&self, key: &str) -> Result<KeyStatus, SdkError> {
        Self::check_key(key)?;
        let bytes = self
            .call(Method::GET, &format!("/v1/locks/{key}"), None, self.timeout)
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| SdkError::Transport(e.to_string()))
    }

    /// Renews `handle` in the background until dropped; see [`KeepAlive`].
    pub fn keep_alive(&self, handle: &LockHandle) -> KeepAlive {
        KeepAlive::start(self.clone(), handle.clone())
    }
}
