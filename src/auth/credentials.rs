//! The credentials file: who may call railguard, and what each caller may touch.
//!
//! It holds SHA-256 digests, never secrets, so the file can be read by anyone who can read
//! the config and still lets no one in. A secret is 32 random bytes
//! (`railguard credentials-new-secret` makes one), so a plain SHA-256 is as strong as a slow
//! hash here: there is no dictionary to try. Client certificates (mutual TLS) are named by the SHA-256 of their DER
//! encoding, as `openssl x509 -noout -fingerprint -sha256` prints it.
//!
//! ```toml
//! [[worker]]
//! name = "payments-eu"
//! secrets = ["sha256:9f86d0…"]            # bearer secrets, by digest; several while rotating
//! certificates = ["sha256:AB:CD:…"]       # client certificates, by fingerprint (optional)
//! accounts = ["acct-eu-*"]                # accounts it may pay on, through the proxy
//! keys = ["acct-eu-*"]                    # lock keys it may take (default: its accounts' keys)
//! lock_requests_per_s = 50                # its lock-API rate (default: [auth] lock_requests_per_s)
//!
//! [[operator]]
//! name = "oncall"
//! secrets = ["sha256:…"]
//! may = ["read", "write"]                 # read: metrics, marks, OpenAPI; write: forget, recover
//! ```
//!
//! An identity with no secret and no certificate (`secrets = []`) is valid and cannot
//! authenticate: that is how the only secret of an identity is revoked (remove its digest)
//! without removing the identity, or refusing the whole file.
//!
//! Workers and operators are separate: a worker credential opens nothing on the admin
//! listener, an operator credential nothing on the lock API or the proxy.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use super::pattern::Pattern;
use crate::proof::unhex;

/// A SHA-256 digest: of a bearer secret, or of a client certificate's DER.
pub type Digest = [u8; 32];

/// What an operator may do on the admin listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Permission {
    /// Metrics, `/marks` reads, the OpenAPI document.
    Read,
    /// Operator actions that change state: `/idempotency/forget`, `/recover`.
    Write,
}

/// Whom a credential names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Worker {
        accounts: Vec<Pattern>,
        keys: Vec<Pattern>,
        /// Lock-API requests per second, if the worker has its own limit.
        lock_requests_per_s: Option<u32>,
    },
    Operator {
        may: BTreeSet<Permission>,
    },
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: String,
    pub role: Role,
}

impl Identity {
    /// Whether this is a worker that may pay on `account`.
    pub fn may_pay_on(&self, account: &str) -> bool {
        matches!(&self.role, Role::Worker { accounts, .. } if super::pattern::any_matches(accounts, account))
    }

    /// Whether this is a worker that may take, renew, release or inspect `key`.
    pub fn may_lock(&self, key: &str) -> bool {
        matches!(&self.role, Role::Worker { keys, .. } if super::pattern::any_matches(keys, key))
    }

    /// Whether this is an operator with `permission`.
    pub fn may(&self, permission: Permission) -> bool {
        matches!(&self.role, Role::Operator { may } if may.contains(&permission))
    }

    pub fn is_worker(&self) -> bool {
        matches!(self.role, Role::Worker { .. })
    }
}

/// Every identity of one version of the file, indexed by credential.
#[derive(Debug, Default)]
pub struct Credentials {
    by_secret: HashMap<Digest, Arc<Identity>>,
    by_certificate: HashMap<Digest, Arc<Identity>>,
    names: Vec<String>,
}

/// Why the file was refused, naming the file and the key in it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {key}: {message}")]
pub struct CredentialsError {
    pub file: String,
    pub key: String,
    pub message: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    worker: Vec<WorkerEntry>,
    #[serde(default)]
    operator: Vec<OperatorEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerEntry {
    name: String,
    #[serde(default)]
    secrets: Vec<String>,
    #[serde(default)]
    certificates: Vec<String>,
    accounts: Vec<String>,
    keys: Option<Vec<String>>,
    lock_requests_per_s: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OperatorEntry {
    name: String,
    #[serde(default)]
    secrets: Vec<String>,
    #[serde(default)]
    certificates: Vec<String>,
    may: Vec<Permission>,
}

/// Lock keys of accounts: the `[fencing] lock_key_template` around the account id.
#[derive(Debug, Clone, Default)]
pub struct LockKeyShape {
    pub prefix: String,
    pub suffix: String,
}

impl Credentials {
    /// Reads and checks `path`.
    pub fn load(path: &Path, keys: &LockKeyShape) -> Result<Self, CredentialsError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| CredentialsError {
            file: file.clone(),
            key: "(file)".into(),
            message: format!("cannot read the credentials file: {e}"),
        })?;
        Self::parse(&text, &file, keys)
    }

    /// Parses the text of a credentials file named `file`.
    pub fn parse(text: &str, file: &str, shape: &LockKeyShape) -> Result<Self, CredentialsError> {
        let error = |key: String, message: String| CredentialsError {
            file: file.to_string(),
            key,
            message,
        };
        let table: toml::Table = toml::from_str(text)
            .map_err(|e| error("(file)".into(), format!("not valid TOML: {e}")))?;
        let parsed: File =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                let path = e.path().to_string();
                error(path, e.inner().to_string())
            })?;
        let mut credentials = Credentials::default();
        let mut names = BTreeSet::new();
        let mut add = |section: &str,
                       i: usize,
                       name: &str,
                       secrets: &[String],
                       certificates: &[String],
                       role: Role|
         -> Result<(), CredentialsError> {
            let at = |key: &str| format!("{section}[{i}].{key}");
            check_name(name).map_err(|m| error(at("name"), m))?;
            if !names.insert(name.to_string()) {
                return Err(error(
                    at("name"),
                    format!("{name:?} is named twice; names must be unique"),
                ));
            }
            let identity = Arc::new(Identity {
                name: name.to_string(),
                role,
            });
            for (j, text) in secrets.iter().enumerate() {
                let digest =
                    parse_digest(text).map_err(|m| error(at(&format!("secrets[{j}]")), m))?;
                if credentials
                    .by_secret
                    .insert(digest, identity.clone())
                    .is_some()
                {
                    return Err(error(
                        at(&format!("secrets[{j}]")),
                        "this secret is listed twice (it would name two identities)".into(),
                    ));
                }
            }
            for (j, text) in certificates.iter().enumerate() {
                let digest =
                    parse_digest(text).map_err(|m| error(at(&format!("certificates[{j}]")), m))?;
                if credentials
                    .by_certificate
                    .insert(digest, identity.clone())
                    .is_some()
                {
                    return Err(error(
                        at(&format!("certificates[{j}]")),
                        "this certificate is listed twice (it would name two identities)".into(),
                    ));
                }
            }
            credentials.names.push(name.to_string());
            Ok(())
        };
        for (i, w) in parsed.worker.iter().enumerate() {
            let at = |key: &str| format!("worker[{i}].{key}");
            let accounts =
                patterns(&w.accounts).map_err(|(j, m)| error(at(&format!("accounts[{j}]")), m))?;
            let keys = match &w.keys {
                Some(keys) => {
                    patterns(keys).map_err(|(j, m)| error(at(&format!("keys[{j}]")), m))?
                }
                None => accounts
                    .iter()
                    .map(|p| p.wrapped(&shape.prefix, &shape.suffix))
                    .collect(),
            };
            if w.lock_requests_per_s == Some(0) {
                return Err(error(
                    at("lock_requests_per_s"),
                    "must be greater than zero (remove the worker to shut it out)".into(),
                ));
            }
            add(
                "worker",
                i,
                &w.name,
                &w.secrets,
                &w.certificates,
                Role::Worker {
                    accounts,
                    keys,
                    lock_requests_per_s: w.lock_requests_per_s,
                },
            )?;
        }
        for (i, o) in parsed.operator.iter().enumerate() {
            if o.may.is_empty() {
                return Err(error(
                    format!("operator[{i}].may"),
                    "list at least one of \"read\", \"write\"".into(),
                ));
            }
            add(
                "operator",
                i,
                &o.name,
                &o.secrets,
                &o.certificates,
                Role::Operator {
                    may: o.may.iter().copied().collect(),
                },
            )?;
        }
        Ok(credentials)
    }

    /// The identity a bearer secret's digest names.
    pub fn by_secret(&self, digest: &Digest) -> Option<&Arc<Identity>> {
        self.by_secret.get(digest)
    }

    /// The identity a client certificate's fingerprint names.
    pub fn by_certificate(&self, digest: &Digest) -> Option<&Arc<Identity>> {
        self.by_certificate.get(digest)
    }

    /// The names of every identity, in file order.
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Identity names: what the lock service records as a grant's holder.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(format!("{name:?} may only hold A-Z a-z 0-9 . _ -"));
    }
    Ok(())
}

fn patterns(texts: &[String]) -> Result<Vec<Pattern>, (usize, String)> {
    if texts.is_empty() {
        return Err((0, "list at least one pattern (\"*\" for everything)".into()));
    }
    texts
        .iter()
        .enumerate()
        .map(|(j, t)| Pattern::parse(t).map_err(|m| (j, m)))
        .collect()
}

/// `sha256:` and 64 hex digits, colons between byte pairs allowed (as openssl prints them).
pub fn parse_digest(text: &str) -> Result<Digest, String> {
    let Some(hex) = text.strip_prefix("sha256:") else {
        return Err(format!(
            "expected \"sha256:\" and 64 hex digits, not {:?}",
            shorten(text)
        ));
    };
    let hex: String = hex.chars().filter(|c| *c != ':').collect();
    unhex(&hex)
        .and_then(|bytes| <Digest>::try_from(bytes).ok())
        .ok_or_else(|| {
            format!(
                "expected \"sha256:\" and 64 hex digits, not {:?}",
                shorten(text)
            )
        })
}

/// At most a few characters of a value that may be a secret pasted by mistake.
fn shorten(text: &str) -> String {
    let head: String = text.chars().take(12).collect();
    if head.len() < text.len() {
        format!("{head}…")
    } else {
        head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "sha256:00000000000000000000000000000000000000000000000000000000000000aa";
    const B: &str = "sha256:00000000000000000000000000000000000000000000000000000000000000bb";

    fn parse(text: &str) -> Result<Credentials, CredentialsError> {
        Credentials::parse(
            text,
            "creds.toml",
            &LockKeyShape {
                prefix: "locks/".into(),
                suffix: String::new(),
            },
        )
    }

    fn digest(text: &str) -> Digest {
        parse_digest(text).unwrap()
    }

    #[test]
    fn workers_and_operators_are_found_by_their_credentials() {
        let c = parse(&format!(
            "[[worker]]\nname = \"eu\"\nsecrets = [\"{A}\"]\naccounts = [\"acct-eu-*\"]\n\
             [[operator]]\nname = \"oncall\"\ncertificates = [\"{B}\"]\nmay = [\"read\"]\n"
        ))
        .unwrap();
        let eu = c.by_secret(&digest(A)).unwrap();
        assert_eq!(eu.name, "eu");
        assert!(eu.may_pay_on("acct-eu-1") && !eu.may_pay_on("acct-us-1"));
        // Keys default to the accounts' lock keys.
        assert!(eu.may_lock("locks/acct-eu-1") && !eu.may_lock("acct-eu-1"));
        assert!(!eu.may(Permission::Read));
        let oncall = c.by_certificate(&digest(B)).unwrap();
        assert!(oncall.may(Permission::Read) && !oncall.may(Permission::Write));
        assert!(!oncall.may_pay_on("acct-eu-1") && !oncall.may_lock("locks/acct-eu-1"));
        assert!(
            c.by_secret(&digest(B)).is_none(),
            "a certificate is not a secret"
        );
        assert_eq!(c.names(), ["eu", "oncall"]);
    }

    #[test]
    fn an_identity_without_secrets_or_certificates_is_kept_and_cannot_authenticate() {
        let c = parse(&format!(
            "[[worker]]\nname = \"eu\"\nsecrets = []\naccounts = [\"x\"]\n\
             [[operator]]\nname = \"oncall\"\nmay = [\"read\"]\n\
             [[worker]]\nname = \"us\"\nsecrets = [\"{A}\"]\naccounts = [\"y\"]\n"
        ))
        .unwrap();
        assert_eq!(
            c.names(),
            ["eu", "us", "oncall"],
            "workers first, then operators"
        );
        assert_eq!(c.by_secret(&digest(A)).unwrap().name, "us");
        assert!(c.by_secret(&digest(B)).is_none() && c.by_certificate(&digest(B)).is_none());
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let cases = [
            (format!("[[worker]]\nname = \"eu\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\ncolour = 1\n"), "worker[0]"),
            (format!("[[worker]]\nname = \"e u\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\n"), "worker[0].name"),
            ("[[worker]]\nname = \"eu\"\nsecrets = [\"hunter2hunter2hunter2\"]\naccounts = [\"x\"]\n".to_string(), "worker[0].secrets[0]"),
            (format!("[[worker]]\nname = \"eu\"\nsecrets = [\"{A}\"]\naccounts = []\n"), "worker[0].accounts[0]"),
            (format!("[[worker]]\nname = \"eu\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\nkeys = [\"\"]\n"), "worker[0].keys[0]"),
            (format!("[[worker]]\nname = \"a\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\n[[worker]]\nname = \"b\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\n"), "worker[1].secrets[0]"),
            (format!("[[worker]]\nname = \"a\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\n[[operator]]\nname = \"a\"\nsecrets = [\"{B}\"]\nmay = [\"read\"]\n"), "operator[0].name"),
            (format!("[[operator]]\nname = \"o\"\nsecrets = [\"{B}\"]\nmay = [\"everything\"]\n"), "operator[0].may"),
            (format!("[[operator]]\nname = \"o\"\nsecrets = [\"{B}\"]\nmay = []\n"), "operator[0].may"),
            (format!("[[worker]]\nname = \"eu\"\nsecrets = [\"{A}\"]\naccounts = [\"x\"]\nlock_requests_per_s = 0\n"), "worker[0].lock_requests_per_s"),
        ];
        for (text, key) in cases {
            let e = parse(&text)
                .err()
                .unwrap_or_else(|| panic!("accepted: {text}"));
            assert_eq!(e.file, "creds.toml");
            assert!(e.key.starts_with(key), "{key} vs {e}");
            assert!(e.to_string().starts_with("creds.toml: "), "{e}");
        }
    }

    #[test]
    fn a_pasted_secret_is_not_echoed_whole() {
        let secret = "rgs_0123456789abcdef0123456789abcdef";
        let e = parse(&format!(
            "[[worker]]\nname = \"eu\"\nsecrets = [\"{secret}\"]\naccounts = [\"x\"]\n"
        ))
        .err()
        .unwrap();
        assert!(!e.to_string().contains(secret), "{e}");
    }

    #[test]
    fn digests_take_openssl_fingerprints() {
        let colons = "sha256:AB:CD:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:01";
        let d = parse_digest(colons).unwrap();
        assert_eq!((d[0], d[1], d[31]), (0xab, 0xcd, 1));
        assert!(parse_digest("sha256:abc").is_err());
        assert!(parse_digest(&A[7..]).is_err(), "the prefix is required");
    }
}
