//! Reading a configuration: the file's text, then the `RAILGUARD__SECTION__KEY` overrides of
//! the environment, then each section's checks. Every error names the key and the file or
//! variable its value came from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::Config;

/// Prefix of environment variables that override config keys: `RAILGUARD__PROXY__LISTEN`.
pub const ENV_PREFIX: &str = "RAILGUARD__";

/// Where the keys of a parsed configuration were set: those the file names, and those an
/// environment variable overrode (dotted key → variable). Every other key has its default.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Origins {
    pub(super) in_file: BTreeSet<String>,
    pub(super) from_env: BTreeMap<String, String>,
}

impl Config {
    /// Reads and parses `path`, applying the `RAILGUARD__…` overrides found in `env` (the
    /// process environment, as `main` read it).
    pub fn load(path: &Path, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        let text = read_file(path)?;
        Config::parse(&text, &path.display().to_string(), env)
    }

    /// Parses `text` (named `file` in errors), then applies every `RAILGUARD__SECTION__KEY`
    /// variable of `env`, then validates.
    pub fn parse(
        text: &str,
        file: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigError> {
        parse_with_origins(text, file, env).map(|(config, _)| config)
    }
}

/// The text of the config file at `path`.
pub(super) fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        origin: path.display().to_string(),
        key: None,
        message: format!("cannot read the file: {e}"),
    })
}

/// [`Config::parse`], telling also which keys the file set and which the environment did.
pub(super) fn parse_with_origins(
    text: &str,
    file: &str,
    env: &BTreeMap<String, String>,
) -> Result<(Config, Origins), ConfigError> {
    let file_error = |key: Option<String>, message: String| ConfigError {
        origin: file.to_string(),
        key,
        message,
    };
    let mut table: toml::Table =
        toml::from_str(text).map_err(|e| file_error(None, e.to_string()))?;
    let in_file = table
        .iter()
        .flat_map(|(section, value)| {
            let keys = value
                .as_table()
                .map(|t| t.keys().collect())
                .unwrap_or(Vec::new());
            keys.into_iter().map(move |key| format!("{section}.{key}"))
        })
        .collect();

    let overridden = apply_env(&mut table, env)?;
    // The error of a key the environment set names the variable; any other, the file.
    let error = |key: String, message: String| match overridden.get(&key) {
        Some(var) => ConfigError {
            origin: format!("environment variable {var}"),
            key: Some(key),
            message,
        },
        None => file_error((key != ".").then_some(key), message),
    };

    let config: Config = serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| error(e.path().to_string(), e.inner().to_string()))?;
    config
        .validate()
        .map_err(|(key, message)| error(key.to_string(), message))?;
    let origins = Origins {
        in_file,
        from_env: overridden,
    };
    Ok((config, origins))
}

/// The `RAILGUARD__…` variables of an environment, as `main` hands them to [`Config::load`]:
/// a variable that claims to be ours must be readable text.
pub fn overrides_from(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut env = BTreeMap::new();
    for (name, value) in vars {
        // Variables that are not UTF-8 cannot be ours unless their name says so.
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(ENV_PREFIX) {
            continue;
        }
        let value = value.into_string().map_err(|_| ConfigError {
            origin: format!("environment variable {name}"),
            key: None,
            message: "value is not valid UTF-8".into(),
        })?;
        env.insert(name.to_string(), value);
    }
    Ok(env)
}

/// Applies `RAILGUARD__SECTION__KEY` overrides to `table`, typed by the default value of the
/// key. Returns, for every overridden key (`section.key`), the name of the variable that set it.
fn apply_env(
    table: &mut toml::Table,
    env: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
    let mut overridden = BTreeMap::new();
    for (var, raw) in env {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let env_error = |key: Option<String>, message: String| ConfigError {
            origin: format!("environment variable {var}"),
            key,
            message,
        };
        let mut parts = rest.split("__");
        let (Some(section), Some(key), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(env_error(None, "expected RAILGUARD__SECTION__KEY".into()));
        };
        let (section, key) = (section.to_ascii_lowercase(), key.to_ascii_lowercase());
        let dotted = format!("{section}.{key}");
        let Some(default) = defaults.get(&section).and_then(|s| s.get(&key)) else {
            return Err(env_error(Some(dotted), "unknown key".into()));
        };
        let value = match default {
            toml::Value::Integer(_) => raw
                .trim()
                .parse::<i64>()
                .map(toml::Value::Integer)
                .map_err(|_| {
                    env_error(Some(dotted.clone()), format!("{raw:?} is not an integer"))
                })?,
            toml::Value::Boolean(_) => match raw.trim() {
                "true" => toml::Value::Boolean(true),
                "false" => toml::Value::Boolean(false),
                _ => {
                    return Err(env_error(
                        Some(dotted),
                        format!("{raw:?} is not a boolean (true or false)"),
                    ));
                }
            },
            toml::Value::Array(_) => toml::Value::Array(
                raw.split(',')
                    .map(|s| toml::Value::String(s.trim().to_string()))
                    .collect(),
            ),
            _ => toml::Value::String(raw.clone()),
        };
        let section_table = table
            .entry(section.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(section_table) = section_table else {
            return Err(env_error(
                Some(section),
                "the file's value here is not a table".into(),
            ));
        };
        section_table.insert(key, value);
        overridden.insert(dotted, var.clone());
    }
    Ok(overridden)
}

/// A configuration problem, with the key and where its value came from.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{origin}: {}{message}", key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
pub struct ConfigError {
    /// The file, or the environment variable, that supplied the bad value.
    pub origin: String,
    /// Dotted key (`proxy.listen`), when the problem is one key.
    pub key: Option<String>,
    pub message: String,
}

/// `text` as the file `test.toml`, with `env` as its environment: the config tests' reader.
#[cfg(test)]
pub(crate) fn parse_for_test(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let env: BTreeMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::parse(text, "test.toml", &env)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::HeaderName;

    use super::*;
    use crate::config::{DatabaseUrl, LockBackendKind};

    use super::parse_for_test as parse;

    #[test]
    fn unknown_key_names_the_key_and_file() {
        let err = parse("[proxy]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n", &[]).unwrap_err();
        assert_eq!(err.origin, "test.toml");
        assert!(err.to_string().contains("lisen"), "{err}");
        assert!(err.to_string().contains("proxy"), "{err}");
    }

    #[test]
    fn unknown_section_is_rejected() {
        let err = parse("[proxi]\nlisten = 1\n", &[]).unwrap_err();
        assert!(err.to_string().contains("proxi"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key() {
        let err = parse("[proxy]\nlisten = \"nowhere\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.listen"));
        assert!(
            err.to_string().starts_with("test.toml: key `proxy.listen`"),
            "{err}"
        );
    }

    #[test]
    fn env_overrides_file_with_typed_values() {
        let config = parse(
            "[proxy]\nlisten = \"127.0.0.1:1\"\n",
            &[
                ("RAILGUARD__PROXY__LISTEN", "127.0.0.1:8081"),
                ("RAILGUARD__FENCING__ENFORCE", "false"),
                ("RAILGUARD__DATABASE__POOL_SIZE", "4"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(config.proxy.listen, "127.0.0.1:8081".parse().unwrap());
        assert!(!config.fencing.enforce);
        assert_eq!(config.database.pool_size, 4);
    }

    #[test]
    fn values_are_typed_when_read() {
        let config = parse(
            "[proxy]\ntoken_header = \"X-Token\"\nrequest_timeout_ms = 1500\n\
             [lock]\nbackend = \"etcd\"\n[database]\nurl = \"postgres://rg@db/rg\"\n",
            &[("RAILGUARD__IDEMPOTENCY__RETENTION_SECS", "60")],
        )
        .unwrap();
        assert_eq!(
            config.proxy.token_header,
            HeaderName::from_static("x-token")
        );
        assert_eq!(config.proxy.request_timeout, Duration::from_millis(1500));
        assert_eq!(config.lock.backend, LockBackendKind::Etcd);
        assert_eq!(
            config.database.url,
            DatabaseUrl::Postgres("postgres://rg@db/rg".into())
        );
        assert_eq!(config.idempotency.retention, Duration::from_secs(60));
        let err = parse("[lock]\nbackend = \"zookeeper\"\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("lock.backend"));
    }

    #[test]
    fn only_variables_that_claim_to_be_ours_must_be_text() {
        use std::os::unix::ffi::OsStringExt;
        let junk = std::ffi::OsString::from_vec(vec![0xff]);
        let env = overrides_from([
            ("PATH".into(), "/bin".into()),
            ("OTHER".into(), junk.clone()),
            ("RAILGUARD__PROXY__LISTEN".into(), "127.0.0.1:1".into()),
        ])
        .unwrap();
        assert_eq!(env.len(), 1);
        let err = overrides_from([("RAILGUARD__PROXY__LISTEN".into(), junk)]).unwrap_err();
        assert!(err.origin.contains("RAILGUARD__PROXY__LISTEN"), "{err}");
    }

    #[test]
    fn env_errors_name_the_variable_and_key() {
        let err = parse("", &[("RAILGUARD__DATABASE__POOL_SIZE", "many")]).unwrap_err();
        assert_eq!(
            err.origin,
            "environment variable RAILGUARD__DATABASE__POOL_SIZE"
        );
        assert_eq!(err.key.as_deref(), Some("database.pool_size"));

        let err = parse("", &[("RAILGUARD__PROXY__LISTEN", "nowhere")]).unwrap_err();
        assert_eq!(err.origin, "environment variable RAILGUARD__PROXY__LISTEN");

        let err = parse("", &[("RAILGUARD__PROXY__NOPE", "1")]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.nope"));
        assert!(err.message.contains("unknown key"));

        let err = parse("", &[("RAILGUARD__FENCING__ENFORCE", "yes")]).unwrap_err();
        assert!(err.message.contains("boolean"));
    }

    #[test]
    fn negative_numbers_are_rejected_with_the_key() {
        let err = parse("[proxy]\nrequest_timeout_ms = -1\n", &[]).unwrap_err();
        assert_eq!(err.key.as_deref(), Some("proxy.request_timeout_ms"));
    }

    #[test]
    fn malformed_toml_names_the_file() {
        let err = parse("[proxy\n", &[]).unwrap_err();
        assert_eq!(err.origin, "test.toml");
    }
}
