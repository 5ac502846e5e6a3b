//! A TLS-terminating front for a plain TCP server (the rail simulator): what a test puts
//! before a [`Rail`](crate::Rail) to make it an `https://` rail with a certificate from a
//! [`Pki`](crate::Pki), optionally requiring a client certificate from a CA.
//!
//! Each accepted connection is handshaken with rustls (ring, ALPN `http/1.1`) and then
//! relayed byte for byte to the backend over a fresh TCP connection; the backend is connected
//! only after a handshake succeeded, so a refused handshake never reaches it. The front counts
//! handshakes that failed and keeps the SHA-256 fingerprint of every client certificate it
//! accepted.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::Digest;
use tokio::net::{TcpListener, TcpStream};

use crate::Issued;

pub struct TlsFront {
    pub addr: SocketAddr,
    failed: Arc<AtomicU64>,
    client_certs: Arc<Mutex<Vec<String>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Serves TLS with `server`'s certificate on a free loopback port, relaying to `backend`.
    /// With `client_ca`, a client certificate from that CA is required.
    pub async fn start(backend: SocketAddr, server: &Issued, client_ca: Option<&Path>) -> TlsFront {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&server.cert)
            .expect("read the server certificate")
            .collect::<Result<_, _>>()
            .expect("PEM certificate");
        let key = PrivateKeyDer::from_pem_file(&server.key).expect("PEM server key");
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("protocol versions");
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca).expect("read the client CA") {
                    roots.add(cert.expect("PEM CA")).expect("a CA certificate");
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .expect("client verifier");
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .expect("the key goes with the certificate");
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind TLS front");
        let addr = listener.local_addr().expect("local addr");
        let failed = Arc::new(AtomicU64::new(0));
        let client_certs = Arc::new(Mutex::new(Vec::new()));
        let (shared_failed, shared_certs) = (failed.clone(), client_certs.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let (failed, certs) = (shared_failed.clone(), shared_certs.clone());
                tokio::spawn(async move {
                    let mut tls = match acceptor.accept(client).await {
                        Ok(tls) => tls,
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                    if let Some(cert) = tls.get_ref().1.peer_certificates().and_then(|c| c.first())
                    {
                        let hex: String = sha2::Sha256::digest(cert.as_ref())
                            .iter()
                            .map(|b| format!("{b:02x}"))
                            .collect();
                        certs.lock().unwrap_or_else(|p| p.into_inner()).push(hex);
                    }
                    let Ok(mut upstream) = TcpStream::connect(backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
                });
            }
        });
        TlsFront {
            addr,
            failed,
            client_certs,
            accept,
        }
    }

    /// `https://127.0.0.1:PORT` (the [`Pki`](crate::Pki)'s server certificates name
    /// `127.0.0.1` as well as `localhost`).
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Handshakes refused so far (by either side).
    pub fn failed_handshakes(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Hex SHA-256 fingerprints of the client certificates accepted, one per connection.
    pub fn client_certs(&self) -> Vec<String> {
        self.client_certs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
