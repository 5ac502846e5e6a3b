//! `[rail_lookup]`: asking the rail, by idempotency key, whether it made a payment railguard
//! left in doubt (`proxy::idempotency::resolve`). Off until `path` is set.
//!
//! `path` is a path and query on the rail (`proxy.upstream`, with its TLS settings) in which
//! `{account}` and `{key}` stand for the payment's account and idempotency key, both
//! percent-encoded: `/payments?account={account}&idempotency_key={key}` is the rail
//! simulator's. The rail must answer `200` with the payment's answer when it has a payment
//! with that key on that account, `404` when it has none; anything else is no answer.

use std::time::Duration;

use http::uri::PathAndQuery;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Invalid;
use super::values::millis;

/// `[rail_lookup]`; see the module docs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RailLookupConfig {
    /// The lookup's path and query, `{account}` and `{key}` in it; empty: no lookup.
    pub path: LookupPath,
    /// The longest one lookup may take (and never past the retry's own deadline).
    #[serde(rename = "timeout_ms", with = "millis")]
    pub timeout: Duration,
    /// Lookups at once; a retry that finds them all busy is answered as without a lookup.
    pub max_concurrent: usize,
}

impl Default for RailLookupConfig {
    fn default() -> Self {
        Self {
            path: LookupPath(None),
            timeout: Duration::from_millis(2000),
            max_concurrent: 16,
        }
    }
}

impl RailLookupConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(60) {
            return Err((
                "rail_lookup.timeout_ms",
                "must be between 1 and 60000".into(),
            ));
        }
        if !(1..=1024).contains(&self.max_concurrent) {
            return Err((
                "rail_lookup.max_concurrent",
                "must be between 1 and 1024".into(),
            ));
        }
        Ok(())
    }

    /// The lookup's template, if one is configured.
    pub fn template(&self) -> Option<&LookupTemplate> {
        self.path.0.as_ref()
    }
}

/// `rail_lookup.path`: a [`LookupTemplate`], or none (the empty string).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LookupPath(pub Option<LookupTemplate>);

impl Serialize for LookupPath {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.as_ref().map_or("", |t| t.text.as_str()))
    }
}

impl<'de> Deserialize<'de> for LookupPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text.is_empty() {
            return Ok(Self(None));
        }
        LookupTemplate::parse(&text)
            .map(|t| Self(Some(t)))
            .map_err(D::Error::custom)
    }
}

/// A lookup's path and query with `{account}` and `{key}` to fill in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupTemplate {
    text: String,
}

/// What may fill a placeholder: the unreserved characters of RFC 3986, everything else
/// percent-encoded.
fn percent_encoded(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl LookupTemplate {
    /// Checks `text`: an origin-form path and query, starting with `/`, with `{account}` and
    /// `{key}` each at least once and no other `{…}`, that makes a valid path and query once
    /// they are filled in.
    pub fn parse(text: &str) -> Result<Self, String> {
        if !text.starts_with('/') {
            return Err(format!(
                "{text:?} must be a path on the rail, starting with /"
            ));
        }
        let mut rest = text;
        let (mut account, mut key) = (false, false);
        while let Some(open) = rest.find('{') {
            let after = &rest[open + 1..];
            let Some(close) = after.find('}') else {
                return Err(format!("{text:?} has a {{ without its }}"));
            };
            match &after[..close] {
                "account" => account = true,
                "key" => key = true,
                other => {
                    return Err(format!(
                        "{text:?} names {{{other}}}; only {{account}} and {{key}} are filled in"
                    ));
                }
            }
            rest = &after[close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("{text:?} has a }} without its {{"));
        }
        if !(account && key) {
            return Err(format!(
                "{text:?} must contain both {{account}} and {{key}}: idempotency keys are \
                 scoped per account"
            ));
        }
        let template = Self {
            text: text.to_string(),
        };
        template
            .fill("acct-1", "key-1")
            .map_err(|e| format!("{text:?} is not a valid path and query: {e}"))?;
        Ok(template)
    }

    /// The lookup of `key` on `account`, both percent-encoded.
    pub fn fill(&self, account: &str, key: &str) -> Result<PathAndQuery, http::uri::InvalidUri> {
        let filled = self
            .text
            .replace("{account}", &percent_encoded(account))
            .replace("{key}", &percent_encoded(key));
        PathAndQuery::try_from(filled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_fills_in_percent_encoded_values() {
        let t = LookupTemplate::parse("/payments?account={account}&idempotency_key={key}").unwrap();
        assert_eq!(
            t.fill("acct 1", "k&y=1+/").unwrap().as_str(),
            "/payments?account=acct%201&idempotency_key=k%26y%3D1%2B%2F"
        );
        let t = LookupTemplate::parse("/accounts/{account}/payments/{key}").unwrap();
        assert_eq!(t.fill("a", "b").unwrap().as_str(), "/accounts/a/payments/b");
    }

    #[test]
    fn a_bad_template_is_refused_with_the_reason() {
        for (text, why) in [
            ("payments?k={key}&a={account}", "starting with /"),
            ("/payments?k={key}", "both {account} and {key}"),
            ("/payments?a={account}", "both {account} and {key}"),
            ("/p?a={account}&k={key}&x={other}", "names {other}"),
            ("/p?a={account}&k={key", "without its }"),
            ("/p?a={account}&k={key}}", "} without its {"),
            ("/p a?a={account}&k={key}", "not a valid path and query"),
        ] {
            let error = LookupTemplate::parse(text).unwrap_err();
            assert!(error.contains(why), "{text}: {error}");
        }
    }

    #[test]
    fn off_by_default_and_checked_when_set() {
        let config = RailLookupConfig::default();
        assert!(config.template().is_none());
        assert_eq!(config.validate(), Ok(()));
        let zero = RailLookupConfig {
            max_concurrent: 0,
            ..RailLookupConfig::default()
        };
        assert_eq!(zero.validate().unwrap_err().0, "rail_lookup.max_concurrent");
        let slow = RailLookupConfig {
            timeout: Duration::ZERO,
            ..RailLookupConfig::default()
        };
        assert_eq!(slow.validate().unwrap_err().0, "rail_lookup.timeout_ms");
    }
}
