//! Who is calling, and whether they may: one [`Authenticator`] per process, shared
//! by the lock API, the proxy and the admin listener.
//!
//! A caller proves who it is with a bearer secret (`Authorization: Bearer rgs_…`) or with a
//! client certificate on a mutual-TLS listener; the [`credentials`] file maps either to an
//! [`Identity`] and says what that identity may touch. The file is re-read when it changes
//! ([`Authenticator::watch`]); a version that does not parse is refused and the last good one
//! stays in force, so a typo never locks every worker out (nor lets anyone in).
//!
//! Without a credentials file (`[auth] credentials_file = ""`) there is no authentication at
//! all and every caller is anonymous; railguard says so loudly at start.
//!
//! Answers: no or unknown credentials → 401 with `WWW-Authenticate: Bearer`; a known identity
//! asking for a key, account or action it may not → 403. Neither says which identities exist
//! or what they may do.

pub mod concurrency;
pub mod credentials;
pub mod pattern;
pub mod rate;
pub mod secret;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use http::{HeaderMap, HeaderValue, header};
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

pub use credentials::{Credentials, CredentialsError, Identity, LockKeyShape, Permission, Role};

/// The verified client certificate of the request's connection: the SHA-256 of its DER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCertificate(pub [u8; 32]);

impl PeerCertificate {
    /// The certificate of the connection a request came on, from the [`crate::http::Arrival`]
    /// the listener puts in every request's extensions (mutual TLS only).
    pub fn of(extensions: &http::Extensions) -> Option<Self> {
        crate::http::Arrival::of(extensions)
            .and_then(|arrival| arrival.peer.client_cert_sha256)
            .map(Self)
    }
}

/// Why a request has no identity: a 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unauthenticated {
    #[error(
        "credentials are required: send `Authorization: Bearer <secret>` or a client certificate"
    )]
    Missing,
    #[error("the Authorization header is not one `Bearer <secret>`")]
    Malformed,
    #[error("the credentials are not recognised")]
    Unknown,
    #[error("the bearer secret and the client certificate name different identities")]
    Disagree,
}

impl Unauthenticated {
    /// The `WWW-Authenticate` challenge (RFC 6750 §3).
    pub fn challenge(self) -> HeaderValue {
        HeaderValue::from_static("Bearer realm=\"railguard\"")
    }
}

/// The listener a refusal happened on: the `listener` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Proxy,
    Lock,
    Admin,
}

impl Listener {
    pub fn as_str(self) -> &'static str {
        match self {
            Listener::Proxy => "proxy",
            Listener::Lock => "lock",
            Listener::Admin => "admin",
        }
    }
}

/// Why a request was refused by authentication or authorisation: the `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Unauthenticated,
    Forbidden,
    RateLimited,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::Forbidden => "forbidden",
            Refusal::RateLimited => "rate_limited",
        }
    }
}

/// The metrics of authentication.
#[derive(Clone)]
pub struct AuthMetrics {
    refusals: IntCounterVec,
    reloads: IntCounterVec,
    identities: IntGauge,
    /// 1 while the file on disk is not the version in force (its last change failed).
    stale: IntGauge,
}

impl AuthMetrics {
    pub fn register(registry: &Registry) -> Self {
        let refusals = IntCounterVec::new(
            Opts::new(
                "railguard_auth_refusals_total",
                "Requests refused by authentication (401), authorisation (403) or the \
                 per-identity lock-API rate limit (429), by listener.",
            ),
            &["listener", "reason"],
        )
        .expect("valid metric");
        let reloads = IntCounterVec::new(
            Opts::new(
                "railguard_credentials_reloads_total",
                "Reads of the credentials file after a change: loaded, or failed (the last \
                 good version stays in force).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        let identities = IntGauge::new(
            "railguard_credentials_identities",
            "Identities in the credentials file in force (0 with authentication off).",
        )
        .expect("valid metric");
        let stale = IntGauge::new(
            "railguard_credentials_stale",
            "1 while the credentials file on disk cannot be used and an older version is in \
             force: a removed secret may still be accepted.",
        )
        .expect("valid metric");
        for listener in [Listener::Proxy, Listener::Lock, Listener::Admin] {
            for reason in [
                Refusal::Unauthenticated,
                Refusal::Forbidden,
                Refusal::RateLimited,
            ] {
                refusals.with_label_values(&[listener.as_str(), reason.as_str()]);
            }
        }
        for outcome in ["loaded", "failed"] {
            reloads.with_label_values(&[outcome]);
        }
        registry
            .register(Box::new(refusals.clone()))
            .expect("register");
        registry
            .register(Box::new(reloads.clone()))
            .expect("register");
        registry
            .register(Box::new(identities.clone()))
            .expect("register");
        registry
            .register(Box::new(stale.clone()))
            .expect("register");
        Self {
            refusals,
            reloads,
            identities,
            stale,
        }
    }

    /// Counts one refusal.
    pub fn refused(&self, listener: Listener, reason: Refusal) {
        self.refusals
            .with_label_values(&[listener.as_str(), reason.as_str()])
            .inc();
    }
}

/// One version of the file as read: the SHA-256 of its bytes, or of the read error. A content
/// digest, not a stamp: a rewrite that keeps the size and the mtime (`cp -p`, `rsync -t`, two
/// writes in one timestamp tick) is still a new version.
type Version = [u8; 32];

fn read_version(path: &Path) -> (Version, std::io::Result<String>) {
    use sha2::{Digest as _, Sha256};
    let read = std::fs::read(path);
    let version: Version = match &read {
        Ok(bytes) => Sha256::digest(bytes).into(),
        Err(e) => Sha256::digest(format!("unreadable: {:?}", e.kind())).into(),
    };
    let text = read.and_then(|bytes| {
        String::from_utf8(bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()))
    });
    (version, text)
}

/// What the watcher has seen of the file.
#[derive(Debug)]
struct Seen {
    /// The version last acted on (put in force, or refused).
    settled: Version,
    /// A newer version seen once: it is acted on when the next look finds it unchanged, so a
    /// file caught half-way through an in-place write is never put in force.
    pending: Option<Version>,
}

/// The credentials in force, and where they come from.
pub struct Authenticator {
    path: PathBuf,
    shape: LockKeyShape,
    current: RwLock<Arc<Credentials>>,
    seen: Mutex<Seen>,
    pub metrics: AuthMetrics,
    /// The lock API's per-identity rate limit.
    pub lock_rate: rate::RateLimiter,
    /// The lock API's per-identity bound on requests in flight (waiting acquires included).
    pub lock_in_flight: Arc<concurrency::InFlightByIdentity>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Authenticator {
    /// Loads `path`; an error names the file and the key.
    pub fn load(
        path: &Path,
        shape: LockKeyShape,
        lock_requests_per_s: u32,
        lock_in_flight_per_identity: usize,
        metrics: AuthMetrics,
    ) -> Result<Arc<Self>, CredentialsError> {
        // One read: the version remembered is the one put in force.
        let (settled, text) = read_version(path);
        let file = path.display().to_string();
        let credentials = match text {
            Ok(text) => Credentials::parse(&text, &file, &shape)?,
            Err(_) => Credentials::load(path, &shape)?,
        };
        metrics.identities.set(credentials.names().len() as i64);
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            shape,
            current: RwLock::new(Arc::new(credentials)),
            seen: Mutex::new(Seen {
                settled,
                pending: None,
            }),
            metrics,
            lock_rate: rate::RateLimiter::new(lock_requests_per_s),
            lock_in_flight: concurrency::InFlightByIdentity::new(lock_in_flight_per_identity),
        }))
    }

    /// The credentials file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn credentials(&self) -> Arc<Credentials> {
        self.current.read().expect("not poisoned").clone()
    }

    /// The identity of a request with `headers`, on a connection with `certificate`.
    pub fn identify(
        &self,
        headers: &HeaderMap,
        certificate: Option<&PeerCertificate>,
    ) -> Result<Arc<Identity>, Unauthenticated> {
        let credentials = self.credentials();
        let by_secret = match bearer(headers)? {
            None => None,
            Some(secret) => Some(
                credentials
                    .by_secret(&secret::digest(secret))
                    .ok_or(Unauthenticated::Unknown)?
                    .clone(),
            ),
        };
        let by_certificate = match certificate {
            None => None,
            // A certificate the CA vouches for but the file does not list identifies no one;
            // with a bearer secret beside it, the secret decides.
            Some(cert) => credentials.by_certificate(&cert.0).cloned(),
        };
        match (by_secret, by_certificate) {
            (Some(s), Some(c)) if s.name != c.name => Err(Unauthenticated::Disagree),
            (Some(identity), _) | (None, Some(identity)) => Ok(identity),
            (None, None) if certificate.is_some() => Err(Unauthenticated::Unknown),
            (None, None) => Err(Unauthenticated::Missing),
        }
    }

    /// Reads the file and acts on a new version once two looks in a row found the same bytes
    /// (so a new version is in force within two `reload_interval_ms`). Returns whether a new
    /// version came into force.
    pub fn reload_if_changed(&self) -> bool {
        let (version, text) = read_version(&self.path);
        {
            let mut seen = self.seen.lock().expect("not poisoned");
            if version == seen.settled {
                seen.pending = None;
                return false;
            }
            if seen.pending != Some(version) {
                seen.pending = Some(version);
                return false;
            }
            seen.settled = version;
            seen.pending = None;
        }
        self.put_in_force(text, "credentials file changed").is_ok()
    }

    /// Reads the file now and puts it in force if it parses, without waiting for a second look
    /// (SIGHUP: whoever sends it says the file is complete). On an error the version in force
    /// stays. Returns how many identities the file now in force holds.
    pub fn reload_now(&self) -> Result<usize, CredentialsError> {
        let (version, text) = read_version(&self.path);
        {
            let mut seen = self.seen.lock().expect("not poisoned");
            seen.settled = version;
            seen.pending = None;
        }
        self.put_in_force(text, "credentials file read again (SIGHUP)")
    }

    /// Parses `text`, the file's contents, and puts it in force; or logs and counts why not.
    fn put_in_force(
        &self,
        text: std::io::Result<String>,
        why: &str,
    ) -> Result<usize, CredentialsError> {
        let file = self.path.display().to_string();
        let parsed = text
            .map_err(|e| CredentialsError {
                file: file.clone(),
                key: "(file)".into(),
                message: format!("cannot read the credentials file: {e}"),
            })
            .and_then(|text| Credentials::parse(&text, &file, &self.shape));
        match parsed {
            Ok(credentials) => {
                let identities = credentials.names().len();
                self.metrics.identities.set(identities as i64);
                tracing::info!(file = %self.path.display(), identities,
                    "{why}; the new version is in force");
                *self.current.write().expect("not poisoned") = Arc::new(credentials);
                self.metrics.reloads.with_label_values(&["loaded"]).inc();
                self.metrics.stale.set(0);
                Ok(identities)
            }
            Err(e) => {
                tracing::error!(error = %e,
                    "{why} but cannot be used; the last good version stays in force");
                self.metrics.reloads.with_label_values(&["failed"]).inc();
                self.metrics.stale.set(1);
                Err(e)
            }
        }
    }

    /// Polls the file every `interval` until the task is aborted.
    pub fn watch(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let this = this.clone();
                // File reads block; keep them off the runtime's worker threads.
                let _ = tokio::task::spawn_blocking(move || this.reload_if_changed()).await;
            }
        })
    }
}

/// The bearer secret of `Authorization`, if the header is there.
fn bearer(headers: &HeaderMap) -> Result<Option<&str>, Unauthenticated> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Unauthenticated::Malformed);
    }
    let text = value.to_str().map_err(|_| Unauthenticated::Malformed)?;
    let (scheme, secret) = text.split_once(' ').ok_or(Unauthenticated::Malformed)?;
    let secret = secret.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || secret.is_empty() || secret.contains(' ') {
        return Err(Unauthenticated::Malformed);
    }
    Ok(Some(secret))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn authenticator(text: &str) -> (tempfile::TempDir, Arc<Authenticator>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("credentials.toml");
        std::fs::write(&path, text).unwrap();
        let metrics = AuthMetrics::register(&Registry::new());
        let auth = Authenticator::load(&path, LockKeyShape::default(), 10, 10, metrics).unwrap();
        (dir, auth)
    }

    fn headers(authorization: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for a in authorization {
            h.append(header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    fn worker(name: &str, secret: &str) -> String {
        format!(
            "[[worker]]\nname = \"{name}\"\nsecrets = [\"{}\"]\naccounts = [\"*\"]\n",
            secret::digest_text(secret)
        )
    }

    #[test]
    fn bearer_secrets_and_certificates_identify_and_nothing_else_does() {
        let cert = PeerCertificate([9; 32]);
        let text = format!(
            "{}[[worker]]\nname = \"b\"\ncertificates = [\"sha256:{}\"]\naccounts = [\"*\"]\n",
            worker("a", "rgs_a"),
            crate::proof::hex(&cert.0)
        );
        let (_dir, auth) = authenticator(&text);
        let id = |h: &[&str], c: Option<&PeerCertificate>| auth.identify(&headers(h), c);
        assert_eq!(id(&["Bearer rgs_a"], None).unwrap().name, "a");
        assert_eq!(id(&["bearer rgs_a"], None).unwrap().name, "a");
        assert_eq!(id(&[], Some(&cert)).unwrap().name, "b");
        assert_eq!(id(&[], None).unwrap_err(), Unauthenticated::Missing);
        assert_eq!(
            id(&["Bearer rgs_x"], None).unwrap_err(),
            Unauthenticated::Unknown
        );
        assert_eq!(
            id(&[], Some(&PeerCertificate([1; 32]))).unwrap_err(),
            Unauthenticated::Unknown
        );
        for bad in ["rgs_a", "Basic rgs_a", "Bearer ", "Bearer a b"] {
            assert_eq!(
                id(&[bad], None).unwrap_err(),
                Unauthenticated::Malformed,
                "{bad}"
            );
        }
        assert_eq!(
            id(&["Bearer rgs_a", "Bearer rgs_a"], None).unwrap_err(),
            Unauthenticated::Malformed
        );
        assert_eq!(
            id(&["Bearer rgs_a"], Some(&cert)).unwrap_err(),
            Unauthenticated::Disagree
        );
    }

    #[test]
    fn a_changed_file_is_reloaded_and_a_broken_one_is_not() {
        let (dir, auth) = authenticator(&worker("a", "rgs_a"));
        let path = dir.path().join("credentials.toml");
        let id = |s: &str| auth.identify(&headers(&[&format!("Bearer {s}")]), None);
        assert!(!auth.reload_if_changed(), "unchanged");
        // Rotation: the new secret is added beside the old one, then the old one removed.
        std::fs::write(&path, worker("a", "rgs_b") + "\n").unwrap();
        assert!(
            !auth.reload_if_changed(),
            "a new version waits for a second look"
        );
        assert!(id("rgs_a").is_ok());
        assert!(auth.reload_if_changed());
        assert!(id("rgs_b").is_ok());
        assert_eq!(id("rgs_a").unwrap_err(), Unauthenticated::Unknown);
        std::fs::write(&path, "[[worker]]\nname = ").unwrap();
        assert!(!auth.reload_if_changed());
        assert!(!auth.reload_if_changed());
        assert!(id("rgs_b").is_ok(), "the last good version stays in force");
        std::fs::remove_file(&path).unwrap();
        assert!(!auth.reload_if_changed());
        assert!(!auth.reload_if_changed());
        assert!(
            id("rgs_b").is_ok(),
            "a missing file keeps the last good version"
        );
        let failed = auth.metrics.reloads.with_label_values(&["failed"]).get();
        assert_eq!(failed, 2);
        assert_eq!(auth.metrics.stale.get(), 1);
        std::fs::write(&path, worker("a", "rgs_c")).unwrap();
        assert!(!auth.reload_if_changed());
        assert!(auth.reload_if_changed());
        assert_eq!(
            auth.metrics.stale.get(),
            0,
            "a good version is in force again"
        );
    }

    /// A file replaced by a directory keeps the last good version (stale), and a
    /// file whose content flaps at every look is never put in force, half of it or not.
    #[test]
    fn a_directory_or_flapping_content_never_replaces_the_last_good_version() {
        let (dir, auth) = authenticator(&worker("a", "rgs_a"));
        let path = dir.path().join("credentials.toml");
        let id = |s: &str| auth.identify(&headers(&[&format!("Bearer {s}")]), None);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(!auth.reload_if_changed());
        assert!(!auth.reload_if_changed());
        assert!(id("rgs_a").is_ok());
        assert_eq!(auth.metrics.stale.get(), 1);
        std::fs::remove_dir(&path).unwrap();
        for i in 0..6 {
            let secret = if i % 2 == 0 { "rgs_b" } else { "rgs_c" };
            std::fs::write(&path, worker("a", secret)).unwrap();
            assert!(!auth.reload_if_changed(), "look {i}");
        }
        assert!(id("rgs_a").is_ok(), "no flapping version was put in force");
        assert!(auth.reload_if_changed(), "the same bytes twice: in force");
        assert!(id("rgs_c").is_ok());
        assert_eq!(auth.metrics.stale.get(), 0);
    }

    #[test]
    fn a_rewrite_that_keeps_size_and_mtime_is_a_new_version() {
        let (dir, auth) = authenticator(&worker("a", "rgs_a"));
        let path = dir.path().join("credentials.toml");
        let id = |s: &str| auth.identify(&headers(&[&format!("Bearer {s}")]), None);
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        // The same length, written in place, the mtime put back (`cp -p`, `rsync -t`).
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::io::Write::write_all(&mut &file, worker("a", "rgs_z").as_bytes()).unwrap();
        file.set_modified(mtime).unwrap();
        drop(file);
        auth.reload_if_changed();
        auth.reload_if_changed();
        assert!(id("rgs_z").is_ok(), "the new secret is in force");
        assert_eq!(id("rgs_a").unwrap_err(), Unauthenticated::Unknown);
    }

    #[test]
    fn a_version_seen_once_is_not_put_in_force() {
        let full = worker("a", "rgs_a") + "keys = [\"k-1\"]\n";
        let (dir, auth) = authenticator(&full);
        let path = dir.path().join("credentials.toml");
        let id = || auth.identify(&headers(&["Bearer rgs_a"]), None).unwrap();
        assert!(!id().may_lock("k-2"));
        // Caught half-way through an in-place write: valid TOML, and without its `keys` line
        // the worker would get its accounts' keys.
        std::fs::write(&path, &full[..full.find("keys").unwrap()]).unwrap();
        assert!(!auth.reload_if_changed());
        assert!(!id().may_lock("k-2"), "a version seen once is not in force");
        std::fs::write(&path, &full).unwrap();
        assert!(!auth.reload_if_changed());
        assert!(!auth.reload_if_changed());
        assert!(
            !id().may_lock("k-2"),
            "the partial version never came into force"
        );
    }
}
