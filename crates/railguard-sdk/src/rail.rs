//! Sending a payment to the rail through the proxy, fenced by a grant.
//!
//! [`RailClient::post`] takes `&LockHandle` and nothing else for the token: the fencing header
//! is written from the handle, so the token presented is always the one the grant was made
//! with (FR-16), together with the grant's proof that it was made for that lock key. A 409 from the proxy comes back as [`SdkError::FencedOut`]: the grant has been
//! superseded and the worker must stop, not retry with another token.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::{LockHandle, SdkError};

/// Header names of the proxy's wire contract (C2 §2.2); configurable like the proxy's.
#[derive(Debug, Clone)]
pub struct FencingHeaders {
    pub token: String,
    pub account: String,
    pub idempotency_key: String,
    /// The grant's proof that the token was granted for the account's lock key.
    pub proof: String,
    /// A retry's token of its key's first attempt ([`RailClient::retry`]).
    pub first_token: String,
}

impl Default for FencingHeaders {
    fn default() -> Self {
        Self {
            token: "Fencing-Token".into(),
            account: "Fencing-Account".into(),
            proof: "Fencing-Proof".into(),
            idempotency_key: "Idempotency-Key".into(),
            first_token: "Idempotency-First-Token".into(),
        }
    }
}

/// The rail's answer.
#[derive(Debug, Clone)]
pub struct RailResponse {
    pub status: StatusCode,
    pub body: Bytes,
}

#[derive(Clone)]
pub struct RailClient {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
    headers: FencingHeaders,
    timeout: Duration,
    authorization: Option<http::HeaderValue>,
}

impl RailClient {
    /// `base` is the proxy's URL, e.g. `http://127.0.0.1:8080`.
    pub fn new(base: impl Into<String>) -> Self {
        Self {
            http: Client::builder(TokioExecutor::new()).build_http(),
            base: base.into().trim_end_matches('/').to_string(),
            headers: FencingHeaders::default(),
            timeout: Duration::from_secs(10),
            authorization: None,
        }
    }

    /// Authenticates every payment with a bearer secret (railguard's `[auth]`); the proxy
    /// removes it before the rail sees the request.
    pub fn with_bearer(mut self, secret: &str) -> Result<Self, SdkError> {
        self.authorization = Some(super::bearer(secret)?);
        Ok(self)
    }

    pub fn with_headers(mut self, headers: FencingHeaders) -> Self {
        self.headers = headers;
        self
    }

    /// POSTs `body` to `path` on behalf of `account`, fenced by `grant`'s token.
    pub async fn post(
        &self,
        grant: &LockHandle,
        account: &str,
        path: &str,
        body: Bytes,
        idempotency_key: Option<&str>,
    ) -> Result<RailResponse, SdkError> {
        self.send(grant, account, path, body, idempotency_key, None)
            .await
    }

    /// Sends a payment again under `grant` — whoever holds the account now — with the same
    /// `idempotency_key` as its first attempt, and that attempt's token (`first_token`, the
    /// grant it was first sent under). If the first attempt predates the last time railguard's
    /// store went back (a failover, a restore) and its record did not survive, the answer is
    /// `409 in_doubt` rather than a second payment: ask the rail, then send it as new if it
    /// was not paid.
    pub async fn retry(
        &self,
        grant: &LockHandle,
        account: &str,
        path: &str,
        body: Bytes,
        idempotency_key: &str,
        first_token: crate::token::FencingToken,
    ) -> Result<RailResponse, SdkError> {
        self.send(
            grant,
            account,
            path,
            body,
            Some(idempotency_key),
            Some(first_token),
        )
        .await
    }

    async fn send(
        &self,
        grant: &LockHandle,
        account: &str,
        path: &str,
        body: Bytes,
        idempotency_key: Option<&str>,
        first_token: Option<crate::token::FencingToken>,
    ) -> Result<RailResponse, SdkError> {
        let token = grant.token().get();
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.base))
            .header(self.headers.token.as_str(), token.to_string())
            .header(self.headers.account.as_str(), account)
            .header(self.headers.proof.as_str(), grant.fencing_proof())
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(key) = idempotency_key {
            request = request.header(self.headers.idempotency_key.as_str(), key);
        }
        if let Some(first) = first_token {
            request = request.header(self.headers.first_token.as_str(), first.get().to_string());
        }
        if let Some(authorization) = &self.authorization {
            request = request.header(http::header::AUTHORIZATION, authorization.clone());
        }
        let request = request
            .body(Full::new(body))
            .map_err(|e| SdkError::BadRequest(e.to_string()))?;
        let (status, body) = super::exchange(&self.http, request, self.timeout).await?;
        let response = RailResponse { status, body };
        if response.status == StatusCode::CONFLICT {
            let fenced = serde_json::from_slice::<serde_json::Value>(&response.body)
                .is_ok_and(|v| v["error"] == "fenced_out");
            if fenced {
                return Err(SdkError::FencedOut {
                    account: account.to_string(),
                    token,
                    body: String::from_utf8_lossy(&response.body).into_owned(),
                });
            }
        }
        Ok(response)
    }
}
