//! Reads what the fence needs from a request, and refuses requests that lack it.
//!
//! The token and the account come from headers (C2 §2.2). Each must appear exactly once; a
//! missing, empty, malformed, zero, negative, overflowing or repeated token, or a missing or
//! malformed account, is a 400 and the request goes no further. The body is read whole (up
//! to `max_body_bytes`) *before* the fence check, so that a body we would refuse never
//! advances a mark and the rail never receives a truncated payment.
//!
//! A token is accepted for an account only with the grant's proof that it was granted for the
//! account's lock key (C2 §2.3, `crate::proof`): checked here, in memory, so a token granted
//! for another key — or never granted — is a 400 that never reaches the database and never
//! moves a mark.
//!
//! Requests a reverse proxy must not pass on are refused here too: `CONNECT` (a tunnel is not a
//! payment, and must not advance a mark), and HTTP/1.1 requests without exactly one valid
//! `Host` (RFC 9112 §3.2).
//!
//! This is also where the request's deadline starts: one `request_timeout` per request,
//! carried with it, so that each later phase can tell whose time ran out.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Body;
use tokio::time::Instant;
use tower::Layer;

use super::authorize::{self, Forbidden};
use super::{BoxError, Deadline, FencedRequest, IdempotencyKey, ProxyResponse, Step};
use crate::token::{AccountId, FencingToken};

/// A request the proxy refuses to read.
#[derive(Debug, thiserror::Error)]
pub enum BadRequest {
    #[error("header {header} {reason}")]
    Header { header: HeaderName, reason: String },
    #[error("the request body could not be read: {0}")]
    Body(String),
}

/// The token is not shown to have been granted for the account's lock key.
#[derive(Debug, thiserror::Error)]
#[error("header {header} {reason}")]
pub struct BadProof {
    pub header: HeaderName,
    pub reason: &'static str,
}

/// A method the proxy never forwards.
#[derive(Debug, thiserror::Error)]
#[error("{0} is not forwarded to the rail")]
pub struct MethodRefused(pub http::Method);

#[derive(Debug, thiserror::Error)]
#[error("the request body is larger than {limit} bytes")]
pub struct BodyTooLarge {
    pub limit: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("the client did not send its request body within {0:?}")]
pub struct ClientTimeout(pub Duration);

/// What to read and how much of it.
#[derive(Debug, Clone)]
pub struct ExtractConfig {
    pub token_header: HeaderName,
    pub account_header: HeaderName,
    pub idempotency_header: HeaderName,
    pub first_token_header: HeaderName,
    /// Refuse requests without an idempotency key.
    pub idempotency_required: bool,
    pub max_account_len: usize,
    pub max_body_bytes: u64,
    pub request_timeout: Duration,
    pub proof_header: HeaderName,
    pub grants: GrantCheck,
    /// `None`: authentication is off (see `super::authorize`).
    pub auth: Option<std::sync::Arc<crate::auth::Authenticator>>,
    /// `fencing.account_in_path`: where the path must name the request's account.
    pub account_in_path: Option<crate::config::AccountPathTemplate>,
}

/// How a token is tied to the account it is presented for.
#[derive(Debug, Clone)]
pub struct GrantCheck {
    pub proofs: std::sync::Arc<crate::proof::ProofKey>,
    /// `fencing.require_proof`.
    pub required: bool,
    /// `fencing.lock_key_template`, split around `{account}`.
    pub lock_key_prefix: String,
    pub lock_key_suffix: String,
    /// Tokens let through without a proof (`require_proof = false` only).
    pub unproven: prometheus::IntCounter,
    /// Says whether a token sent without a proof was ever issued by the token source.
    pub source: std::sync::Arc<dyn crate::lock::guard::IssuedTokens>,
}

/// Whether a token came with a valid proof, or without one where that is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evidence {
    Proven,
    Unproven,
}

/// A token sent without a proof, above every token the source has issued: made up, never
/// granted. Refused so that it cannot poison the account's mark.
#[derive(Debug, thiserror::Error)]
#[error("header {header} carries a token that the token source has never issued")]
pub struct ImplausibleToken {
    pub header: HeaderName,
}

/// The token source could not be asked whether an unproven token was issued.
#[derive(Debug, thiserror::Error)]
#[error("the token could not be checked against the token source: {0}")]
pub struct SourceUnavailable(pub crate::lock::source::SourceError);

impl GrantCheck {
    /// The lock key whose grants fence `account`.
    pub fn lock_key(&self, account: &AccountId) -> String {
        let mut key = String::with_capacity(
            self.lock_key_prefix.len() + account.as_str().len() + self.lock_key_suffix.len(),
        );
        key.push_str(&self.lock_key_prefix);
        key.push_str(account.as_str());
        key.push_str(&self.lock_key_suffix);
        key
    }

    /// The account's lock key. With proofs required, refuses an account whose lock key is
    /// not a valid lock key: no grant of it can ever be made, so no payment on it could ever
    /// be proven.
    fn grantable(&self, header: &HeaderName, account: &AccountId) -> Result<String, BadRequest> {
        let lock_key = self.lock_key(account);
        if !self.required {
            return Ok(lock_key);
        }
        crate::lock::LockKey::check(&lock_key).map_err(|why| BadRequest::Header {
            header: header.clone(),
            reason: format!(
                "cannot be paid on: its lock key {lock_key:?} is not a valid lock key ({why}). \
                 With fencing.require_proof on, a payment needs a grant of the account's lock \
                 key, and lock keys hold only A-Z a-z 0-9 . _ : - (at most {} bytes, \
                 fencing.lock_key_template included)",
                crate::lock::MAX_KEY_LEN
            ),
        })?;
        Ok(lock_key)
    }

    /// Checks the proof sent with `token` for the account whose lock key is `lock_key`, and
    /// with authentication on, that it is the proof of a grant to `caller`.
    fn check(
        &self,
        header: &HeaderName,
        proof: Result<&str, HeaderError>,
        lock_key: &str,
        token: FencingToken,
        caller: Option<&crate::auth::Identity>,
    ) -> Result<Evidence, BoxError> {
        let bad = |reason| BadProof {
            header: header.clone(),
            reason,
        };
        let proof = match proof {
            Ok(proof) => proof,
            Err(HeaderError::Missing) if !self.required && caller.is_none() => {
                self.unproven.inc();
                return Ok(Evidence::Unproven);
            }
            Err(HeaderError::Missing) => {
                return Err(
                    bad("is missing: send the grant's fencing_proof with its token").into(),
                );
            }
            Err(_) => return Err(bad("must appear once, as visible ASCII").into()),
        };
        if let Some(caller) = caller {
            if self.proofs.verify_for(lock_key, token, &caller.name, proof) {
                return Ok(Evidence::Proven);
            }
            return Err(Forbidden {
                reason: format!(
                    "header {header} does not prove a grant of this account's lock key to \
                     identity {:?} (a grant is accepted only from the identity it was issued to)",
                    caller.name
                ),
            }
            .into());
        }
        if self.proofs.verify(lock_key, token, proof) {
            Ok(Evidence::Proven)
        } else {
            Err(
                bad("does not prove that this token was granted for this account's lock key")
                    .into(),
            )
        }
    }
}

#[derive(Clone)]
pub struct ExtractLayer {
    config: std::sync::Arc<ExtractConfig>,
}

impl ExtractLayer {
    pub fn new(config: ExtractConfig) -> Self {
        Self {
            config: std::sync::Arc::new(config),
        }
    }
}

impl<S> Layer<S> for ExtractLayer {
    type Service = Extract<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Extract {
            inner,
            config: self.config.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Extract<S> {
    inner: S,
    config: std::sync::Arc<ExtractConfig>,
}

impl ExtractConfig {
    fn fencing_headers(
        &self,
        headers: &http::HeaderMap,
    ) -> Result<(FencingToken, AccountId), BadRequest> {
        fencing_headers(
            headers,
            &self.token_header,
            &self.account_header,
            self.max_account_len,
        )
    }

    /// RFC 9112 §3.2: an HTTP/1.1 request has exactly one `Host`; any `Host` must be a valid
    /// authority. (HTTP/2 carries `:authority` instead; a `Host` beside it must be valid too.)
    fn host(
        &self,
        request_version: http::Version,
        headers: &http::HeaderMap,
    ) -> Result<(), BadRequest> {
        let bad = |reason: &str| BadRequest::Header {
            header: header::HOST,
            reason: reason.into(),
        };
        match single_header(headers, &header::HOST) {
            Err(HeaderError::Missing) if request_version == http::Version::HTTP_11 => {
                Err(bad("is missing (HTTP/1.1 requires exactly one)"))
            }
            Err(HeaderError::Missing) => Ok(()),
            Err(HeaderError::Repeated) => Err(bad("appears more than once")),
            Err(HeaderError::NotAscii) => Err(bad("is not a valid host")),
            Ok(text) => valid_host(text).map_err(bad),
        }
    }

    fn idempotency_key(&self, headers: &http::HeaderMap) -> Result<Option<String>, BadRequest> {
        idempotency_key(headers, &self.idempotency_header, self.idempotency_required)
    }
}

/// Checks a `Host` value: `host` or `host:port` (RFC 9110 §7.2), where `host` is a name, an
/// IPv4 address or a bracketed IPv6 literal, and `port` is `1..=65535`. Userinfo
/// (`user@host`), which a URI's authority may carry but `Host` may not, is refused, as are an
/// empty host and an empty, zero or out-of-range port.
pub fn valid_host(text: &str) -> Result<(), &'static str> {
    if text.is_empty() {
        return Err("is empty: send the rail's host name");
    }
    if text.contains('@') {
        return Err("carries userinfo (user@host): send the host name alone");
    }
    let authority = text
        .parse::<http::uri::Authority>()
        .map_err(|_| "is not a valid host (expected host or host:port)")?;
    let host = authority.host();
    if host.is_empty() || host == "[]" {
        return Err("has an empty host name");
    }
    // `host()` is the text before the port, brackets of an IPv6 literal included.
    let rest = &authority.as_str()[host.len()..];
    if rest.is_empty() {
        return Ok(());
    }
    let port = rest
        .strip_prefix(':')
        .ok_or("is not a valid host (expected host or host:port)")?;
    let digits = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
    match port.parse::<u16>() {
        Ok(port) if digits && port >= 1 => Ok(()),
        _ => Err("has an invalid port: a port is a decimal number in 1..=65535"),
    }
}

/// Reads the fencing token (`token_header`) and the account (`account_header`, at most
/// `max_account_len` bytes) from `headers`: each exactly once, in its C2 §2.2 wire form.
///
/// This is the proxy's own check, public so that the fuzz targets (`fuzz/`) and the property
/// tests drive exactly what a request meets.
pub fn fencing_headers(
    headers: &HeaderMap,
    token_header: &HeaderName,
    account_header: &HeaderName,
    max_account_len: usize,
) -> Result<(FencingToken, AccountId), BadRequest> {
    let bad = |header: &HeaderName, reason: String| BadRequest::Header {
        header: header.clone(),
        reason,
    };
    let token_text =
        single_header(headers, token_header).map_err(|e| bad(token_header, e.to_string()))?;
    let token = FencingToken::parse(token_text).map_err(|e| bad(token_header, e.to_string()))?;
    let account_text =
        single_header(headers, account_header).map_err(|e| bad(account_header, e.to_string()))?;
    let account = AccountId::parse(account_text, max_account_len)
        .map_err(|e| bad(account_header, e.to_string()))?;
    Ok((token, account))
}

/// The idempotency key in header `name`, if any: at most one, well-formed
/// ([`parse_key`](crate::proxy::idempotency::parse_key)), and present when `required`.
pub fn idempotency_key(
    headers: &HeaderMap,
    name: &HeaderName,
    required: bool,
) -> Result<Option<String>, BadRequest> {
    let bad = |reason: String| BadRequest::Header {
        header: name.clone(),
        reason,
    };
    match single_header(headers, name) {
        Err(HeaderError::Missing) if !required => Ok(None),
        Err(e) => Err(bad(e.to_string())),
        Ok(text) => crate::proxy::idempotency::parse_key(text)
            .map(Some)
            .map_err(bad),
    }
}

/// A retry's `Idempotency-First-Token`: the token its key was first sent under, in the same
/// form as the fencing token, at most the token presented now (tokens of one key only grow),
/// and only beside an idempotency key.
pub fn first_token(
    headers: &HeaderMap,
    name: &HeaderName,
    keyed: bool,
    token: FencingToken,
) -> Result<Option<FencingToken>, BadRequest> {
    let bad = |reason: String| BadRequest::Header {
        header: name.clone(),
        reason,
    };
    let text = match single_header(headers, name) {
        Err(HeaderError::Missing) => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
        Ok(text) => text,
    };
    let first = FencingToken::parse(text).map_err(|e| bad(e.to_string()))?;
    if !keyed {
        return Err(bad("is only meaningful with an idempotency key".into()));
    }
    if first > token {
        return Err(bad(
            "is above the fencing token: a key is first sent under an earlier grant".into(),
        ));
    }
    Ok(Some(first))
}

impl<S, B> Step<Request<B>> for Extract<S>
where
    S: Step<FencedRequest>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn handle(
        &self,
        request: Request<B>,
    ) -> impl Future<Output = Result<ProxyResponse, BoxError>> + Send {
        let config = &*self.config;
        async move {
            let mut deadline = Deadline::at(Instant::now() + config.request_timeout);
            if request.method() == http::Method::CONNECT {
                return Err(MethodRefused(http::Method::CONNECT).into());
            }
            let caller = authorize::caller(
                config.auth.as_ref(),
                request.headers(),
                crate::auth::PeerCertificate::of(request.extensions()).as_ref(),
            )?;
            config.host(request.version(), request.headers())?;
            let (token, account) = config.fencing_headers(request.headers())?;
            if let Some(caller) = &caller {
                authorize::may_pay_on(config.auth.as_ref(), caller, account.as_str())?;
            }
            if let Some(template) = &config.account_in_path
                && !template.names(request.uri().path(), account.as_str())
            {
                authorize::forbidden(
                    config.auth.as_ref(),
                    format!("the request path does not name the Fencing-Account at {template}"),
                )?;
            }
            // After the caller's own checks, so that an account outside a worker's patterns
            // is a 403 whatever its characters; before the proof, which no grant could make.
            let lock_key = config.grants.grantable(&config.account_header, &account)?;
            let evidence = config
                .grants
                .check(
                    &config.proof_header,
                    single_header(request.headers(), &config.proof_header),
                    &lock_key,
                    token,
                    caller.as_deref(),
                )
                .inspect_err(|e| {
                    if let (true, Some(auth)) = (e.is::<Forbidden>(), &config.auth) {
                        auth.metrics.refused(
                            crate::auth::Listener::Proxy,
                            crate::auth::Refusal::Forbidden,
                        );
                    }
                })?;
            let idempotency_key = config.idempotency_key(request.headers())?;
            let first_token = first_token(
                request.headers(),
                &config.first_token_header,
                idempotency_key.is_some(),
                token,
            )?;
            record_on_request_span(token, &account);

            let declared = request
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > config.max_body_bytes) {
                return Err(BodyTooLarge {
                    limit: config.max_body_bytes,
                }
                .into());
            }
            let (mut parts, body) = request.into_parts();
            if caller.is_some() {
                parts.headers.remove(header::AUTHORIZATION);
            }
            let limited = Limited::new(body, config.max_body_bytes as usize);
            // A chunked body is over the limit as soon as its chunk sizes say so, whether or
            // not the bytes ever come (the connection follows them: `crate::http::DeclaredBody`).
            // Only an HTTP/1 body sent with a `Transfer-Encoding` has chunks: any other is
            // framed by its `Content-Length`, or by HTTP/2, and declares none.
            let chunked = parts.headers.contains_key(header::TRANSFER_ENCODING);
            let declared_over = async {
                match crate::http::Arrival::of(&parts.extensions) {
                    Some(arrival) if chunked => {
                        arrival.declared.clone().over(config.max_body_bytes).await;
                    }
                    _ => std::future::pending().await,
                }
            };
            let read = tokio::select! {
                read = deadline.bound(limited.collect()) => read,
                () = declared_over => {
                    return Err(BodyTooLarge {
                        limit: config.max_body_bytes,
                    }
                    .into());
                }
            };
            let bytes = match read {
                Err(_) => return Err(ClientTimeout(config.request_timeout).into()),
                Ok(Ok(collected)) => collected.to_bytes(),
                Ok(Err(e)) if e.is::<LengthLimitError>() => {
                    return Err(BodyTooLarge {
                        limit: config.max_body_bytes,
                    }
                    .into());
                }
                Ok(Err(e)) => return Err(BadRequest::Body(e.to_string()).into()),
            };
            let idempotency = idempotency_key.map(|key| {
                let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                IdempotencyKey {
                    key,
                    first_token,
                    owner: super::idempotency::new_owner(),
                    fingerprint: super::idempotency::fingerprint(
                        parts.method.as_str(),
                        target,
                        &bytes,
                    ),
                }
            });
            let request = Box::new(Request::from_parts(parts, bytes));
            // Last of all the checks, so that its answer is not a free oracle of the source's
            // position: a probe that gets past it costs a fence check (and, at or above the
            // mark, a real forward). Without proofs nothing more can be done; see docs/contract.md.
            if evidence == Evidence::Unproven {
                let issued = deadline
                    .bound(config.grants.source.issued(token.get()))
                    .await
                    .map_err(|_| ClientTimeout(config.request_timeout))?
                    .map_err(SourceUnavailable)?;
                if !issued {
                    return Err(ImplausibleToken {
                        header: config.token_header.clone(),
                    }
                    .into());
                }
            }
            self.inner
                .handle(FencedRequest {
                    token,
                    account,
                    request,
                    deadline,
                    idempotency,
                })
                .await
        }
    }
}

/// Why a header could not be read as exactly one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("is missing")]
    Missing,
    #[error("appears more than once")]
    Repeated,
    #[error("is not visible ASCII")]
    NotAscii,
}

/// Returns the single value of `name`, refusing a missing or repeated header: two tokens on one
/// request would leave the proxy choosing which grant the request belongs to.
pub fn single_header<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> Result<&'a str, HeaderError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next().ok_or(HeaderError::Missing)?;
    if values.next().is_some() {
        return Err(HeaderError::Repeated);
    }
    first.to_str().map_err(|_| HeaderError::NotAscii)
}

/// Records `lock.token` and `account` on the span the request runs in (`proxy.request`), in one
/// record: a subscriber formats a span's recorded fields once per record, and the span is
/// named by its id, without taking a handle to it (a clone and a drop in the registry).
fn record_on_request_span(token: FencingToken, account: &AccountId) {
    use tracing::field::Value;
    tracing::dispatcher::get_default(|dispatch| {
        let Some((id, metadata)) = dispatch.current_span().into_inner() else {
            return;
        };
        let fields = metadata.fields();
        let (Some(token_field), Some(account_field)) =
            (fields.field("lock.token"), fields.field("account"))
        else {
            return;
        };
        let (token, account) = (token.get(), account.as_str());
        let values = [
            (&token_field, Some(&token as &dyn Value)),
            (&account_field, Some(&account as &dyn Value)),
        ];
        let values = fields.value_set(&values);
        dispatch.record(&id, &tracing::span::Record::new(&values));
    });
}

#[cfg(test)]
mod tests;

/// Properties of the fencing headers as the proxy reads them, over generated requests (the
/// fuzz target `fence_headers` checks the same on arbitrary bytes).
#[cfg(test)]
mod properties;
