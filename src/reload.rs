//! SIGHUP: what a running `railguard serve` takes from its files without a restart.
//!
//! `main` turns each SIGHUP into a request on [`Reload::requests`]; for each, [`serve`]:
//!
//! - reads the config file again, with the `RAILGUARD__…` overrides the process started
//!   with. `log.level` takes effect at once (unless `RUST_LOG` is set: it wins, as at start).
//!   Every other key whose value changed is logged by name as needing a restart; the process
//!   keeps running on the values it started with. A file that cannot be read or is invalid is
//!   logged with its key and changes nothing;
//! - reads `auth.credentials_file` again and puts it in force at once if it parses (the
//!   periodic watch waits for two identical looks; a SIGHUP says the file is complete). A
//!   version that does not parse is refused and the one in force stays;
//! - checks each TLS listener's certificate, key and client CA files, and puts them in force
//!   for new connections if they changed and can be used (they are also checked on their own
//!   at most once a second as handshakes arrive);
//!
//! and logs one line saying what it did. Nothing here ends the process or touches the
//! database: connections, requests in flight and the embedded PostgreSQL go on as they were.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::auth::Authenticator;
use crate::config::Config;
use crate::telemetry::{LevelChange, LogLevel};
use crate::tls::server::{Checked, TlsServer};

/// What a running railguard needs to reload its configuration on request.
pub struct Reload {
    /// The config file it was started with.
    pub path: PathBuf,
    /// The `RAILGUARD__…` overrides it was started with (the process environment does not
    /// change while it runs).
    pub env: BTreeMap<String, String>,
    /// The log level's handle, if this process installed the subscriber.
    pub log: Option<LogLevel>,
    /// One message per SIGHUP.
    pub requests: mpsc::Receiver<()>,
}

/// What a running railguard can put in force without a restart.
pub struct Reloadable {
    pub credentials: Option<Arc<Authenticator>>,
    /// Each TLS listener by name (`proxy`, `lock`, `admin`).
    pub tls: Vec<(&'static str, Arc<TlsServer>)>,
}

/// The key reloaded in the config file itself; every other changed key needs a restart.
const RELOADED_KEYS: &[&str] = &["log.level"];

/// Serves reload requests until the sender is gone; `running` is the configuration the
/// process runs on.
pub async fn serve(mut reload: Reload, mut running: Config, what: Reloadable) {
    while reload.requests.recv().await.is_some() {
        tracing::info!(file = %reload.path.display(),
            "SIGHUP received: reloading the configuration, credentials and TLS files");
        once(&reload, &mut running, &what).await;
    }
}

async fn once(reload: &Reload, running: &mut Config, what: &Reloadable) {
    let mut done: Vec<String> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let mut restart: Vec<String> = Vec::new();
    let (path, env) = (reload.path.clone(), reload.env.clone());
    let loaded = tokio::task::spawn_blocking(move || Config::load(&path, &env)).await;
    match loaded {
        Ok(Ok(new)) => {
            let changed = running.changed_keys(&new);
            if changed.is_empty() {
                done.push("config file: no key changed".into());
            }
            for key in changed {
                if !RELOADED_KEYS.contains(&key.as_str()) {
                    restart.push(key);
                    continue;
                }
                match reload.log.as_ref().map(|log| log.set(&new.log.level)) {
                    Some(Ok(LevelChange::Applied)) => {
                        running.log.level = new.log.level.clone();
                        done.push(format!("log.level is now {:?}", new.log.level));
                    }
                    Some(Ok(LevelChange::RustLogWins)) => failed.push(
                        "log.level changed, but RUST_LOG is set and wins over it: the log \
                         level is unchanged"
                            .into(),
                    ),
                    Some(Err(e)) => failed.push(format!("log.level: {e}")),
                    None => restart.push(key),
                }
            }
            if !restart.is_empty() {
                tracing::warn!(
                    file = %reload.path.display(),
                    keys = %restart.join(", "),
                    "configuration changed in keys that need a restart to take effect: {}; \
                     this process goes on with the values it started with",
                    restart.join(", ")
                );
            }
        }
        Ok(Err(e)) => failed.push(format!(
            "the configuration cannot be used, nothing in it was applied: {e}"
        )),
        Err(e) => failed.push(format!("the configuration was not read: {e}")),
    }
    if let Some(auth) = &what.credentials {
        let auth = auth.clone();
        let file = auth.path().display().to_string();
        match tokio::task::spawn_blocking(move || auth.reload_now()).await {
            Ok(Ok(identities)) => {
                done.push(format!("credentials file {file} ({identities} identities)"))
            }
            Ok(Err(e)) => failed.push(format!(
                "credentials file {file}: {e}; the version in force stays"
            )),
            Err(e) => failed.push(format!("credentials file {file} was not read: {e}")),
        }
    }
    for (name, tls) in &what.tls {
        match tls.check_now().await {
            Checked::Reloaded => done.push(format!("{name} TLS files (changed: reloaded)")),
            Checked::Unchanged => done.push(format!("{name} TLS files (unchanged)")),
            Checked::Failed(e) => failed.push(format!(
                "{name} TLS files: {e}; the certificate in use stays"
            )),
            Checked::Stalled => failed.push(format!(
                "{name} TLS files: the check did not return (the file system does not answer)"
            )),
            Checked::Busy => failed.push(format!(
                "{name} TLS files: checks already running; the next handshake's takes any change in"
            )),
        }
    }
    let reloaded = if done.is_empty() {
        "nothing".to_string()
    } else {
        done.join("; ")
    };
    if failed.is_empty() {
        tracing::info!(%reloaded, needs_restart = %restart.join(", "),
            "SIGHUP: reload done: {reloaded}");
    } else {
        tracing::error!(%reloaded, failed = %failed.join("; "), needs_restart = %restart.join(", "),
            "SIGHUP: reload done with errors: {}; done: {reloaded}", failed.join("; "));
    }
}
