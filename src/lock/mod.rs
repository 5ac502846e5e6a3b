//! The lock service: leases on keys, each grant carrying a fencing token fixed at grant time.
//!
//! - [`LockBackend`] is the one interface every backend implements (try-acquire, renew,
//!   release, inspect); [`postgres`] is the PostgreSQL backend.
//! - [`service`] adds what is the same for every backend: blocking acquire with first-come,
//!   first-served waiters, metrics and spans.
//! - [`api`] is the HTTP/JSON API on its own listener.
//!
//! FR-02: a token is obtained once, in the acquire, and is an immutable property of the grant.
//! No operation here re-reads, refreshes or recomputes the token of an existing grant; renew
//! and release take the caller's token and only ever compare it. [`Inspection`] has no token
//! field at all (FR-07).

pub mod api;
pub mod etcd;
pub mod guard;
mod metrics;
pub mod postgres;
pub mod service;
pub mod source;
mod start;
pub mod wait;

pub use start::{LockDatabase, Locks, token_source};

use std::fmt;
use std::future::Future;
use std::time::Duration;

pub use railguard_sdk::wire::{KeyStatus as Inspection, LockKey, MAX_KEY_LEN};

use crate::token::FencingToken;

/// Longest holder name, in bytes.
pub const MAX_HOLDER_LEN: usize = 256;

/// Who holds a grant, for diagnosis: 1 to 256 bytes of visible ASCII.
pub fn parse_holder(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("holder is empty".into());
    }
    if text.len() > MAX_HOLDER_LEN {
        return Err(format!("holder is longer than {MAX_HOLDER_LEN} bytes"));
    }
    if !text.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return Err("holder must be printable ASCII".into());
    }
    Ok(text.to_string())
}

/// The per-grant secret that authorises renew and release (C2 §2.3 a): 256 random bits, made
/// for one acquire attempt and returned only in the acquire response. The backend keeps its
/// SHA-256 only. The token never authorises anything: tokens are sequential, so anyone can
/// guess one, and an answer that told a guess apart would be a read path returning tokens.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaseSecret([u8; 32]);

impl LeaseSecret {
    pub fn generate() -> Self {
        Self(crate::proof::random_bytes())
    }

    /// The wire form: 64 hex digits.
    pub fn parse(text: &str) -> Result<Self, String> {
        crate::proof::unhex(text)
            .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
            .map(Self)
            .ok_or_else(|| "lease_secret must be the 64 hex digits returned by acquire".into())
    }

    pub fn to_wire(&self) -> String {
        crate::proof::hex(&self.0)
    }

    /// What the backend stores and compares.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(self.0).into()
    }
}

impl fmt::Debug for LeaseSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseSecret(..)")
    }
}

/// A grant as the backend made it. The token is fixed here, once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub key: LockKey,
    pub holder: String,
    pub token: FencingToken,
    /// Authorises renew and release of this grant; only its acquirer ever sees it.
    pub secret: LeaseSecret,
    pub ttl: Duration,
    /// The backend's clock, microseconds since the Unix epoch: for diagnosis and for checking
    /// grant history in one clock; never for a correctness decision.
    pub granted_at_us: i64,
    pub expires_at_us: i64,
    /// The key was taken over from a grant that expired without being released.
    pub took_over: bool,
}

/// The outcome of one acquire attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    Granted(Grant),
    /// Someone else's grant holds the key; it expires in about `retry_in` if not renewed.
    Held {
        retry_in: Option<Duration>,
    },
}

/// A renewed lease. The token is the caller's, unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    pub expires_at_us: i64,
    pub ttl: Duration,
}

/// A grant ended by release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// When, in the backend's clock where it has one (µs since the Unix epoch); for etcd, a
    /// lower bound taken just before the release.
    pub at_us: i64,
    /// etcd: the revision of the delete. Every later grant of the key has a larger token.
    pub revision: Option<i64>,
}

/// Why a lock operation did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    #[error("the key is held by another grant")]
    Held,
    #[error("the grant no longer holds the key (expired, released or taken over)")]
    Lost,
    #[error("too many waiters: {0} are already waiting in this railguard")]
    TooManyWaiters(usize),
    #[error("the lock backend is unavailable: {0}")]
    Unavailable(String),
    /// The token source guard refuses to grant ([`guard`]): nothing was granted.
    #[error("{0}")]
    SourceBehind(&'static str),
    /// A renew or release presented a live grant's token and lease secret, but the grant was
    /// issued to another authenticated identity: nothing was renewed or released (403).
    #[error("this grant was issued to another identity")]
    OtherHolder,
}

/// One backend's mechanics. Implementations decide nothing about waiting or fairness; they
/// make single attempts, atomically, in the backend's own clock.
pub trait LockBackend: Send + Sync + 'static {
    /// What one acquire carries from each of its attempts to the next, made by
    /// [`session`](Self::session) when the acquire starts and dropped when it ends.
    ///
    /// It exists for etcd, where an attempt needs a lease before it can put the key: one lease
    /// per acquire, kept alive while the acquire waits, as etcd's own `concurrency.Session`
    /// does, instead of a lease granted and revoked on every retry. The rule for every
    /// backend: an attempt that returns [`Attempt::Granted`] hands what the session held over
    /// to the grant; dropping a session that holds anything else (the acquire timed out,
    /// failed, or its caller went away) gives it back, once.
    type Session: Send;

    /// `"postgres"` or `"etcd"`: the `backend` label of metrics.
    fn name(&self) -> &'static str;

    /// A session for one acquire. No I/O: a session costs nothing until its first attempt.
    fn session(&self) -> Self::Session;

    /// One atomic attempt of the acquire `session` belongs to (the same `key`, `holder` and
    /// `ttl` on every attempt): create the key, or take it over if its grant has expired, with
    /// a new token; otherwise report it held.
    fn try_acquire(
        &self,
        session: &mut Self::Session,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Attempt, LockError>> + Send;

    /// Extends the lease of the grant `(key, token)` by its ttl, if `secret` is that grant's.
    /// `Lost` otherwise — the same answer whether the grant ended or the secret is wrong, so
    /// that no guess is ever confirmed. A secret that does not match the key's current grant
    /// counts in `lock_rejected_secrets_total`.
    ///
    /// `caller` is the authenticated identity asking (`None` with authentication off): a grant
    /// whose holder is another identity is refused with `OtherHolder` — checked only once the
    /// token and secret matched, so the answer confirms nothing a guesser did not know.
    fn renew(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> impl Future<Output = Result<Renewed, LockError>> + Send;

    /// Ends the grant `(key, token)` if `secret` is its secret and it still holds the key,
    /// returning when it ended in the backend's clock (µs since the Unix epoch); `Lost`
    /// otherwise, with the same care as `renew` (and the same `caller` check).
    fn release(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> impl Future<Output = Result<Released, LockError>> + Send;

    /// Diagnosis only: never returns a token.
    fn inspect(&self, key: &LockKey) -> impl Future<Output = Result<Inspection, LockError>> + Send;
}

/// The backend chosen in the config file (FR-09): same interface, same token semantics.
pub enum AnyBackend {
    Postgres(postgres::PgLocks),
    Etcd(std::sync::Arc<etcd::EtcdLocks>),
}

/// The session of the backend an [`AnyBackend`] chose.
pub enum AnySession {
    Postgres(postgres::PgSession),
    Etcd(etcd::EtcdSession),
}

impl LockBackend for AnyBackend {
    type Session = AnySession;

    fn name(&self) -> &'static str {
        match self {
            AnyBackend::Postgres(b) => b.name(),
            AnyBackend::Etcd(b) => b.name(),
        }
    }

    fn session(&self) -> AnySession {
        match self {
            AnyBackend::Postgres(b) => AnySession::Postgres(b.session()),
            AnyBackend::Etcd(b) => AnySession::Etcd(b.session()),
        }
    }

    async fn try_acquire(
        &self,
        session: &mut AnySession,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
    ) -> Result<Attempt, LockError> {
        match (self, session) {
            (AnyBackend::Postgres(b), AnySession::Postgres(s)) => {
                b.try_acquire(s, key, holder, ttl).await
            }
            (AnyBackend::Etcd(b), AnySession::Etcd(s)) => b.try_acquire(s, key, holder, ttl).await,
            // Only a caller mixing up two backends gets here: refused, and nothing granted.
            _ => Err(LockError::Unavailable(
                "an acquire session made by another backend".into(),
            )),
        }
    }

    async fn renew(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Renewed, LockError> {
        match self {
            AnyBackend::Postgres(b) => b.renew(key, token, secret, caller).await,
            AnyBackend::Etcd(b) => b.renew(key, token, secret, caller).await,
        }
    }

    async fn release(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Released, LockError> {
        match self {
            AnyBackend::Postgres(b) => b.release(key, token, secret, caller).await,
            AnyBackend::Etcd(b) => b.release(key, token, secret, caller).await,
        }
    }

    async fn inspect(&self, key: &LockKey) -> Result<Inspection, LockError> {
        match self {
            AnyBackend::Postgres(b) => b.inspect(key).await,
            AnyBackend::Etcd(b) => b.inspect(key).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_grammar() {
        assert!(LockKey::parse("acct:eu-1.payments_x").is_ok());
        assert!(LockKey::parse(&"k".repeat(256)).is_ok());
        for bad in ["", "a/b", "a b", "é", "a%2F", &"k".repeat(257)] {
            assert!(LockKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lease_secrets_are_random_hex_and_never_printed() {
        let a = LeaseSecret::generate();
        let b = LeaseSecret::generate();
        assert_ne!(a, b);
        assert_eq!(LeaseSecret::parse(&a.to_wire()).unwrap(), a);
        assert_ne!(a.digest(), b.digest());
        assert_eq!(format!("{a:?}"), "LeaseSecret(..)");
        for bad in ["", "00", &"0".repeat(63), &"g".repeat(64), &"0".repeat(66)] {
            assert!(LeaseSecret::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn holder_grammar() {
        assert!(parse_holder("worker 7 @ host-1").is_ok());
        assert!(parse_holder("").is_err());
        assert!(parse_holder("a\nb").is_err());
        assert!(parse_holder(&"h".repeat(257)).is_err());
    }
}
