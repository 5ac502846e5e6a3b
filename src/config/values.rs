//! Typed values of the configuration: each is parsed once, when the file is read, into the
//! type its user needs, so that nothing downstream parses a config string again.
//!
//! Each keeps the wire form the file has always had (a header as a string, a duration as
//! integer milliseconds or seconds, a URL as a string), so the shipped `config/railguard.toml`
//! and every `RAILGUARD__…` override read the same as before.

use std::fmt;
use std::time::Duration;

use http::HeaderName;
use http::uri::{Authority, Scheme};
use railguard_sdk::wire::LockKey;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `#[serde(with = "millis")]`: a [`Duration`] written as integer milliseconds.
pub(crate) mod millis {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

/// `#[serde(with = "secs")]`: a [`Duration`] written as integer seconds.
pub(crate) mod secs {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_secs)
    }
}

/// `#[serde(with = "header")]`: an HTTP header name written as a string.
pub(crate) mod header {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(h: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(h.as_str())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<HeaderName, D::Error> {
        let text = String::deserialize(d)?;
        HeaderName::from_bytes(text.as_bytes())
            .map_err(|_| D::Error::custom(format!("{text:?} is not a valid HTTP header name")))
    }
}

/// Where the rail is: `http://host:port` or `https://host:port` (TLS verified against
/// `proxy.upstream_ca_file`), no path (request paths are appended).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub scheme: Scheme,
    pub authority: Authority,
}

impl Upstream {
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Err(
                "must be set: the rail's URL, http://host:port or https://host:port \
                        (RAILGUARD__PROXY__UPSTREAM in the environment sets it too)"
                    .into(),
            );
        }
        let uri: http::Uri = text.parse().map_err(|e| format!("not a URL: {e}"))?;
        let scheme = match uri.scheme_str() {
            Some("http") => Scheme::HTTP,
            Some("https") => Scheme::HTTPS,
            _ => return Err("must be an http://host:port or https://host:port URL".into()),
        };
        let Some(authority) = uri.authority().cloned() else {
            return Err("must be an http://host:port or https://host:port URL".into());
        };
        if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
            return Err("must not have a path or query".into());
        }
        if authority.as_str().contains('@') {
            return Err("must not carry credentials".into());
        }
        Ok(Self { scheme, authority })
    }
}

impl Upstream {
    /// Whether the rail is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.scheme == Scheme::HTTPS
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority)
    }
}

impl Serialize for Upstream {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Upstream {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Upstream::parse(&text).map_err(D::Error::custom)
    }
}

/// Where the database is: `embedded` (a private PostgreSQL in `database.data_dir`) or a
/// `postgres://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseUrl {
    Embedded,
    Postgres(String),
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatabaseUrl::Embedded => f.write_str("embedded"),
            DatabaseUrl::Postgres(url) => f.write_str(url),
        }
    }
}

impl Serialize for DatabaseUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DatabaseUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text == "embedded" {
            Ok(DatabaseUrl::Embedded)
        } else if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            Ok(DatabaseUrl::Postgres(text))
        } else {
            Err(D::Error::custom(
                "must be \"embedded\" or a postgres:// URL",
            ))
        }
    }
}

/// Where grants and their tokens live (`lock.backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockBackendKind {
    /// The `[database]`; tokens from the sequence `fencing_token_seq`.
    Postgres,
    /// The `[etcd]` cluster; a token is the lock key's ModRevision at grant time.
    Etcd,
}

impl LockBackendKind {
    /// The `backend` label of the lock metrics.
    pub fn name(self) -> &'static str {
        match self {
            LockBackendKind::Postgres => "postgres",
            LockBackendKind::Etcd => "etcd",
        }
    }
}

/// Where a rail's request path names its account (`fencing.account_in_path`, e.g.
/// `/accounts/{account}/`): the proxy then forwards a request only if its path names the
/// account it is fenced on, so a grant of one account never carries a payment of another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountPathTemplate {
    prefix: String,
    suffix: String,
}

impl AccountPathTemplate {
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.matches("{account}").count() != 1 {
            return Err("must contain `{account}` exactly once".into());
        }
        let (prefix, suffix) = text.split_once("{account}").expect("counted above");
        if !prefix.starts_with('/') {
            return Err("must start with `/` (it is matched against the request path)".into());
        }
        if prefix.contains('?') || suffix.contains('?') {
            return Err("matches the path only: no `?`".into());
        }
        Ok(Self {
            prefix: prefix.into(),
            suffix: suffix.into(),
        })
    }

    /// Whether `path` (without its query) names `account` where the template says. The path
    /// is compared as sent: a percent-encoded account does not match. A path the rail (or
    /// anything in between) could resolve to another one names no account: a dot segment
    /// (`.`, `..`, percent-encoded, or before a `;` parameter), a backslash or an encoded
    /// `/` or `\` anywhere; so does an account that is a dot segment or holds a separator.
    pub fn names(&self, path: &str, account: &str) -> bool {
        if !plain_segment(account) || !resolves_to_itself(path) {
            return false;
        }
        let Some(rest) = path
            .strip_prefix(self.prefix.as_str())
            .and_then(|rest| rest.strip_prefix(account))
        else {
            return false;
        };
        if self.suffix.is_empty() {
            rest.is_empty() || rest.starts_with('/')
        } else {
            rest.starts_with(self.suffix.as_str())
        }
    }
}

/// Whether `text` is one path segment that no server resolves away: not `.` or `..` (in any
/// spelling) and without `/`, `\\` or `%`.
fn plain_segment(text: &str) -> bool {
    !text.contains(['/', '\\', '%', ';', '?', '#']) && !dot_segment(text)
}

/// Whether `path` has no dot segment, backslash or percent-encoded `/` or `\\`, so that
/// normalising it (RFC 3986 §5.2.4, or a server's own habits) cannot change it. The same
/// holds for the path decoded once, twice, … (a server that decodes again sees `%252e` as
/// `%2e`, then `.`), and every decoding must be valid UTF-8: an overlong form such as
/// `%c0%ae` (a `.` to a lax decoder) names no account.
fn resolves_to_itself(path: &str) -> bool {
    /// Past this many rounds of decoding, a path still changing is refused.
    const ROUNDS: usize = 4;
    let mut current = path.to_string();
    for _ in 0..ROUNDS {
        let lower = current.to_ascii_lowercase();
        if lower.contains('\\')
            || lower.contains("%2f")
            || lower.contains("%5c")
            || lower.split('/').any(dot_segment)
        {
            return false;
        }
        let decoded = crate::http::percent_decode(&current);
        if decoded == current.as_bytes() {
            return true;
        }
        match String::from_utf8(decoded) {
            Ok(text) => current = text,
            Err(_) => return false,
        }
    }
    false
}

/// `.` or `..`, also as `%2e`, and also with a `;` parameter after it (`..;`).
fn dot_segment(segment: &str) -> bool {
    let segment = segment.split(';').next().unwrap_or_default();
    let decoded = segment.to_ascii_lowercase().replace("%2e", ".");
    decoded == "." || decoded == ".."
}

impl fmt::Display for AccountPathTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{{account}}{}", self.prefix, self.suffix)
    }
}

impl Serialize for AccountPathTemplate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for AccountPathTemplate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        AccountPathTemplate::parse(&text).map_err(D::Error::custom)
    }
}

/// `fencing.account_in_path`: `""` is off.
pub(crate) mod account_path {
    use super::AccountPathTemplate;
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub(crate) fn serialize<S: Serializer>(
        value: &Option<AccountPathTemplate>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(template) => s.collect_str(template),
            None => s.serialize_str(""),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<AccountPathTemplate>, D::Error> {
        let text = String::deserialize(d)?;
        if text.is_empty() {
            return Ok(None);
        }
        AccountPathTemplate::parse(&text)
            .map(Some)
            .map_err(D::Error::custom)
    }
}

/// The lock key whose grants fence an account: the template with `{account}` in it once,
/// kept as the text around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockKeyTemplate {
    prefix: String,
    suffix: String,
}

impl LockKeyTemplate {
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.matches("{account}").count() != 1 {
            return Err("must contain `{account}` exactly once".into());
        }
        let (prefix, suffix) = text.split_once("{account}").expect("counted above");
        LockKey::parse(&format!("{prefix}a{suffix}"))
            .map_err(|e| format!("does not make a valid lock key: {e}"))?;
        Ok(Self {
            prefix: prefix.into(),
            suffix: suffix.into(),
        })
    }

    /// The text before `{account}`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The text after `{account}`.
    pub fn suffix(&self) -> &str {
        &self.suffix
    }
}

impl Default for LockKeyTemplate {
    fn default() -> Self {
        Self::parse("{account}").expect("the default template is valid")
    }
}

impl fmt::Display for LockKeyTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{{account}}{}", self.prefix, self.suffix)
    }
}

impl Serialize for LockKeyTemplate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for LockKeyTemplate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        LockKeyTemplate::parse(&text).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_account_path_template_matches_the_account_where_it_says() {
        let t = AccountPathTemplate::parse("/accounts/{account}/").unwrap();
        assert!(t.names("/accounts/acct-1/payments", "acct-1"));
        assert!(!t.names("/accounts/acct-12/payments", "acct-1"));
        assert!(
            !t.names("/accounts/acct-1", "acct-1"),
            "the suffix is required"
        );
        assert!(!t.names("/accounts/acct-us-1/payments", "acct-1"));
        assert!(!t.names("/x/accounts/acct-1/payments", "acct-1"));
        assert!(!t.names("/accounts/acct%2D1/payments", "acct-1"));
        let open = AccountPathTemplate::parse("/pay/{account}").unwrap();
        assert!(open.names("/pay/a", "a") && open.names("/pay/a/1", "a"));
        assert!(!open.names("/pay/ab", "a"), "an account is a whole segment");
        for bad in [
            "accounts/{account}",
            "/a/{account}/{account}",
            "/a/b",
            "/a?x={account}",
        ] {
            assert!(AccountPathTemplate::parse(bad).is_err(), "{bad}");
        }
    }

    // Dot segments after the account are resolved by the rail, or any server or proxy in
    // between (RFC 3986 §5.2.4): a path compared as sent would carry a payment to another
    // account past the check, `/accounts/acct-1/../acct-2/payments`.
    #[test]
    fn an_account_path_with_dot_segments_or_encoded_separators_names_no_account() {
        let t = AccountPathTemplate::parse("/accounts/{account}/").unwrap();
        let open = AccountPathTemplate::parse("/pay/{account}").unwrap();
        for path in [
            "/accounts/acct-1/../acct-2/payments",
            "/accounts/acct-1/./../acct-2/payments",
            "/accounts/acct-1/%2e%2e/acct-2/payments",
            "/accounts/acct-1/%2E./acct-2/payments",
            "/accounts/acct-1/..;/acct-2/payments",
            "/accounts/acct-1/x/../../acct-2/payments",
            "/accounts/acct-1/..%2facct-2/payments",
            "/accounts/acct-1/%2F..%2Facct-2/payments",
            "/accounts/acct-1/..\\acct-2/payments",
            "/accounts/acct-1/.",
            "/accounts/acct-1/%252e%252e/acct-2/payments",
            "/accounts/acct-1/%25252E%25252e/acct-2/payments",
            "/accounts/acct-1/..%252facct-2/payments",
            "/accounts/acct-1/%c0%ae%c0%ae/acct-2/payments",
            "/accounts/acct-1/..%c0%afacct-2/payments",
            "/accounts/acct-1/%e0%80%ae%e0%80%ae/acct-2/payments",
            "/accounts/acct-1/%ff/payments",
        ] {
            assert!(!t.names(path, "acct-1"), "{path}");
        }
        // Encoded characters that decode to themselves, or to valid UTF-8, are fine.
        assert!(t.names("/accounts/acct-1/caf%C3%A9/100%25/x%2", "acct-1"));
        assert!(!open.names("/pay/acct-1/../acct-2", "acct-1"));
        assert!(!open.names("/pay/acct-1/..", "acct-1"));
        // An account that is itself a dot segment or holds a separator names nothing.
        assert!(!open.names("/pay/../admin", ".."));
        assert!(!t.names("/accounts/a/../b/payments", "a/../b"));
        assert!(!t.names("/accounts/a%2fb/payments", "a%2fb"));
        // Dots inside a segment are ordinary characters.
        assert!(t.names("/accounts/acct-1/pay.v2/..x/", "acct-1"));
        assert!(t.names("/accounts/acct.1/payments", "acct.1"));
    }

    #[test]
    fn upstream_is_http_or_https_host_port_only() {
        let up = Upstream::parse("http://127.0.0.1:9090").unwrap();
        assert_eq!(up.to_string(), "http://127.0.0.1:9090");
        assert!(!up.is_https());
        assert!(Upstream::parse("http://rail:1/").is_ok());
        let up = Upstream::parse("https://rail:443").unwrap();
        assert!(up.is_https());
        assert_eq!(up.to_string(), "https://rail:443");
        assert!(Upstream::parse("ftp://rail:21").is_err());
        assert!(Upstream::parse("https://user:pw@rail:443").is_err());
        assert!(Upstream::parse("http://rail:1/pay").is_err());
        assert!(Upstream::parse("http:///x").is_err());
        assert!(Upstream::parse("nowhere").is_err());
    }

    #[test]
    fn lock_key_templates_keep_the_text_around_the_account() {
        let t = LockKeyTemplate::parse("pay:{account}:v1").unwrap();
        assert_eq!((t.prefix(), t.suffix()), ("pay:", ":v1"));
        assert_eq!(t.to_string(), "pay:{account}:v1");
        assert!(LockKeyTemplate::parse("acct").is_err());
        assert!(LockKeyTemplate::parse("{account}{account}").is_err());
        assert!(LockKeyTemplate::parse("a/{account}").is_err());
    }
}
