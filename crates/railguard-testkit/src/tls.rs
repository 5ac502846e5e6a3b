//! A TLS client for railguard's TLS listeners: trusts one CA, optionally presents a client
//! certificate, and sends one HTTP/1.1 request per connection, so that each request is a new
//! handshake (which is what certificate reloads and client-certificate checks act on).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::Issued;

/// What one request over a fresh TLS connection saw.
#[derive(Debug)]
pub struct TlsReply {
    pub status: StatusCode,
    pub body: String,
    /// The hex SHA-256 of the certificate the server presented.
    pub server_cert_sha256: String,
    /// The protocol agreed by ALPN, if any.
    pub alpn: Option<Vec<u8>>,
}

impl TlsReply {
    /// Fails the test, showing the body, unless the status is `status`.
    #[track_caller]
    pub fn assert_status(&self, status: StatusCode) {
        assert_eq!(self.status, status, "{}", self.body);
    }
}

/// A client trusting `ca` only.
#[derive(Clone)]
pub struct TlsClient {
    connector: TlsConnector,
}

impl TlsClient {
    /// Trusts the CA certificate in the PEM file `ca`; presents `client` if given. Offers
    /// `http/1.1` by ALPN.
    pub fn new(ca: &std::path::Path, client: Option<&Issued>) -> TlsClient {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca).expect("read CA") {
            roots.add(cert.expect("CA PEM")).expect("CA certificate");
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots);
        let mut config = match client {
            Some(issued) => {
                let chain = CertificateDer::pem_file_iter(&issued.cert)
                    .expect("read client certificate")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("client certificate PEM");
                let key = PrivateKeyDer::from_pem_file(&issued.key).expect("client key");
                builder
                    .with_client_auth_cert(chain, key)
                    .expect("client certificate and key")
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        TlsClient {
            connector: TlsConnector::from(Arc::new(config)),
        }
    }

    /// `GET path` over a new connection to `addr` (checked as `localhost`). An `Err` says
    /// where it failed: the handshake, or the request (TLS 1.3 tells a client that its
    /// certificate was refused only after its side of the handshake is done, so such a
    /// refusal surfaces as the request failing with the server's alert).
    pub async fn get(&self, addr: SocketAddr, path: &str) -> Result<TlsReply, String> {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from("localhost").expect("a DNS name");
        let stream = self
            .connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let (_, session) = stream.get_ref();
        let server_cert_sha256 = session
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| hex(&railguard::tls::server::fingerprint(cert)))
            .unwrap_or_default();
        let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
                .await
                .map_err(|e| format!("request: {e}"))?;
        tokio::spawn(connection);
        let request = Request::get(path)
            .header("host", "localhost")
            .body(Empty::new())
            .expect("request");
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("request: {e:?}"))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok(TlsReply {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
            server_cert_sha256,
            alpn,
        })
    }
}

/// Lowercase hex, as [`Issued::fingerprint_sha256`] writes it.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
