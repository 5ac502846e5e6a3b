//! The effective configuration, as `railguard check-config --print` shows it (the habit of
//! `nginx -T`): every key with the value railguard runs with and where that value came from —
//! the file (and its key), a `RAILGUARD__SECTION__KEY` variable, or the default.
//!
//! The output is a TOML document that reads back as the same configuration: each key on one
//! line, its source as a trailing comment. Secrets are not printed: a password in any URL
//! (`database.url`'s user info, and a `password` or `sslpassword` query parameter) is shown as
//! [`REDACTED`], and the comment says so; put the real value back before using the output as
//! a config file. No other key holds a secret: the credentials file, which holds the digests
//! of the bearer secrets, is named by its path and not read here.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use super::load::{Origins, parse_with_origins, read_file};
use super::{Config, ConfigError};

/// What a redacted secret is shown as.
pub const REDACTED: &str = "<redacted>";

/// Where a key's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The config file, which names the key.
    File(String),
    /// The environment variable named, which overrode the file.
    Environment(String),
    /// Neither: the key's default.
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(file) => write!(f, "file {file}"),
            Source::Environment(var) => write!(f, "environment variable {var}"),
            Source::Default => f.write_str("default"),
        }
    }
}

/// A configuration with the source of each of its keys.
#[derive(Debug, Clone)]
pub struct Effective {
    pub config: Config,
    file: String,
    origins: Origins,
}

impl Effective {
    /// [`Config::load`], keeping where each key was set.
    pub fn load(path: &Path, env: &BTreeMap<String, String>) -> Result<Self, ConfigError> {
        let text = read_file(path)?;
        Self::parse(&text, &path.display().to_string(), env)
    }

    /// What `railguard check-config --print` prints: the file at `path` with the
    /// `RAILGUARD__…` variables of `vars` (the process environment, as `main` read it), as
    /// [`Effective::to_toml`] writes it.
    pub fn render(
        path: &Path,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    ) -> Result<String, ConfigError> {
        let env = super::overrides_from(vars)?;
        Self::load(path, &env)?.to_toml()
    }

    /// [`Config::parse`], keeping where each key was set.
    pub fn parse(
        text: &str,
        file: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Self, ConfigError> {
        let (config, origins) = parse_with_origins(text, file, env)?;
        Ok(Self {
            config,
            file: file.to_string(),
            origins,
        })
    }

    /// Where the value of `key` (dotted: `proxy.listen`) came from.
    pub fn source(&self, key: &str) -> Source {
        if let Some(var) = self.origins.from_env.get(key) {
            Source::Environment(var.clone())
        } else if self.origins.in_file.contains(key) {
            Source::File(self.file.clone())
        } else {
            Source::Default
        }
    }

    /// The configuration as a TOML document: every section and key in the order of
    /// `config/railguard.toml`, each value followed by a comment naming its source, secrets
    /// redacted.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        let table = toml::Table::try_from(&self.config).map_err(|e| ConfigError {
            origin: self.file.clone(),
            key: None,
            message: format!("cannot be written back as TOML: {e}"),
        })?;
        let overrides = self.origins.from_env.len();
        let mut out = format!(
            "# The effective configuration: {} with {overrides} override{} from the \
             environment.\n\
             # After each key, where its value came from. Secrets are shown as \"{REDACTED}\":\n\
             # put them back before using this as a config file.\n",
            self.file,
            if overrides == 1 { "" } else { "s" },
        );
        for (section, keys) in &table {
            let Some(keys) = keys.as_table() else {
                continue;
            };
            let _ = write!(out, "\n[{section}]\n");
            for (key, value) in keys {
                let dotted = format!("{section}.{key}");
                let (value, redacted) = redact(value);
                let mut comment = match self.source(&dotted) {
                    Source::File(file) => format!("{file}: {dotted}"),
                    other => other.to_string(),
                };
                if redacted {
                    comment.push_str(" (password redacted)");
                }
                let _ = writeln!(out, "{key} = {}  # {comment}", inline(&value));
            }
        }
        Ok(out)
    }
}

/// `value` with the password of every URL in it replaced by [`REDACTED`], and whether any was.
fn redact(value: &toml::Value) -> (toml::Value, bool) {
    match value {
        toml::Value::String(text) => match redact_url(text) {
            Some(redacted) => (toml::Value::String(redacted), true),
            None => (value.clone(), false),
        },
        toml::Value::Array(items) => {
            let mut any = false;
            let items = items
                .iter()
                .map(|item| {
                    let (item, redacted) = redact(item);
                    any |= redacted;
                    item
                })
                .collect();
            (toml::Value::Array(items), any)
        }
        _ => (value.clone(), false),
    }
}

/// The URL `text` with its password redacted, or `None` if it is not a URL or has none. The
/// password is the user info after its first `:`; the user info ends at the last `@` before
/// the path (libpq reads up to the first `@`, so this redacts at least as much). A query
/// parameter whose name ends in `password` (`password`, `sslpassword`) is a password too.
fn redact_url(text: &str) -> Option<String> {
    let (scheme, rest) = text.split_once("://")?;
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let mut redacted = false;
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => {
                redacted = true;
                format!("{user}:{REDACTED}@{host}")
            }
            None => authority.to_string(),
        },
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((name, _)) if name.to_ascii_lowercase().ends_with("password") => {
                        redacted = true;
                        format!("{name}={REDACTED}")
                    }
                    _ => param.to_string(),
                })
                .collect();
            format!("{path}?{}", params.join("&"))
        }
        None => tail.to_string(),
    };
    redacted.then(|| format!("{scheme}://{authority}{tail}"))
}

/// `value` as TOML on one line: strings as basic strings with every control character
/// escaped, arrays inline.
fn inline(value: &toml::Value) -> String {
    match value {
        toml::Value::String(text) => {
            let mut out = String::with_capacity(text.len() + 2);
            out.push('"');
            for c in text.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\t' => out.push_str("\\t"),
                    '\r' => out.push_str("\\r"),
                    c if c.is_control() => {
                        let _ = write!(out, "\\u{:04X}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
            out
        }
        toml::Value::Array(items) => {
            let items: Vec<String> = items.iter().map(inline).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn effective(text: &str, env: &[(&str, &str)]) -> Effective {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Effective::parse(text, "rg.toml", &env).unwrap()
    }

    #[test]
    fn each_key_names_the_file_the_variable_or_the_default() {
        let e = effective(
            "[proxy]\nlisten = \"127.0.0.1:1\"\nmax_connections = 5\n[log]\nlevel = \"warn\"\n",
            &[("RAILGUARD__LOG__LEVEL", "debug")],
        );
        assert_eq!(e.source("proxy.listen"), Source::File("rg.toml".into()));
        assert_eq!(
            e.source("proxy.max_connections"),
            Source::File("rg.toml".into())
        );
        assert_eq!(
            e.source("log.level"),
            Source::Environment("RAILGUARD__LOG__LEVEL".into())
        );
        assert_eq!(e.source("admin.listen"), Source::Default);
        let text = e.to_toml().unwrap();
        assert!(
            text.contains("\nlisten = \"127.0.0.1:1\"  # rg.toml: proxy.listen\n"),
            "{text}"
        );
        assert!(
            text.contains("\nlevel = \"debug\"  # environment variable RAILGUARD__LOG__LEVEL\n"),
            "{text}"
        );
        assert!(
            text.contains("\nlisten = \"127.0.0.1:9100\"  # default\n"),
            "{text}"
        );
    }

    #[test]
    fn every_key_is_printed_once_in_the_shipped_order_and_reads_back_the_same() {
        let e = effective(
            "[etcd]\nendpoints = [\"http://a:2379\", \"http://b:2379\"]\n\
             [fencing]\naccount_in_path = \"/accounts/{account}/\"\n",
            &[("RAILGUARD__PROXY__MAX_BODY_BYTES", "77")],
        );
        let text = e.to_toml().unwrap();
        let back = Config::parse(&text, "printed.toml", &BTreeMap::new()).unwrap();
        assert_eq!(back, e.config);
        let keys = |text: &str| -> Vec<String> {
            let mut section = String::new();
            let mut keys = Vec::new();
            for line in text.lines() {
                if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                    section = name.to_string();
                } else if let Some((key, _)) = line.split_once(" = ")
                    && !line.starts_with('#')
                {
                    keys.push(format!("{section}.{}", key.trim()));
                }
            }
            keys
        };
        let shipped = keys(include_str!("../../config/railguard.toml"));
        assert_eq!(keys(&text), shipped);
    }

    #[test]
    fn a_password_is_never_printed() {
        let e = effective(
            "[database]\nurl = \"postgres://rg:hunter2@db:5432/rg?sslmode=require&sslpassword=keypw\"\n",
            &[],
        );
        let text = e.to_toml().unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(!text.contains("keypw"), "{text}");
        assert!(
            text.contains(
                "url = \"postgres://rg:<redacted>@db:5432/rg?sslmode=require&sslpassword=<redacted>\"  \
                 # rg.toml: database.url (password redacted)\n"
            ),
            "{text}"
        );
        let e = effective(
            "",
            &[(
                "RAILGUARD__DATABASE__URL",
                "postgresql://rg@db/rg?password=s3cret",
            )],
        );
        let text = e.to_toml().unwrap();
        assert!(!text.contains("s3cret"), "{text}");
        assert!(text.contains("password=<redacted>"), "{text}");
    }

    #[test]
    fn urls_without_a_password_are_left_alone() {
        assert_eq!(redact_url("postgres://rg@db/rg?sslmode=require"), None);
        assert_eq!(redact_url("http://127.0.0.1:9090"), None);
        assert_eq!(redact_url("embedded"), None);
        assert_eq!(
            redact_url("postgres://u:p@ss@h1,h2/db").as_deref(),
            Some("postgres://u:<redacted>@h1,h2/db")
        );
    }

    #[test]
    fn strings_stay_on_one_line() {
        let value = toml::Value::String("a\"b\\c\nd\u{7}".into());
        let line = inline(&value);
        assert_eq!(line, "\"a\\\"b\\\\c\\nd\\u0007\"");
        let back: toml::Table = toml::from_str(&format!("k = {line}")).unwrap();
        assert_eq!(back["k"], value);
    }
}
