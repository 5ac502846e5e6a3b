//! Who may pay on which account: the proxy's side of [`crate::auth`].
//!
//! With authentication on, a request names its caller (a bearer secret, or the connection's
//! client certificate); the caller must be a worker whose account patterns cover the
//! request's account; and its grant proof must be the proof of a grant *to that identity*
//! (`crate::proof::ProofKey::verify_for`), so a grant obtained by one worker pays for no
//! other. All three are checked in memory, before the body is read, the fence is asked or a
//! mark can move. The caller's `Authorization` header is removed before the request goes on
//! to the rail: railguard's credentials are not the rail's.

use std::sync::Arc;

use http::HeaderMap;

use crate::auth::{Authenticator, Identity, Listener, PeerCertificate, Refusal, Unauthenticated};

/// The request has no identity: 401.
#[derive(Debug, thiserror::Error)]
#[error("{0}; nothing was forwarded")]
pub struct Unauthorized(pub Unauthenticated);

/// The identity may not do this: 403.
#[derive(Debug, thiserror::Error)]
#[error("{reason}; nothing was forwarded and no mark moved")]
pub struct Forbidden {
    pub reason: String,
}

/// The caller of a request, if authentication is on.
pub fn caller(
    auth: Option<&Arc<Authenticator>>,
    headers: &HeaderMap,
    certificate: Option<&PeerCertificate>,
) -> Result<Option<Arc<Identity>>, Unauthorized> {
    let Some(auth) = auth else {
        return Ok(None);
    };
    let identity = auth.identify(headers, certificate).map_err(|e| {
        auth.metrics
            .refused(Listener::Proxy, Refusal::Unauthenticated);
        Unauthorized(e)
    })?;
    Ok(Some(identity))
}

/// 403 unless `identity` may pay on `account`.
pub fn may_pay_on(
    auth: Option<&Arc<Authenticator>>,
    identity: &Identity,
    account: &str,
) -> Result<(), Forbidden> {
    if identity.may_pay_on(account) {
        return Ok(());
    }
    forbidden(
        auth,
        if identity.is_worker() {
            format!("identity {:?} may not pay on this account", identity.name)
        } else {
            "an operator credential opens nothing on the proxy".into()
        },
    )
}

/// Counts and returns a 403.
pub fn forbidden<T>(auth: Option<&Arc<Authenticator>>, reason: String) -> Result<T, Forbidden> {
    if let Some(auth) = auth {
        auth.metrics.refused(Listener::Proxy, Refusal::Forbidden);
    }
    Err(Forbidden { reason })
}
