//! TLS to the rail: an `https://` `proxy.upstream`, verified against a private CA, with an
//! optional client certificate for a rail that authenticates its callers.
//!
//! [`RailConnector`] is the forward client's connector: hyper-util's `HttpConnector` opens the
//! TCP connection, and for an `https://` URI a rustls handshake (ring provider, TLS 1.2 and
//! 1.3, ALPN `http/1.1` only — the forward path speaks HTTP/1.1 to the rail and its "was the
//! request sent?" bookkeeping relies on hyper's HTTP/1 client) runs on top, bounded by
//! `proxy.upstream_connect_timeout_ms` like the TCP connect.
//!
//! A handshake failure — the rail's certificate is not from the configured CA, names another
//! host, or the handshake times out — is an error of the connector, which hyper reports as a
//! connect error: the request was never written to any connection, and the proxy says so. (A
//! rail that refuses *our* certificate under TLS 1.3 does so after our side of the handshake
//! has finished, so that refusal surfaces while the request is being written and is reported,
//! conservatively, as "may have been sent".)
//!
//! There is no fallback to the system's roots: an `https://` rail needs `proxy.upstream_ca_file`
//! (which may be the distribution's bundle, `/etc/ssl/certs/ca-certificates.crt`, to trust the
//! public CAs), as an `https://` etcd endpoint needs `etcd.tls_ca_file`. The files are read once,
//! at start; a rotated CA or client certificate takes effect at the next start.
//!
//! [`load_roots`] and [`load_identity`] are shared with the PostgreSQL side (`tls::postgres`).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tower::Service;

use crate::config::ProxyConfig;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A TLS file that cannot be used, naming the key that points at it and the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key} {}: {message}", path.display())]
pub struct TlsFileError {
    /// The config key (`proxy.upstream_ca_file`) or URL parameter that named the file.
    pub key: String,
    pub path: PathBuf,
    pub message: String,
}

impl TlsFileError {
    fn new(key: &str, path: &Path, message: impl Into<String>) -> Self {
        Self {
            key: key.to_string(),
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// The CA certificates of a PEM file (`key` names the setting, for errors): at least one,
/// each usable as a trust anchor.
pub fn load_roots(key: &str, path: &Path) -> Result<RootCertStore, TlsFileError> {
    let certs = load_certs(key, path)?;
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| {
            TlsFileError::new(key, path, format!("not a usable CA certificate: {e}"))
        })?;
    }
    Ok(roots)
}

/// A client certificate chain and its private key, from two PEM files.
pub fn load_identity(
    cert_key: &str,
    cert: &Path,
    key_key: &str,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsFileError> {
    let chain = load_certs(cert_key, cert)?;
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        TlsFileError::new(
            key_key,
            key,
            format!("holds no usable PEM private key: {e}"),
        )
    })?;
    Ok((chain, private))
}

fn load_certs(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    // Read first, so that a missing file says so rather than "no certificate".
    std::fs::metadata(path)
        .map_err(|e| TlsFileError::new(key, path, format!("cannot read: {e}")))?;
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsFileError::new(key, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(TlsFileError::new(
            key,
            path,
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(certs)
}

/// The rustls provider every client here uses: ring, as etcd-client's TLS does.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The files of `[proxy]` that configure TLS to the rail.
#[derive(Debug, Clone, Copy)]
pub struct RailTlsFiles<'a> {
    /// `proxy.upstream_ca_file`: the CA certificates the rail's certificate must chain to.
    pub ca: &'a Path,
    /// `proxy.upstream_cert_file` and `proxy.upstream_key_file`, when the rail requires a
    /// client certificate.
    pub identity: Option<(&'a Path, &'a Path)>,
}

/// The client TLS configuration `[proxy]` asks for: `None` for an `http://` upstream.
pub fn rail_tls(proxy: &ProxyConfig) -> Result<Option<Arc<ClientConfig>>, TlsFileError> {
    if !proxy.upstream.is_https() {
        return Ok(None);
    }
    let identity = (!proxy.upstream_cert_file.is_empty()).then(|| {
        (
            Path::new(&proxy.upstream_cert_file),
            Path::new(&proxy.upstream_key_file),
        )
    });
    rail_client_config(RailTlsFiles {
        ca: Path::new(&proxy.upstream_ca_file),
        identity,
    })
    .map(Some)
}

/// The client TLS configuration for the rail, read from its files.
pub fn rail_client_config(files: RailTlsFiles<'_>) -> Result<Arc<ClientConfig>, TlsFileError> {
    let roots = load_roots("proxy.upstream_ca_file", files.ca)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsFileError::new("proxy.upstream_ca_file", files.ca, e.to_string()))?
        .with_root_certificates(roots);
    let mut config = match files.identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let (chain, private) = load_identity(
                "proxy.upstream_cert_file",
                cert,
                "proxy.upstream_key_file",
                key,
            )?;
            builder.with_client_auth_cert(chain, private).map_err(|e| {
                TlsFileError::new(
                    "proxy.upstream_key_file",
                    key,
                    format!("does not go with proxy.upstream_cert_file: {e}"),
                )
            })?
        }
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Why a connection to the rail could not be made, past the TCP connect.
#[derive(Debug, thiserror::Error)]
pub enum RailConnectError {
    #[error("TLS handshake with the rail failed")]
    Handshake(#[source] std::io::Error),
    #[error("TLS handshake with the rail did not finish within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("{0:?} is not a host name a TLS certificate can be checked against")]
    ServerName(String),
    #[error("an https:// rail needs proxy.upstream_ca_file")]
    NotConfigured,
}

/// Opens connections to the rail: TCP, then TLS for `https://` URIs.
#[derive(Clone)]
pub struct RailConnector {
    http: HttpConnector,
    tls: Option<tokio_rustls::TlsConnector>,
    handshake_timeout: Duration,
}

impl RailConnector {
    /// `http` opens the TCP connections (its `enforce_http` is turned off here, as `https`
    /// URIs go through it too); `tls` is the client configuration for `https://` URIs.
    pub fn new(
        mut http: HttpConnector,
        tls: Option<Arc<ClientConfig>>,
        handshake_timeout: Duration,
    ) -> Self {
        http.enforce_http(false);
        Self {
            http,
            tls: tls.map(tokio_rustls::TlsConnector::from),
            handshake_timeout,
        }
    }
}

impl Service<Uri> for RailConnector {
    type Response = RailStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<RailStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let https = uri.scheme_str() == Some("https");
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let tls = self.tls.clone();
        let timeout = self.handshake_timeout;
        let connecting = self.http.call(uri);
        Box::pin(async move {
            if !https {
                return Ok(RailStream::Plain(connecting.await?));
            }
            let tls = tls.ok_or(RailConnectError::NotConfigured)?;
            let name = ServerName::try_from(host.clone())
                .map_err(|_| RailConnectError::ServerName(host))?;
            let tcp = connecting.await?.into_inner();
            let stream = tokio::time::timeout(timeout, tls.connect(name, tcp))
                .await
                .map_err(|_| RailConnectError::HandshakeTimeout(timeout))?
                .map_err(RailConnectError::Handshake)?;
            Ok(RailStream::Tls(Box::new(TokioIo::new(stream))))
        })
    }
}

/// A connection to the rail, in the clear or over TLS.
pub enum RailStream {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

impl Connection for RailStream {
    fn connected(&self) -> Connected {
        match self {
            RailStream::Plain(s) => s.connected(),
            RailStream::Tls(s) => s.inner().get_ref().0.connected(),
        }
    }
}

impl Read for RailStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            RailStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            RailStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl Write for RailStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            RailStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            RailStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            RailStream::Plain(s) => Pin::new(s).poll_flush(cx),
            RailStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            RailStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            RailStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            RailStream::Plain(s) => s.is_write_vectored(),
            RailStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            RailStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            RailStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_ca_file_names_the_key_and_the_file() {
        let e = rail_client_config(RailTlsFiles {
            ca: Path::new("/nonexistent/ca.pem"),
            identity: None,
        })
        .unwrap_err();
        assert_eq!(e.key, "proxy.upstream_ca_file");
        let text = e.to_string();
        assert!(
            text.starts_with("proxy.upstream_ca_file /nonexistent/ca.pem: cannot read"),
            "{text}"
        );
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let e = load_roots("proxy.upstream_ca_file", &path).unwrap_err();
        assert!(e.message.contains("holds no PEM certificate"), "{e}");
    }
}
