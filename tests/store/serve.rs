//! `railguard serve` in this process on a bare config: a database and an upstream nobody
//! answers at, for the tests of what serve does with its database before it serves.

use std::collections::BTreeMap;
use std::time::Duration;

use railguard::config::Config;
use railguard::server::{Listeners, ServeError, run};
use tokio::net::TcpListener;

/// Serves from `url` with `database` (more `[database]` lines) until `shutdown` or until it
/// stops on its own, bounded by a minute.
pub(crate) async fn serve(
    url: &str,
    database: &str,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let text = format!(
        "[proxy]\nlisten = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9\"\n\
         [database]\nurl = \"{url}\"\ntimeout_ms = 2000\n{database}"
    );
    let config = Config::parse(&text, "railguard.toml", &BTreeMap::new()).unwrap();
    let bind = || TcpListener::bind("127.0.0.1:0");
    let listeners = Listeners {
        proxy: bind().await.unwrap().into(),
        admin: bind().await.unwrap(),
        lock: bind().await.unwrap(),
    };
    tokio::time::timeout(Duration::from_secs(60), run(listeners, config, shutdown))
        .await
        .expect("serve ended within a minute")
}
