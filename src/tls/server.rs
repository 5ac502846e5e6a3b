//! TLS on railguard's own listeners: the certificate a listener serves, re-read when its files
//! change, and, for mutual TLS, the CA that client certificates must chain to.
//!
//! [`TlsServer`] holds the rustls configuration of one listener. Each handshake takes the
//! current one from [`TlsServer::acceptor`]; that call is also where a change is noticed: at
//! most once a second it starts a check, on the blocking thread pool, which hashes the files'
//! contents, compares them with what was last loaded, and on a change builds a new
//! configuration from them and swaps it in. The handshake that started the check, and any that
//! arrive while it runs, wait for it — at most [`CHECK_WAIT`] after it started — so the first
//! handshake a second or more after a rotation gets the new certificate (or CA), as before the
//! check moved off the handshake's thread. Connections already open keep theirs.
//!
//! A check that does not return within [`CHECK_WAIT`] — a certificate on a mount that hangs (a
//! stale NFS handle, a secrets volume being remounted) — holds one blocking thread, not the
//! listener: handshakes go on with the configuration in use, and no other check starts until
//! that one returns. After [`STALLED_AFTER`] it is logged as an error and counted once as
//! `result="stalled"`, since no rotation (nor an expiring certificate's replacement) can take
//! effect until it returns. Files that do not parse (a half-written key, a certificate
//! without its key) are logged and counted, and the configuration in use stays, so a botched
//! rotation never takes a listener down. The CA file is re-read the same way.
//!
//! Every listener speaks HTTP/2 and HTTP/1.1, and says so with ALPN (`h2`, `http/1.1`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::IntCounterVec;
use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use crate::config::{ClientAuth, ListenerTls};

/// How often, at most, the files are checked for a change.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long after a check started handshakes wait for it. Reading and parsing a few kB takes
/// a millisecond or so; past this the check is taken to hang, and nothing waits for it.
pub const CHECK_WAIT: Duration = Duration::from_millis(500);

/// How long a check runs before it is reported as stalled.
pub const STALLED_AFTER: Duration = Duration::from_secs(10);

/// Why a listener's TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not PEM of the expected kind: {message}", path.display())]
    Pem { path: PathBuf, message: String },
    #[error("{}: no certificate in the file", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{}: {message}", path.display())]
    ClientCa { path: PathBuf, message: String },
    #[error("the certificate and key cannot be used together: {0}")]
    Rustls(#[from] rustls::Error),
}

/// One listener's TLS configuration, reloaded when its files change.
pub struct TlsServer {
    shared: Arc<Shared>,
}

struct Shared {
    files: ListenerTls,
    state: Mutex<State>,
    /// Bumped each time a check returns; handshakes wait on it.
    checks_done: tokio::sync::watch::Sender<u64>,
    listener: &'static str,
    reloads: IntCounterVec,
}

struct State {
    config: Arc<ServerConfig>,
    /// The files' metadata at the last attempt to load them, successful or not.
    stamps: Stamps,
    /// When the last check returned (or the files were first loaded).
    checked: Instant,
    /// When the check running on the blocking pool started; no other starts until it returns.
    checking: Option<Instant>,
    /// The running check has been reported as stalled.
    stall_reported: bool,
}

/// What tells that a file was replaced or rewritten.
#[derive(Debug, PartialEq, Eq)]
struct Stamps(Vec<Option<[u8; 32]>>);

/// The files' contents, each read once: the configuration is built from the very bytes that
/// were stamped, so a change between two reads can neither be missed nor counted twice.
struct Contents {
    cert: std::io::Result<Vec<u8>>,
    key: std::io::Result<Vec<u8>>,
    ca: Option<std::io::Result<Vec<u8>>>,
}

impl Contents {
    /// The files are a few kB, read at most once a second.
    fn read(files: &ListenerTls) -> Contents {
        Contents {
            cert: std::fs::read(&files.cert_file),
            key: std::fs::read(&files.key_file),
            ca: files.client_ca_file.as_ref().map(std::fs::read),
        }
    }

    /// The SHA-256 of each file's contents: a replacement that keeps size and mtime (`cp -p`,
    /// `rsync -t`) is still noticed.
    fn stamps(&self) -> Stamps {
        use sha2::{Digest as _, Sha256};
        let stamp =
            |read: &std::io::Result<Vec<u8>>| read.as_ref().ok().map(|b| Sha256::digest(b).into());
        let mut stamps = vec![stamp(&self.cert), stamp(&self.key)];
        if let Some(ca) = &self.ca {
            stamps.push(stamp(ca));
        }
        Stamps(stamps)
    }
}

impl TlsServer {
    /// Loads `files` for the listener named `listener`; `reloads` counts later reloads by
    /// `listener` and `result` (`ok`, `error`, `stalled`). Reads the files on the calling thread: call it
    /// at start-up, before the listener serves.
    pub fn load(
        files: ListenerTls,
        listener: &'static str,
        reloads: IntCounterVec,
    ) -> Result<TlsServer, TlsError> {
        let contents = Contents::read(&files);
        let stamps = contents.stamps();
        let config = Arc::new(build(&files, contents)?);
        Ok(TlsServer {
            shared: Arc::new(Shared {
                files,
                state: Mutex::new(State {
                    config,
                    stamps,
                    checked: Instant::now(),
                    checking: None,
                    stall_reported: false,
                }),
                checks_done: tokio::sync::watch::Sender::new(0),
                listener,
                reloads,
            }),
        })
    }

    /// The acceptor for a new handshake, with the files' current contents: starts a check
    /// when one is due and waits for a check that is running, at most until [`CHECK_WAIT`]
    /// after it started (see the module docs).
    pub async fn acceptor(&self) -> TlsAcceptor {
        let mut done = self.shared.checks_done.subscribe();
        let wait_until = {
            let mut state = self.shared.lock();
            if state.checking.is_none() && state.checked.elapsed() >= CHECK_EVERY {
                state.checking = Some(Instant::now());
                state.stall_reported = false;
                let shared = self.shared.clone();
                drop(tokio::task::spawn_blocking(move || {
                    shared.check();
                }));
            }
            match state.checking {
                Some(started) if started.elapsed() < CHECK_WAIT => Some(started + CHECK_WAIT),
                Some(started) => {
                    if started.elapsed() >= STALLED_AFTER && !state.stall_reported {
                        state.stall_reported = true;
                        self.shared
                            .reloads
                            .with_label_values(&[self.shared.listener, "stalled"])
                            .inc();
                        tracing::error!(listener = self.shared.listener,
                            cert = %self.shared.files.cert_file.display(),
                            waiting_secs = started.elapsed().as_secs(),
                            "a check of the TLS files has not returned: the file system does not \
                             answer; the certificate in use stays, and no change to the files \
                             takes effect until the check returns (or railguard restarts)");
                    }
                    None
                }
                None => None,
            }
        };
        if let Some(until) = wait_until {
            // A check that returned since `subscribe` has bumped the counter: no wait then.
            let _ = tokio::time::timeout_at(until, done.changed()).await;
        }
        TlsAcceptor::from(self.shared.lock().config.clone())
    }

    /// Checks the files now, however recently they were checked (SIGHUP), and waits for the
    /// check at most [`STALLED_AFTER`]. Handshakes meanwhile go on as with any check.
    pub async fn check_now(&self) -> Checked {
        // A check already running (started by a handshake) may have read the files before
        // they changed: it is waited for, and then this one is made.
        for _ in 0..2 {
            let mut done = self.shared.checks_done.subscribe();
            let started = {
                let mut state = self.shared.lock();
                let idle = state.checking.is_none();
                if idle {
                    state.checking = Some(Instant::now());
                    state.stall_reported = false;
                }
                idle
            };
            if started {
                let shared = self.shared.clone();
                let check = tokio::task::spawn_blocking(move || shared.check());
                return match tokio::time::timeout(STALLED_AFTER, check).await {
                    Ok(Ok(checked)) => checked,
                    Ok(Err(e)) => Checked::Failed(format!("the check did not finish: {e}")),
                    Err(_) => Checked::Stalled,
                };
            }
            if tokio::time::timeout(STALLED_AFTER, done.changed())
                .await
                .is_err()
            {
                return Checked::Stalled;
            }
        }
        Checked::Busy
    }
}

/// What a check of a listener's TLS files found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// The files are as when last loaded (or a check already running took them in).
    Unchanged,
    /// They changed, and the new certificate is in force for new connections.
    Reloaded,
    /// They changed but cannot be used: the certificate in use stays. Why.
    Failed(String),
    /// The check did not return: the file system does not answer.
    Stalled,
    /// Checks started by handshakes kept the files busy; the next handshake's check takes
    /// any change in.
    Busy,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the files and swaps in a new configuration if they changed. Runs on the blocking
    /// pool; the lock is held only to compare and swap, never while a file is read.
    fn check(&self) -> Checked {
        /// Ends the check whatever happens in it, a panic included, so that a later one can
        /// start.
        struct Done<'a>(&'a Shared);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                let mut state = self.0.lock();
                let took = state.checking.take().map(|started| started.elapsed());
                let reported = std::mem::take(&mut state.stall_reported);
                state.checked = Instant::now();
                drop(state);
                self.0.checks_done.send_modify(|n| *n = n.wrapping_add(1));
                if let Some(took) = took.filter(|_| reported) {
                    tracing::warn!(
                        listener = self.0.listener,
                        took_secs = took.as_secs(),
                        "a stalled check of the TLS files returned; checks resume"
                    );
                }
            }
        }
        let _done = Done(self);
        let contents = Contents::read(&self.files);
        let stamps = contents.stamps();
        if stamps == self.lock().stamps {
            return Checked::Unchanged;
        }
        let built = build(&self.files, contents);
        let mut state = self.lock();
        state.stamps = stamps;
        match built {
            Ok(config) => {
                state.config = Arc::new(config);
                drop(state);
                self.reloads.with_label_values(&[self.listener, "ok"]).inc();
                tracing::info!(listener = self.listener,
                    cert = %self.files.cert_file.display(),
                    "TLS files changed: reloaded");
                Checked::Reloaded
            }
            Err(e) => {
                drop(state);
                self.reloads
                    .with_label_values(&[self.listener, "error"])
                    .inc();
                tracing::error!(listener = self.listener, error = %e,
                    "TLS files changed but cannot be used; still serving the previous \
                     certificate");
                Checked::Failed(e.to_string())
            }
        }
    }
}

/// A rustls server configuration from the `contents` of `files`.
fn build(files: &ListenerTls, contents: Contents) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = parse_certs(&files.cert_file, contents.cert)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: files.cert_file.clone(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(&read(&files.key_file, contents.key)?)
        .map_err(|e| pem(&files.key_file, e))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match (files.client_auth, &files.client_ca_file) {
        (ClientAuth::None, _) => builder.with_no_client_auth(),
        (_, None) => {
            // Validation requires the CA file whenever client certificates are asked for.
            return Err(TlsError::ClientCa {
                path: PathBuf::new(),
                message: "client certificates are asked for but no CA file is set".into(),
            });
        }
        (auth, Some(ca_file)) => {
            let ca_error = |message: String| TlsError::ClientCa {
                path: ca_file.clone(),
                message,
            };
            let mut roots = RootCertStore::empty();
            let ca_contents = contents.ca.unwrap_or_else(|| std::fs::read(ca_file)); // never: read whenever set
            for ca in parse_certs(ca_file, ca_contents)? {
                roots
                    .add(ca)
                    .map_err(|e| ca_error(format!("not a usable CA certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(ca_error("no CA certificate in the file".into()));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = match auth {
                ClientAuth::Optional => verifier.allow_unauthenticated(),
                _ => verifier,
            };
            let verifier = verifier
                .build()
                .map_err(|e| ca_error(format!("cannot verify clients with it: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

fn read(path: &Path, contents: std::io::Result<Vec<u8>>) -> Result<Vec<u8>, TlsError> {
    contents.map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn parse_certs(
    path: &Path,
    contents: std::io::Result<Vec<u8>>,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    CertificateDer::pem_slice_iter(&read(path, contents)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(path, e))
}

fn pem(path: &Path, e: rustls::pki_types::pem::Error) -> TlsError {
    match e {
        rustls::pki_types::pem::Error::Io(source) => TlsError::Read {
            path: path.to_path_buf(),
            source,
        },
        other => TlsError::Pem {
            path: path.to_path_buf(),
            message: other.to_string(),
        },
    }
}

/// The SHA-256 of a certificate's DER encoding: its fingerprint.
pub fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(cert.as_ref()).into()
}

/// The counter of certificate reloads, by `listener` and `result` (`ok`, `error`), not yet
/// registered anywhere.
pub fn reload_counter() -> IntCounterVec {
    IntCounterVec::new(
        prometheus::Opts::new(
            "railguard_listener_tls_reloads_total",
            "Reloads of a listener's TLS files after they changed, by listener and result: \
             ok, error (the files did not parse and the previous certificate stays), or \
             stalled (a check of the files has not returned for 10 s: the file system hangs, \
             and no change takes effect until it does).",
        ),
        &["listener", "result"],
    )
    .expect("valid metric")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration is built from the bytes that were stamped, not from a second read:
    /// a file replaced in between is neither missed (built from the old bytes, stamped as new)
    /// nor reloaded twice.
    #[test]
    fn the_configuration_is_built_from_the_bytes_that_were_stamped() {
        let pki = railguard_testkit::Pki::new();
        let server = pki.server("railguard");
        let dir = tempfile::tempdir().unwrap();
        let files = ListenerTls {
            cert_file: dir.path().join("cert.pem"),
            key_file: dir.path().join("key.pem"),
            client_ca_file: Some(dir.path().join("ca.pem")),
            client_auth: ClientAuth::Required,
        };
        std::fs::copy(&server.cert, &files.cert_file).unwrap();
        std::fs::copy(&server.key, &files.key_file).unwrap();
        std::fs::copy(&pki.ca, files.client_ca_file.as_ref().unwrap()).unwrap();
        let contents = Contents::read(&files);
        let stamps = contents.stamps();
        for path in [&files.cert_file, &files.key_file] {
            std::fs::write(path, "rewritten after the read").unwrap();
        }
        std::fs::write(files.client_ca_file.as_ref().unwrap(), "rewritten").unwrap();
        assert!(build(&files, contents).is_ok(), "built from what was read");
        assert_ne!(Contents::read(&files).stamps(), stamps);
    }
}
