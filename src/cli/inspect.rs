//! `railguard inspect`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use railguard::admin::SECRET_VAR;

use super::config::{cli_secret, config_path, load};
use super::fail;

/// Show who holds a lock key: holder, lease left and grant age.
///
/// Asks the running railguard's lock API, for diagnosis. Never a token, and never usable for a
/// correctness decision (FR-07).
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The running railguard's config file (for lock.listen).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The lock key (by default the account id, see fencing.lock_key_template).
    key: String,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let Args { config, key } = args;
    let config = match load(&config_path(config)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let listen = config.lock.listen;
    if config.lock.listener.settings().tls.is_some() {
        return fail(&format!(
            "inspect {key}: the lock listener at {listen} serves TLS only \
             (lock.tls_cert_file) and this command speaks plain HTTP: nothing was \
             sent (not ${SECRET_VAR} either)"
        ));
    }
    let host = if listen.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], listen.port()))
    } else {
        listen
    };
    let mut client = railguard::sdk::LockClient::new(format!("http://{host}"))
        .with_timeout(Duration::from_secs(5));
    if let Some(secret) = cli_secret() {
        client = match client.with_bearer(&secret) {
            Ok(client) => client,
            Err(e) => return fail(&format!("${SECRET_VAR}: {e}")),
        };
    }
    match client.inspect(&key).await {
        Ok(status) => {
            println!("{}", describe(&status));
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("inspect {key} at http://{host}: {e}")),
    }
}

/// A key's status for people: who holds it and for how long — no token (FR-07).
fn describe(status: &railguard::sdk::KeyStatus) -> String {
    if !status.held {
        return format!("{}: free", status.key);
    }
    let mut line = format!(
        "{}: held by {}",
        status.key,
        status.holder.as_deref().unwrap_or("?")
    );
    if let Some(left) = status.lease_remaining_ms {
        line.push_str(&format!(", lease {left} ms left"));
    }
    if let Some(age) = status.grant_age_ms {
        line.push_str(&format!(", granted {age} ms ago"));
    }
    line
}
