//! `railguard check-config`.

use std::path::PathBuf;
use std::process::ExitCode;

use railguard::config::{Config, DatabaseUrl};

use super::config::{config_path, load};

/// Check a config file without starting anything, as `nginx -t` does.
///
/// Reads the file, the RAILGUARD__… overrides in the environment, and the files the
/// configuration names (the credentials file, the rail's and the database's TLS files), and
/// connects to nothing. Exit 0 with a one-line summary of what railguard would do (and any
/// warnings on stderr), or 2 naming the key and the file (or variable) that is wrong.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The TOML config file to check. Default: $RAILGUARD_CONFIG, else config/railguard.toml
    /// in the working directory.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Also print the effective configuration, as `nginx -T` does: every key with its value
    /// and, in a comment, where it came from (the file, a RAILGUARD__… variable, or the
    /// default); passwords redacted. The output is TOML; the summary line follows it as a
    /// comment.
    #[arg(long)]
    print: bool,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let path = config_path(args.config);
    let config = match load(&path) {
        Ok(config) => config,
        Err(code) => return code,
    };
    let file = path.path.display();
    match tls_files(&config).and_then(|()| check_credentials(&config)) {
        Ok(identities) => {
            for (key, why) in config.warnings() {
                eprintln!("railguard: warning: {file}: {key}: {why}");
            }
            let ok = format!("{file}: ok — {}{identities}", summary(&config));
            if args.print {
                return print_effective(&path.path, &ok);
            }
            println!("{ok}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("railguard: configuration error: {file}: {e}");
            ExitCode::from(2)
        }
    }
}

/// What a config makes railguard do, in one line (no credentials: the database URL is not
/// printed).
fn summary(config: &Config) -> String {
    let database = match &config.database.url {
        DatabaseUrl::Embedded => {
            format!(
                "embedded PostgreSQL in {}",
                config.database.data_dir.display()
            )
        }
        DatabaseUrl::Postgres(_) => "PostgreSQL by URL".to_string(),
    };
    format!(
        "proxy {} → {}, lock API {} ({} backend), admin {}, database: {database}, fencing {}",
        config.proxy.listen,
        config.proxy.upstream,
        config.lock.listen,
        config.lock.backend.name(),
        config.admin.listen,
        if config.fencing.enforce {
            "enforced"
        } else {
            "OFF (kill switch)"
        }
    )
}

/// Reads the credentials file, if there is one: what `check-config` adds to its summary.
fn check_credentials(config: &Config) -> Result<String, String> {
    if !config.auth.enabled() {
        return Ok(", authentication off".into());
    }
    let template = &config.fencing.lock_key_template;
    let shape = railguard::auth::LockKeyShape {
        prefix: template.prefix().to_string(),
        suffix: template.suffix().to_string(),
    };
    let credentials = railguard::auth::Credentials::load(&config.auth.credentials_file, &shape)
        .map_err(|e| format!("auth.credentials_file: {e}"))?;
    Ok(format!(", {} identities", credentials.names().len()))
}

/// Reads the TLS files the config names (the rail's; the database URL's `sslmode` and CA), as
/// `serve` will, without connecting to anything.
fn tls_files(config: &Config) -> Result<(), String> {
    railguard::tls::client::rail_tls(&config.proxy).map_err(|e| e.to_string())?;
    if let DatabaseUrl::Postgres(_) = &config.database.url {
        railguard::tls::postgres::connect_config(&railguard::db::url_of(&config.database))
            .map_err(|e| format!("database.url: {e}"))?;
    }
    Ok(())
}

/// `--print`: the effective configuration as TOML, each key's source in a comment, then the
/// summary line as a comment.
#[allow(clippy::disallowed_methods)] // the binary reads the environment
fn print_effective(path: &std::path::Path, ok: &str) -> ExitCode {
    let text = match railguard::config::Effective::render(path, std::env::vars_os()) {
        Ok(text) => format!("{text}\n# {ok}\n"),
        Err(e) => {
            eprintln!("railguard: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    // A reader that stops early (`| head`) is not an error.
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => super::fail(&e),
        _ => ExitCode::SUCCESS,
    }
}
