//! Where a command's configuration comes from, and what it reads from the process environment:
//! the config file's path, the `RAILGUARD__…` overrides, `RUST_LOG`, and the operator's bearer
//! secret.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use railguard::config::Config;
use railguard::telemetry;

/// The variable that names the config file when `--config` is not given.
const CONFIG_VAR: &str = "RAILGUARD_CONFIG";

/// Where the config file is read from when neither `--config` nor `$RAILGUARD_CONFIG` says.
const DEFAULT_CONFIG: &str = "config/railguard.toml";

/// The config file a command reads, and what named it.
pub(crate) struct ConfigPath {
    pub(crate) path: PathBuf,
    from: ConfigFrom,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ConfigFrom {
    Flag,
    Variable,
    Default,
}

/// `--config`, else `$RAILGUARD_CONFIG` (if set and not empty), else [`DEFAULT_CONFIG`].
#[allow(clippy::disallowed_methods)] // the binary reads the environment
pub(crate) fn config_path(flag: Option<PathBuf>) -> ConfigPath {
    if let Some(path) = flag {
        return ConfigPath {
            path,
            from: ConfigFrom::Flag,
        };
    }
    match std::env::var_os(CONFIG_VAR).filter(|v| !v.is_empty()) {
        Some(path) => ConfigPath {
            path: path.into(),
            from: ConfigFrom::Variable,
        },
        None => ConfigPath {
            path: DEFAULT_CONFIG.into(),
            from: ConfigFrom::Default,
        },
    }
}

/// Reads the config file with the process environment's `RAILGUARD__…` overrides; returns
/// them too (a reload applies the same ones). A bad file is said on stderr, naming the key and
/// the file (or variable): exit 2.
#[allow(clippy::disallowed_methods)] // the binary reads the environment
pub(crate) fn read(path: &ConfigPath) -> Result<(Config, BTreeMap<String, String>), ExitCode> {
    let loaded = railguard::config::overrides_from(std::env::vars_os())
        .and_then(|env| Config::load(&path.path, &env).map(|config| (config, env)));
    loaded.map_err(|e| {
        let unreadable = e.key.is_none() && e.message.starts_with("cannot read the file");
        let hint = match path.from {
            ConfigFrom::Default if unreadable => format!(
                "\nrailguard: without --config or ${CONFIG_VAR}, railguard reads \
                 {DEFAULT_CONFIG} relative to the working directory{}: run it from the \
                 repository, pass --config PATH, or set {CONFIG_VAR}=PATH",
                std::env::current_dir()
                    .map(|dir| format!(" ({})", dir.display()))
                    .unwrap_or_default()
            ),
            ConfigFrom::Variable if unreadable => {
                format!("\nrailguard: this path came from ${CONFIG_VAR}")
            }
            _ => String::new(),
        };
        eprintln!("railguard: configuration error: {e}{hint}");
        ExitCode::from(2)
    })
}

/// [`read`], then starts logging as the configuration says.
pub(crate) fn load(path: &ConfigPath) -> Result<Config, ExitCode> {
    let (config, _) = read(path)?;
    telemetry::init(config.log.format, &config.log.level, rust_log().as_deref());
    Ok(config)
}

/// `RUST_LOG`, which wins over `log.level` when set.
#[allow(clippy::disallowed_methods)] // the binary reads the environment
pub(crate) fn rust_log() -> Option<String> {
    std::env::var("RUST_LOG").ok()
}

/// `$RAILGUARD_SECRET`, if set and not empty: the bearer secret the operator commands send.
#[allow(clippy::disallowed_methods)] // the binary reads the environment
pub(crate) fn cli_secret() -> Option<String> {
    std::env::var(railguard::admin::SECRET_VAR)
        .ok()
        .filter(|s| !s.trim().is_empty())
}

/// The running railguard's admin listener, as `config` names it, with the operator's secret.
pub(crate) fn admin_endpoint(config: &Config) -> railguard::admin::AdminEndpoint {
    railguard::admin::AdminEndpoint {
        addr: config.admin.listen,
        secret: cli_secret(),
        tls: config.admin.listener.settings().tls.is_some(),
    }
}
