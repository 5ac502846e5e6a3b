//! TLS to PostgreSQL: the database URL's `sslmode` honoured with libpq's meaning, through a
//! rustls connector (ring provider).
//!
//! tokio-postgres parses `sslmode` itself but knows only `disable`, `prefer` and `require`,
//! verifies nothing on its own, and refuses `verify-ca`, `verify-full` and `sslrootcert` as
//! unknown. [`connect_config`] therefore takes `sslmode` and `sslrootcert` out of a
//! `postgres://` URL, hands tokio-postgres the rest (with `sslmode` mapped to what it knows: it
//! decides *whether* to ask for TLS), and builds a [`PgTls`] that decides what the server's
//! certificate must prove:
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `allow`, `prefer` (the default) | if the server offers it | checked against the CA if one is configured, else not |
//! | `require` | or the connection fails | checked against the CA if one is configured, else not |
//! | `verify-ca` | or the connection fails | must chain to the CA (a CA is required) |
//! | `verify-full` | or the connection fails | must chain to the CA **and** name the host (a CA is required) |
//!
//! That is libpq's table, including its rule that `require` (and `prefer`) verify the chain
//! when a root certificate is present: with a CA configured, a server that presents a
//! certificate from elsewhere is refused rather than trusted. `allow` is treated as `prefer`
//! (tokio-postgres cannot try cleartext first). Without a CA, `prefer` and `require` encrypt
//! but do not authenticate the server, as in libpq; for `require`, railguard warns of that at
//! start.
//!
//! The CA is the URL's `sslrootcert` if it has one, else `database.tls_ca_file`; `Database`
//! folds the latter into the URL ([`with_root_cert`]) so that every connection, pooled or not,
//! reads the same. `sslrootcert=system` is not supported: name a bundle file instead
//! (`/etc/ssl/certs/ca-certificates.crt`). Only the URL form is rewritten; a key-value
//! connection string (the embedded server's Unix socket) goes to tokio-postgres unchanged.
//!
//! Channel binding: the stream offers `tls-server-end-point` (RFC 5929: the hash of the
//! server's certificate with its signature's hash, SHA-256 for MD5 and SHA-1), so SCRAM
//! authentication uses `SCRAM-SHA-256-PLUS` over TLS. For a certificate whose signature has no
//! such hash (Ed25519, RSA-PSS) it offers none and SCRAM runs without channel binding.
//!
//! The client does not present a certificate to PostgreSQL (`sslcert`/`sslkey` are not
//! supported). ALPN `postgresql` is offered, as libpq 17 does, so `sslnegotiation=direct`
//! works against servers that require it.

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::verify_server_cert_signed_by_trust_anchor;
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::Digest;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

use super::client::{TlsFileError, load_roots, provider};

/// What a connection asks of TLS: `sslmode` with libpq's meaning (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// What tokio-postgres is told: whether to ask for TLS and whether it must be had.
    fn for_tokio_postgres(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow | SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
}

/// A database URL that cannot be used: not a URL tokio-postgres reads, or TLS settings that
/// cannot be honoured.
#[derive(Debug, thiserror::Error)]
pub enum PgTlsError {
    #[error("not a valid PostgreSQL URL: {0}")]
    Url(#[source] tokio_postgres::Error),
    #[error("sslmode={0:?} is not one of disable, allow, prefer, require, verify-ca, verify-full")]
    SslMode(String),
    #[error(
        "sslmode={0} verifies the server's certificate and needs a CA: set sslrootcert in the \
         URL or database.tls_ca_file"
    )]
    NeedsCa(&'static str),
    #[error(
        "sslrootcert=system is not supported: name a CA bundle file (for the public CAs, \
         /etc/ssl/certs/ca-certificates.crt)"
    )]
    SystemRoots,
    #[error("{0}")]
    File(#[from] TlsFileError),
    #[error("TLS is unavailable: {0}")]
    Provider(String),
}

/// A connection's settings and the TLS connector that goes with them.
pub struct PgConnect {
    pub config: tokio_postgres::Config,
    pub tls: PgTls,
    pub mode: SslMode,
}

/// Parses `url` into tokio-postgres settings and a [`PgTls`] that honours its `sslmode` and
/// `sslrootcert` (read now).
pub fn connect_config(url: &str) -> Result<PgConnect, PgTlsError> {
    let (rest, mode, root_cert) = split_tls_params(url)?;
    let config: tokio_postgres::Config = rest.parse().map_err(PgTlsError::Url)?;
    let mode = match mode {
        Some(mode) => mode,
        // A key-value string, or a URL without sslmode: tokio-postgres read (or defaulted) it.
        None => match config.get_ssl_mode() {
            tokio_postgres::config::SslMode::Disable => SslMode::Disable,
            tokio_postgres::config::SslMode::Require => SslMode::Require,
            _ => SslMode::Prefer,
        },
    };
    let roots = match &root_cert {
        Some(path) if path.as_os_str() == "system" => return Err(PgTlsError::SystemRoots),
        Some(path) => Some(load_roots("sslrootcert in database.url", path)?),
        None => None,
    };
    let tls = PgTls::new(mode, roots)?;
    Ok(PgConnect { config, tls, mode })
}

/// The startup `options` a database URL asks for, if it parses and asks for any (the settings
/// check refuses them: railguard sets the sessions' options itself).
pub fn options_in(url: &str) -> Option<String> {
    let (rest, _, _) = split_tls_params(url).ok()?;
    let config: tokio_postgres::Config = rest.parse().ok()?;
    config.get_options().map(str::to_string)
}

/// `url` with `sslrootcert=ca_file` added, unless it names one already or is not a
/// `postgres://` URL (a key-value string is returned unchanged).
pub fn with_root_cert(url: &str, ca_file: &Path) -> String {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !is_url || ca_file.as_os_str().is_empty() {
        return url.to_string();
    }
    let has_root = url
        .split_once('?')
        .is_some_and(|(_, query)| query.split('&').any(|p| p.starts_with("sslrootcert=")));
    if has_root {
        return url.to_string();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!(
        "{url}{separator}sslrootcert={}",
        percent_encode(&ca_file.to_string_lossy())
    )
}

/// Takes `sslmode` and `sslrootcert` out of a URL's query; other strings are left alone.
fn split_tls_params(url: &str) -> Result<(String, Option<SslMode>, Option<PathBuf>), PgTlsError> {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let Some((base, query)) = url.split_once('?').filter(|_| is_url) else {
        return Ok((url.to_string(), None, None));
    };
    let (mut mode, mut root_cert, mut kept) = (None, None, Vec::new());
    for param in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        match key {
            "sslmode" => {
                let value = percent_decode(value);
                mode = Some(SslMode::parse(&value).ok_or(PgTlsError::SslMode(value))?);
            }
            "sslrootcert" => root_cert = Some(PathBuf::from(percent_decode(value))),
            _ => kept.push(param),
        }
    }
    if let Some(mode) = mode {
        kept.push(match mode.for_tokio_postgres() {
            "disable" => "sslmode=disable",
            "prefer" => "sslmode=prefer",
            _ => "sslmode=require",
        });
    }
    let rest = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, mode, root_cert))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What is checked of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    /// Nothing but the handshake's own signatures (`prefer`/`require` without a CA).
    Nothing,
    /// It chains to the CA (`verify-ca`; `prefer`/`require` with a CA).
    Chain,
    /// It chains to the CA and names the host (`verify-full`).
    ChainAndName,
}

/// tokio-postgres's TLS connector, by rustls; see the module docs.
#[derive(Clone)]
pub struct PgTls {
    config: Arc<ClientConfig>,
    verify: Verify,
}

impl PgTls {
    /// Whether the server's certificate is checked against a CA (`false`: any certificate is
    /// accepted, as libpq's `prefer` and `require` do without a root certificate).
    pub fn authenticates_server(&self) -> bool {
        self.verify != Verify::Nothing
    }

    fn new(mode: SslMode, roots: Option<RootCertStore>) -> Result<Self, PgTlsError> {
        let provider = provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| PgTlsError::Provider(e.to_string()))?;
        let (verify, mut config) = match (mode, roots) {
            (SslMode::VerifyFull, None) => return Err(PgTlsError::NeedsCa("verify-full")),
            (SslMode::VerifyCa, None) => return Err(PgTlsError::NeedsCa("verify-ca")),
            (SslMode::VerifyFull, Some(roots)) => (
                Verify::ChainAndName,
                builder.with_root_certificates(roots).with_no_client_auth(),
            ),
            (_, Some(roots)) => {
                let verifier = AnyName {
                    roots: Some(Arc::new(roots)),
                    provider: provider.clone(),
                };
                (
                    Verify::Chain,
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(verifier))
                        .with_no_client_auth(),
                )
            }
            (_, None) => (
                Verify::Nothing,
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyName {
                        roots: None,
                        provider,
                    }))
                    .with_no_client_auth(),
            ),
        };
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            verify,
        })
    }
}

/// Checks the server's certificate without its name: that it chains to the CA (`roots`;
/// libpq's `verify-ca`, and `prefer`/`require` when a CA is configured), or nothing at all
/// (`None`: libpq's `require` without a root certificate — the session is encrypted and the
/// handshake signatures are checked, but the server is not authenticated).
#[derive(Debug)]
struct AnyName {
    roots: Option<Arc<RootCertStore>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(roots) = &self.roots else {
            return Ok(ServerCertVerified::assertion());
        };
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl<S> MakeTlsConnect<S> for PgTls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTlsStream<S>;
    type TlsConnect = PgTlsConnect;
    type Error = Infallible;

    /// Called for every connection, before tokio-postgres knows whether TLS will be used —
    /// with `""` for a Unix socket — so a name TLS cannot check fails only a handshake.
    fn make_tls_connect(&mut self, domain: &str) -> Result<PgTlsConnect, Infallible> {
        Ok(PgTlsConnect {
            connector: tokio_rustls::TlsConnector::from(self.config.clone()),
            name: ServerName::try_from(domain.to_string()).map_err(|_| domain.to_string()),
        })
    }
}

/// One connection's handshake (see [`PgTls`]).
pub struct PgTlsConnect {
    connector: tokio_rustls::TlsConnector,
    /// The server's name, or the host text that is not one.
    name: Result<ServerName<'static>, String>,
}

impl<S> TlsConnect<S> for PgTlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTlsStream<S>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<PgTlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let name = self.name.map_err(|host| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{host:?} is not a host name a TLS certificate can be checked against"),
                )
            })?;
            let stream = self.connector.connect(name, stream).await?;
            Ok(PgTlsStream(stream))
        })
    }
}

/// A TLS session with PostgreSQL.
pub struct PgTlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for PgTlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        let (_, session) = self.0.get_ref();
        match session
            .peer_certificates()
            .and_then(|certs| certs.first())
            .and_then(|cert| tls_server_end_point(cert))
        {
            Some(hash) => ChannelBinding::tls_server_end_point(hash),
            None => ChannelBinding::none(),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for PgTlsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for PgTlsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// RFC 5929 `tls-server-end-point`: the certificate hashed with its signature's hash
/// (SHA-256 for MD5 and SHA-1); `None` when the signature names no single hash.
fn tls_server_end_point(cert: &CertificateDer<'_>) -> Option<Vec<u8>> {
    let der = cert.as_ref();
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm AlgorithmIdentifier, .. }
    let (certificate, _) = der_element(der, 0x30)?;
    let (_tbs, rest) = der_element(certificate, 0x30)?;
    let (algorithm, _) = der_element(rest, 0x30)?;
    let (oid, _) = der_element(algorithm, 0x06)?;
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    enum Hash {
        Sha256,
        Sha384,
        Sha512,
    }
    let hash = match oid {
        // md5WithRSAEncryption, sha1WithRSAEncryption, sha256WithRSAEncryption
        [prefix @ .., 4 | 5 | 11] if prefix == RSA => Hash::Sha256,
        [prefix @ .., 12] if prefix == RSA => Hash::Sha384,
        [prefix @ .., 13] if prefix == RSA => Hash::Sha512,
        _ if oid == ECDSA_SHA1 => Hash::Sha256,
        [prefix @ .., 2] if prefix == ECDSA_SHA2 => Hash::Sha256,
        [prefix @ .., 3] if prefix == ECDSA_SHA2 => Hash::Sha384,
        [prefix @ .., 4] if prefix == ECDSA_SHA2 => Hash::Sha512,
        _ => return None,
    };
    Some(match hash {
        Hash::Sha256 => sha2::Sha256::digest(der).to_vec(),
        Hash::Sha384 => sha2::Sha384::digest(der).to_vec(),
        Hash::Sha512 => sha2::Sha512::digest(der).to_vec(),
    })
}

/// The contents of the DER element at the start of `input` if its tag is `tag`, and what
/// follows it.
fn der_element(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&found, rest) = input.split_first()?;
    if found != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let (bytes, rest) = rest.split_at(count);
        let len = bytes
            .iter()
            .fold(0usize, |len, &b| (len << 8) | usize::from(b));
        (len, rest)
    };
    if rest.len() < len {
        return None;
    }
    Some(rest.split_at(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_modes_are_taken_out_of_the_url_and_mapped() {
        let (rest, mode, root) = split_tls_params(
            "postgres://u@db:5432/d?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20x.pem",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u@db:5432/d?application_name=x&sslmode=require"
        );
        assert_eq!(mode, Some(SslMode::VerifyFull));
        assert_eq!(root, Some(PathBuf::from("/etc/ca x.pem")));
        let (rest, mode, _) = split_tls_params("postgres://u@db/d?sslmode=allow").unwrap();
        assert_eq!(
            (rest.as_str(), mode),
            ("postgres://u@db/d?sslmode=prefer", Some(SslMode::Allow))
        );
        let (rest, mode, root) = split_tls_params("host=/tmp port=5 sslmode=disable").unwrap();
        assert_eq!(
            (rest.as_str(), mode, root),
            ("host=/tmp port=5 sslmode=disable", None, None)
        );
        assert!(matches!(
            split_tls_params("postgres://db/d?sslmode=verify"),
            Err(PgTlsError::SslMode(m)) if m == "verify"
        ));
    }

    #[test]
    fn verifying_modes_need_a_ca() {
        for (url, mode) in [
            ("postgres://db/d?sslmode=verify-full", "verify-full"),
            ("postgres://db/d?sslmode=verify-ca", "verify-ca"),
        ] {
            let e = connect_config(url).err().expect("refused");
            assert!(matches!(e, PgTlsError::NeedsCa(m) if m == mode), "{e}");
            assert!(e.to_string().contains("database.tls_ca_file"), "{e}");
        }
        assert!(matches!(
            connect_config("postgres://db/d?sslmode=verify-full&sslrootcert=system"),
            Err(PgTlsError::SystemRoots)
        ));
        let e = connect_config("postgres://db/d?sslmode=require&sslrootcert=/nonexistent.pem")
            .err()
            .expect("refused");
        assert!(
            e.to_string()
                .starts_with("sslrootcert in database.url /nonexistent.pem: cannot read"),
            "{e}"
        );
    }

    #[test]
    fn the_default_is_prefer_and_unverified_without_a_ca() {
        let c = connect_config("postgres://u@127.0.0.1:5/d").unwrap();
        assert_eq!(c.mode, SslMode::Prefer);
        assert!(!c.tls.authenticates_server());
        let c = connect_config("postgres://u@127.0.0.1:5/d?sslmode=disable").unwrap();
        assert_eq!(
            c.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        let c =
            connect_config("postgres://u@127.0.0.1:5/d?sslmode=verify-ca&sslmode=require").unwrap();
        assert_eq!(c.mode, SslMode::Require, "the last one wins, as in libpq");
    }

    #[test]
    fn the_config_ca_is_added_to_urls_that_have_none() {
        let ca = Path::new("/etc/rg/ca.pem");
        assert_eq!(
            with_root_cert("postgres://db/d", ca),
            "postgres://db/d?sslrootcert=/etc/rg/ca.pem"
        );
        assert_eq!(
            with_root_cert("postgres://db/d?sslmode=verify-full", ca),
            "postgres://db/d?sslmode=verify-full&sslrootcert=/etc/rg/ca.pem"
        );
        assert_eq!(
            with_root_cert("postgres://db/d?sslrootcert=/a.pem", ca),
            "postgres://db/d?sslrootcert=/a.pem"
        );
        assert_eq!(
            with_root_cert("postgres://db/d", Path::new("")),
            "postgres://db/d"
        );
        assert_eq!(
            with_root_cert("host=/run dbname=d", ca),
            "host=/run dbname=d"
        );
    }

    #[test]
    fn der_lengths_are_bounded() {
        assert_eq!(
            der_element(&[0x30, 0x02, 1, 2, 3], 0x30),
            Some((&[1u8, 2][..], &[3u8][..]))
        );
        assert_eq!(der_element(&[0x30, 0x05, 1], 0x30), None);
        assert_eq!(der_element(&[0x30, 0x85, 1, 1, 1, 1, 1], 0x30), None);
        assert_eq!(der_element(&[0x31, 0x00], 0x30), None);
        assert_eq!(
            tls_server_end_point(&CertificateDer::from(vec![0x30, 0x00])),
            None
        );
    }
}
