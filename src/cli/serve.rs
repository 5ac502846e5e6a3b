//! `railguard serve`.

use std::path::PathBuf;
use std::process::ExitCode;

use railguard::{server, telemetry};

use super::config::{config_path, read, rust_log};

/// Run the rail proxy, the lock API and the admin listener until stopped.
///
/// The proxy forwards a worker's payment to the rail only if its fencing token passes the
/// account's high-water mark; the lock API grants leases with fencing tokens (and answers
/// `railguard inspect`); the admin listener serves health, metrics and the operator commands.
///
/// SIGHUP reloads the credentials file, the listeners' TLS files and `log.level`, and logs by
/// name every other changed key as needing a restart; it never stops railguard. SIGTERM or
/// SIGINT drains the requests in flight, then exits.
///
/// Every config key can be overridden as RAILGUARD__SECTION__KEY, e.g.
/// RAILGUARD__PROXY__LISTEN=0.0.0.0:8080.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// TOML config file (see config/railguard.toml for every key, commented). Default:
    /// $RAILGUARD_CONFIG, else config/railguard.toml in the working directory.
    #[arg(long, short)]
    config: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> ExitCode {
    // The configuration is read before the runtime starts: `runtime.worker_threads` decides
    // how the runtime is built.
    let path = config_path(args.config);
    let (config, env) = match read(&path) {
        Ok(read) => read,
        Err(code) => return code,
    };
    let log = telemetry::init(config.log.format, &config.log.level, rust_log().as_deref());
    super::runtime::run(config.runtime.worker_threads, async move {
        // Installed before binding, so that a signal during start-up is not lost, and a SIGHUP
        // then never ends the process.
        let shutdown = server::shutdown_signal();
        let reload = railguard::reload::Reload {
            path: path.path,
            env,
            log,
            requests: server::hangup_requests(),
        };
        let listeners = match server::Listeners::bind(&config).await {
            Ok(l) => l,
            Err(e) => {
                let origin = bind_origin(&e, &reload.path, &reload.env);
                return super::fail_logged(&format_args!("{e}{origin}"));
            }
        };
        match server::run_reloading(listeners, config, shutdown, Some(reload)).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => super::fail_logged(&e),
        }
    })
}

/// Where the address of a listener that could not bind was set: the environment variable that
/// overrode its key, or else the config file (the key's default when the file leaves it out).
fn bind_origin(
    error: &server::ServeError,
    path: &std::path::Path,
    env: &std::collections::BTreeMap<String, String>,
) -> String {
    let server::ServeError::Bind { key, .. } = error else {
        return String::new();
    };
    let var = format!(
        "{}{}",
        railguard::config::ENV_PREFIX,
        key.replace('.', "__").to_uppercase()
    );
    // Variable names are matched whatever their case, as the configuration reads them.
    if let Some(set) = env.keys().find(|name| name.eq_ignore_ascii_case(&var)) {
        format!("; set by the environment variable {set}")
    } else {
        format!("; config file {}", path.display())
    }
}
