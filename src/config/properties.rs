//! Properties of the loader over generated files and environments (the fuzz target
//! `config_loader` checks the same on arbitrary text).

use proptest::prelude::*;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::*;

/// Some keys of every type, with values the loader must accept.
#[derive(Debug, Clone)]
struct Values {
    listen_port: u16,
    max_body_bytes: u64,
    request_timeout_ms: u64,
    token_header: String,
    backend: &'static str,
    enforce: bool,
    pool_size: u64,
    retention_secs: u64,
    level: &'static str,
}

fn values() -> impl Strategy<Value = Values> {
    (
        (1..=u16::MAX, 1..=i64::MAX as u64, 1..=i64::MAX as u64),
        "x-[a-z0-9-]{1,20}",
        prop::sample::select(vec!["postgres", "etcd"]),
        (any::<bool>(), 4..=1024u64, 1..=i64::MAX as u64),
        prop::sample::select(vec!["info", "warn", "railguard=debug,info", "off"]),
    )
        .prop_map(
            |(
                (listen_port, max_body_bytes, request_timeout_ms),
                token_header,
                backend,
                b,
                level,
            )| {
                Values {
                    listen_port,
                    max_body_bytes,
                    request_timeout_ms,
                    token_header,
                    backend,
                    enforce: b.0,
                    pool_size: b.1,
                    retention_secs: b.2,
                    level,
                }
            },
        )
}

/// Each value as (section, key, TOML text, environment text).
fn entries(v: &Values) -> Vec<(&'static str, &'static str, String, String)> {
    let listen = format!("127.0.0.2:{}", v.listen_port);
    vec![
        ("proxy", "listen", format!("{listen:?}"), listen),
        (
            "proxy",
            "max_body_bytes",
            v.max_body_bytes.to_string(),
            v.max_body_bytes.to_string(),
        ),
        (
            "proxy",
            "request_timeout_ms",
            v.request_timeout_ms.to_string(),
            v.request_timeout_ms.to_string(),
        ),
        (
            "proxy",
            "token_header",
            format!("{:?}", v.token_header),
            v.token_header.clone(),
        ),
        (
            "lock",
            "backend",
            format!("{:?}", v.backend),
            v.backend.to_string(),
        ),
        (
            "fencing",
            "enforce",
            v.enforce.to_string(),
            v.enforce.to_string(),
        ),
        (
            "database",
            "pool_size",
            v.pool_size.to_string(),
            v.pool_size.to_string(),
        ),
        (
            "idempotency",
            "retention_secs",
            v.retention_secs.to_string(),
            v.retention_secs.to_string(),
        ),
        (
            "log",
            "level",
            format!("{:?}", v.level),
            v.level.to_string(),
        ),
    ]
}

/// The file and environment that set `v`, each entry from the file or the environment
/// as `from_env` says.
fn sources(v: &Values, from_env: &[bool]) -> (String, BTreeMap<String, String>) {
    let mut sections: BTreeMap<&str, String> = BTreeMap::new();
    let mut env = BTreeMap::new();
    for ((section, key, toml, raw), env_wins) in entries(v).into_iter().zip(from_env) {
        if *env_wins {
            let var = format!(
                "{ENV_PREFIX}{}__{}",
                section.to_uppercase(),
                key.to_uppercase()
            );
            env.insert(var, raw);
        } else {
            sections
                .entry(section)
                .or_default()
                .push_str(&format!("{key} = {toml}\n"));
        }
    }
    let text = sections
        .iter()
        .map(|(s, body)| format!("[{s}]\n{body}"))
        .collect();
    (text, env)
}

fn known(section: &str, key: &str) -> bool {
    let defaults = toml::Table::try_from(Config::default()).unwrap();
    defaults.get(section).and_then(|s| s.get(key)).is_some()
}

fn section() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "proxy",
        "admin",
        "database",
        "fencing",
        "log",
        "shutdown",
        "lock",
        "idempotency",
        "etcd",
        "guard",
    ])
}

proptest! {
    #[test]
    fn a_generated_valid_config_parses_to_the_generated_values(
        v in values(),
        from_env in prop::collection::vec(any::<bool>(), 9),
    ) {
        let (text, env) = sources(&v, &from_env);
        let config = Config::parse(&text, "gen.toml", &env)
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}{env:?}")))?;
        prop_assert_eq!(config.proxy.listen, SocketAddr::from(([127, 0, 0, 2], v.listen_port)));
        prop_assert_eq!(config.proxy.max_body_bytes, v.max_body_bytes);
        prop_assert_eq!(config.proxy.request_timeout, Duration::from_millis(v.request_timeout_ms));
        prop_assert_eq!(config.proxy.token_header.as_str(), v.token_header.as_str());
        prop_assert_eq!(config.lock.backend.name(), v.backend);
        prop_assert_eq!(config.fencing.enforce, v.enforce);
        prop_assert_eq!(config.database.pool_size as u64, v.pool_size);
        prop_assert_eq!(config.idempotency.retention, Duration::from_secs(v.retention_secs));
        prop_assert_eq!(config.log.level.as_str(), v.level);
        // What was not set keeps its default.
        prop_assert_eq!(&config.admin, &AdminConfig::default());
        // And the config writes back to a file that reads the same.
        let written = toml::to_string(&config).unwrap();
        prop_assert_eq!(Config::parse(&written, "w.toml", &BTreeMap::new()), Ok(config));
    }

    #[test]
    fn each_generated_key_is_shown_as_coming_from_where_it_was_set(
        v in values(),
        from_env in prop::collection::vec(any::<bool>(), 9),
    ) {
        let (text, env) = sources(&v, &from_env);
        let effective = Effective::parse(&text, "gen.toml", &env)
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}{env:?}")))?;
        for ((section, key, _, _), env_wins) in entries(&v).into_iter().zip(&from_env) {
            let expected = if *env_wins {
                Source::Environment(format!(
                    "{ENV_PREFIX}{}__{}",
                    section.to_uppercase(),
                    key.to_uppercase()
                ))
            } else {
                Source::File("gen.toml".into())
            };
            prop_assert_eq!(effective.source(&format!("{section}.{key}")), expected);
        }
        prop_assert_eq!(effective.source("admin.listen"), Source::Default);
        // What --print writes reads back as the same configuration.
        let printed = effective.to_toml().unwrap();
        prop_assert_eq!(
            Config::parse(&printed, "printed.toml", &BTreeMap::new()),
            Ok(effective.config)
        );
    }

    #[test]
    fn an_unknown_key_in_the_file_is_an_error_naming_the_key_and_the_file(
        section in section(),
        key in "[a-z][a-z_]{0,15}",
    ) {
        prop_assume!(!known(section, &key));
        let text = format!("[{section}]\n{key} = 1\n");
        let error = Config::parse(&text, "deploy/rg.toml", &BTreeMap::new()).unwrap_err();
        let (shown, named) = (error.to_string(), format!("`{key}`"));
        prop_assert_eq!(error.origin.as_str(), "deploy/rg.toml");
        prop_assert!(shown.contains(&named), "{}", shown);
        prop_assert!(shown.contains(section), "{}", shown);
    }

    #[test]
    fn an_unknown_key_in_the_environment_is_an_error_naming_the_key_and_the_variable(
        section in section(),
        key in "[a-z][a-z_]{0,15}".prop_filter("one key", |k| !k.contains("__")),
    ) {
        prop_assume!(!known(section, &key));
        let var = format!("{ENV_PREFIX}{}__{}", section.to_uppercase(), key.to_uppercase());
        let env = BTreeMap::from([(var.clone(), "1".to_string())]);
        let error = Config::parse("", "rg.toml", &env).unwrap_err();
        prop_assert_eq!(error.origin, format!("environment variable {var}"));
        prop_assert_eq!(error.key, Some(format!("{section}.{key}")));
    }

    #[test]
    fn an_integer_key_refuses_any_text_that_is_not_an_integer(
        raw in "[^0-9]{1,10}".prop_filter("not an integer", |r| r.trim().parse::<i64>().is_err()),
    ) {
        let env = BTreeMap::from([(format!("{ENV_PREFIX}PROXY__MAX_BODY_BYTES"), raw)]);
        let error = Config::parse("", "rg.toml", &env).unwrap_err();
        prop_assert_eq!(error.key.as_deref(), Some("proxy.max_body_bytes"));
    }
}
