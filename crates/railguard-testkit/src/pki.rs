//! A private certificate authority for tests, made with the `openssl` command line.
//!
//! TLS tests need certificates no public CA vouches for: a server certificate for the rail,
//! PostgreSQL or a railguard listener, and client certificates for mutual TLS. [`Pki::new`]
//! makes a fresh CA in a temp dir; [`Pki::server`] and [`Pki::client`] issue leaf certificates
//! signed by it. Keys are ECDSA P-256 (fast to make, accepted by rustls and PostgreSQL). A
//! second, unrelated [`Pki`] is how a test makes a certificate the first CA does not trust.

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Issued {
    /// The certificate's PEM text.
    pub fn cert_pem(&self) -> String {
        std::fs::read_to_string(&self.cert).expect("read certificate")
    }

    /// The hex SHA-256 of the certificate's DER encoding (its fingerprint).
    pub fn fingerprint_sha256(&self) -> String {
        let out = openssl(&[
            "x509",
            "-in",
            path_str(&self.cert),
            "-noout",
            "-fingerprint",
            "-sha256",
        ]);
        // "sha256 Fingerprint=AB:CD:..."
        let text = String::from_utf8(out).expect("utf-8");
        let (_, hex) = text.trim().split_once('=').expect("fingerprint line");
        hex.replace(':', "").to_ascii_lowercase()
    }
}

/// A throwaway certificate authority.
pub struct Pki {
    dir: TempDir,
    /// The CA's certificate, the file clients and servers trust.
    pub ca: PathBuf,
    ca_key: PathBuf,
    serial: std::cell::Cell<u32>,
}

impl Pki {
    /// A new CA named `railguard test CA`.
    pub fn new() -> Pki {
        let dir = tempfile::Builder::new()
            .prefix("railguard-pki-")
            .tempdir()
            .expect("temp dir");
        let ca = dir.path().join("ca.pem");
        let ca_key = dir.path().join("ca.key");
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=railguard test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            path_str(&ca_key),
            "-out",
            path_str(&ca),
        ]);
        Pki {
            dir,
            ca,
            ca_key,
            serial: std::cell::Cell::new(1),
        }
    }

    /// The CA certificate's PEM text.
    pub fn ca_pem(&self) -> String {
        std::fs::read_to_string(&self.ca).expect("read CA")
    }

    /// A server certificate for `localhost` and `127.0.0.1`, named `name` in the files.
    pub fn server(&self, name: &str) -> Issued {
        self.issue(
            name,
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n\
             basicConstraints=critical,CA:FALSE\n",
        )
    }

    /// A server certificate for `dns` only (not `localhost`, not `127.0.0.1`): a server whose
    /// certificate, from the right CA, names another host.
    pub fn server_for(&self, name: &str, dns: &str) -> Issued {
        self.issue(
            name,
            &format!(
                "subjectAltName=DNS:{dns}\nextendedKeyUsage=serverAuth\n\
                 basicConstraints=critical,CA:FALSE\n"
            ),
        )
    }

    /// A client certificate whose subject CN is `name`.
    pub fn client(&self, name: &str) -> Issued {
        self.issue(
            name,
            "extendedKeyUsage=clientAuth\nbasicConstraints=critical,CA:FALSE\n",
        )
    }

    fn issue(&self, name: &str, extensions: &str) -> Issued {
        let serial = self.serial.get();
        self.serial.set(serial + 1);
        let stem = format!("{name}-{serial}");
        let key = self.dir.path().join(format!("{stem}.key"));
        let csr = self.dir.path().join(format!("{stem}.csr"));
        let cert = self.dir.path().join(format!("{stem}.pem"));
        let ext = self.dir.path().join(format!("{stem}.ext"));
        std::fs::write(&ext, extensions).expect("write extensions");
        openssl(&[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            path_str(&key),
            "-out",
            path_str(&csr),
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            path_str(&csr),
            "-CA",
            path_str(&self.ca),
            "-CAkey",
            path_str(&self.ca_key),
            "-set_serial",
            &serial.to_string(),
            "-days",
            "2",
            "-extfile",
            path_str(&ext),
            "-out",
            path_str(&cert),
        ]);
        Issued { cert, key }
    }

    /// The directory the files live in (removed when the `Pki` is dropped).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

fn openssl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("run openssl (Debian package openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issues_certificates_that_verify_against_the_ca_and_not_another() {
        let pki = Pki::new();
        let server = pki.server("rail");
        let client = pki.client("worker-eu");
        let other = Pki::new();
        for leaf in [&server, &client] {
            let ok = Command::new("openssl")
                .args(["verify", "-CAfile", path_str(&pki.ca), path_str(&leaf.cert)])
                .output()
                .unwrap();
            assert!(
                ok.status.success(),
                "{}",
                String::from_utf8_lossy(&ok.stderr)
            );
            let refused = Command::new("openssl")
                .args([
                    "verify",
                    "-CAfile",
                    path_str(&other.ca),
                    path_str(&leaf.cert),
                ])
                .output()
                .unwrap();
            assert!(!refused.status.success());
        }
        let fp = client.fingerprint_sha256();
        assert_eq!(fp.len(), 64);
        assert_ne!(fp, server.fingerprint_sha256());
        assert!(server.cert_pem().contains("BEGIN CERTIFICATE"));
    }
}
