//! railguard's test kit: the real components a test needs, each throwaway and each killable,
//! shared by the integration tests, the benchmark and the fault harness.
//!
//! - [`Pg`]: a PostgreSQL cluster initialised into a temp dir (run as the `postgres` user when
//!   the tests run as root), which a test can stop, kill, pause and restart, or put back to an
//!   earlier copy of its data; durable for the benchmark.
//! - [`EtcdCluster`]: one or three real etcd members, each stoppable, killable and pausable;
//!   the whole cluster can be restored from a snapshot taken earlier.
//! - [`PatroniCluster`]: a high-availability PostgreSQL (Patroni, two or three members, its
//!   own etcd) whose primary a test kills or switches over, losing its last commits if asked.
//! - [`Rail`]: the rail simulator, in-process, whose ledger a test reads directly.
//! - [`Railguard`]: railguard itself, with a config written for the test and overrides on top.
//! - [`Http`]: an HTTP client over real sockets; [`Metrics`]: a strict Prometheus text parser.
//! - [`Prometheus`]: a real Prometheus server scraping railguard and evaluating alert rules.
//! - [`Pki`]: a throwaway certificate authority (the `openssl` command) for TLS tests;
//!   [`TlsClient`]: HTTP/1.1 over TLS to a listener, with or without a client certificate.
//! - [`TlsFront`]: a TLS-terminating front that makes the rail simulator an `https://` rail.
//! - [`Relay`]: a TCP relay whose delay a test turns up, to make a slow network.
//! - [`eventually`] and [`until`]: the one way a test waits, bounded, failing with what it
//!   waited for; [`Payment`]: a payment over HTTP whose every header a test chooses.
//! - [`World`]: all of the above for one lock backend, and [`suite!`] to run the same
//!   behavioural cases on every backend.
//!
//! Tests use the shorthands, which panic when something cannot start (`Pg::start`,
//! `EtcdCluster::single`, ...); the benchmark uses the builders, which return a
//! [`LaunchError`] it can report.

pub mod etcd;
mod full_rail;
mod http;
mod patroni;
pub mod payment;
mod pg;
mod pki;
mod process;
mod prometheus;
mod prometheus_server;
mod rail;
pub mod records;
pub mod relay;
mod serve;
pub mod sql;
mod tls;
mod tls_front;
mod wait;
mod world;

pub use etcd::{EtcdBuilder, EtcdCluster, EtcdSnapshot};
pub use full_rail::FullRail;
pub use http::{Http, Reply};
pub use patroni::{PatroniBuilder, PatroniCluster};
pub use payment::Payment;
pub use pg::{DataCopy, Pg, PgBuilder, without_startup_settings};
pub use pki::{Issued, Pki};
pub use process::{children_of, pids_naming, pids_where, signal};
pub use prometheus::Metrics;
pub use prometheus_server::Prometheus;
pub use rail::Rail;
pub use relay::Relay;
pub use serve::{Railguard, binary as railguard_binary, run_command as railguard_command};
pub use tls::{TlsClient, TlsReply, hex};
pub use tls_front::TlsFront;
pub use wait::{eventually, until, within};
pub use world::{Backend, World};

/// Why a launcher could not start what it launches.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("PostgreSQL: {0}")]
    Postgres(#[from] railguard::db::ServerError),
    #[error("etcd: {0}")]
    Etcd(String),
    #[error("Patroni: {0}")]
    Patroni(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Installs a test log subscriber once (RUST_LOG controls it).
#[allow(clippy::disallowed_methods)] // the tests' own log filter
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A loopback port nothing listened on a moment ago, for the child processes (etcd members,
/// PostgreSQL clusters) that must be told their port before they start; anything started in
/// this process binds port 0 instead. Claimed for this process until it exits or has claimed
/// [`KEPT_CLAIMS`] more ([`railguard::demo::ports`]): no other process picking ports this way
/// takes it meanwhile, so a server a test stops and starts again on its port (a crash, a
/// rewind of its data, a restore) still finds it free, however many other tests pick ports
/// meanwhile.
///
/// A process keeps its [`KEPT_CLAIMS`] latest claims (one descriptor each): a test binary run
/// whole in one process (`cargo test`) lets its oldest go, whose tests have long ended.
pub fn free_loopback_port() -> u16 {
    let port = railguard::demo::ports::claim_loopback_port().expect("a free loopback port");
    let number = port.number();
    let mut claimed = CLAIMED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if claimed.len() >= KEPT_CLAIMS {
        claimed.pop_front();
    }
    claimed.push_back(port);
    number
}

/// How many of its latest port claims a process keeps.
pub const KEPT_CLAIMS: usize = 256;

/// The ports this process has claimed, held until it exits or [`KEPT_CLAIMS`] later ones.
static CLAIMED: std::sync::Mutex<std::collections::VecDeque<railguard::demo::ports::LoopbackPort>> =
    std::sync::Mutex::new(std::collections::VecDeque::new());

/// A railguard config file `rg.toml` written in `dir`, whose database nothing serves: every
/// listener and the database on a loopback port of its own, free when picked (so that nothing
/// else on this machine, a railguard on the shipped ports say, can fail a start first), the
/// database's URL with a password (`postgres://rg:pw@…`) and a timeout of 500 ms, then `more`
/// (TOML, such as a `[log]` table). Its path.
pub fn config_without_a_database(dir: &std::path::Path, more: &str) -> std::path::PathBuf {
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < 4 {
        let port = free_loopback_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    let [proxy, admin, lock, database] = [ports[0], ports[1], ports[2], ports[3]];
    let path = dir.join("rg.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:{proxy}\"\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n\
             [lock]\nlisten = \"127.0.0.1:{lock}\"\n\
             [database]\nurl = \"postgres://rg:pw@127.0.0.1:{database}/x\"\ntimeout_ms = 500\n\
             {more}"
        ),
    )
    .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_process_keeps_only_its_latest_port_claims() {
        let picked: Vec<u16> = (0..super::KEPT_CLAIMS + 10)
            .map(|_| super::free_loopback_port())
            .collect();
        let claimed = super::CLAIMED.lock().unwrap();
        assert_eq!(claimed.len(), super::KEPT_CLAIMS);
        assert_eq!(
            claimed.back().map(|p| p.number()),
            picked.last().copied(),
            "the latest is kept"
        );
        assert!(
            !claimed.iter().any(|p| p.number() == picked[0]),
            "the oldest was let go"
        );
    }
}
