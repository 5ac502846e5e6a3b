//! Throwaway PostgreSQL clusters: initialised into a temp dir, on a free loopback port, and
//! at a test's mercy — stop, kill, pause (SIGSTOP) and restart are the point.
//!
//! The cluster is railguard's own [`PostgresServer`] (the `database.url = "embedded"` code),
//! so tests run that code too; what only tests and the benchmark want lives here rather than
//! in the server: fsync off for speed (or left on, [`PgBuilder::durable`], for the
//! benchmark), loopback access for `pgbench`, and kill and pause, done by signalling the
//! postmaster and its backends.

use std::path::PathBuf;
use std::time::Duration;

use tempfile::TempDir;

use railguard::db::{Access, PostgresServer, ServerOptions};

use crate::process::{children_of, signal};
use crate::{LaunchError, free_loopback_port};

/// Server settings of a cluster that is not [durable](PgBuilder::durable): a killed server
/// still loses nothing (the OS keeps the writes); only a machine crash would.
const NOT_DURABLE_SETTINGS: [(&str, &str); 2] = [("fsync", "off"), ("full_page_writes", "off")];

/// A throwaway PostgreSQL cluster.
pub struct Pg {
    pub server: PostgresServer,
    _dir: TempDir,
}

/// How to start a [`Pg`]; [`Pg::start`] is the default (not durable, in the system temp dir).
#[derive(Debug, Clone, Default)]
pub struct PgBuilder {
    durable: bool,
    temp_dir_in: Option<PathBuf>,
}

impl PgBuilder {
    /// `true`: PostgreSQL's defaults, fsync and synchronous_commit on, every commit flushed to
    /// disk as in production (the benchmark measures that). `false`, the default: fsync and
    /// full_page_writes off, and `initdb --no-sync`, which is all a test needs.
    pub fn durable(mut self, durable: bool) -> Self {
        self.durable = durable;
        self
    }

    /// Makes the cluster's temp dir under `dir` rather than the system temp dir (which may be
    /// a tmpfs, where fsync costs nothing).
    pub fn temp_dir_in(mut self, dir: impl Into<PathBuf>) -> Self {
        self.temp_dir_in = Some(dir.into());
        self
    }

    /// Initialises the cluster and waits until it accepts connections.
    pub async fn start(self) -> Result<Pg, LaunchError> {
        let mut temp = tempfile::Builder::new();
        temp.prefix("railguard-pg-");
        let dir = match &self.temp_dir_in {
            Some(parent) => temp.tempdir_in(parent),
            None => temp.tempdir(),
        }
        .map_err(|source| LaunchError::Io {
            what: "cannot create PostgreSQL's temp dir".into(),
            source,
        })?;
        let (settings, initdb_args) = if self.durable {
            (Vec::new(), Vec::new())
        } else {
            let settings = NOT_DURABLE_SETTINGS
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .collect();
            (settings, vec!["--no-sync".to_string()])
        };
        let options = ServerOptions {
            data_dir: dir.path().join("data"),
            port: free_loopback_port(),
            access: Access::Loopback,
            settings,
            initdb_args,
        };
        let mut server = PostgresServer::init(options).await?;
        server.start().await?;
        Ok(Pg { server, _dir: dir })
    }
}

impl Pg {
    /// A cluster for a test: not durable, in the system temp dir. Panics if it cannot start.
    pub async fn start() -> Pg {
        Pg::builder()
            .start()
            .await
            .unwrap_or_else(|e| panic!("throwaway PostgreSQL: {e}"))
    }

    pub fn builder() -> PgBuilder {
        PgBuilder::default()
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The postmaster's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.server.pid()
    }

    /// The server's version, `17.2 (Debian 17.2-1)` say, from `postgres --version`.
    pub async fn version(&self) -> String {
        match tokio::process::Command::new(self.server.bin_dir().join("postgres"))
            .arg("--version")
            .output()
            .await
        {
            Ok(out) => String::from_utf8_lossy(&out.stdout)
                .trim()
                .trim_start_matches("postgres (PostgreSQL) ")
                .to_string(),
            Err(_) => "unknown".into(),
        }
    }

    /// SIGKILL: a crash. The next [`PostgresServer::start`] runs crash recovery.
    pub async fn kill(&mut self) {
        let Some(pid) = self.server.pid() else {
            return;
        };
        let backends = children_of(pid);
        signal(pid, "KILL").await;
        // Reaped, so that the server knows it is gone and a start starts a new one.
        tokio::time::timeout(Duration::from_secs(10), self.server.exited())
            .await
            .expect("PostgreSQL exits after SIGKILL");
        // Orphaned backends notice the postmaster is gone and exit; until they have, the
        // shared memory is attached and a new server would refuse to start.
        for _ in 0..200 {
            if !backends
                .iter()
                .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGSTOP to the postmaster and every backend: a server that stops answering without
    /// closing its sockets (a VM pause, a partition that drops packets).
    pub async fn pause(&self) {
        if let Some(pid) = self.server.pid() {
            for backend in children_of(pid) {
                signal(backend, "STOP").await;
            }
            signal(pid, "STOP").await;
        }
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub async fn resume(&self) {
        if let Some(pid) = self.server.pid() {
            signal(pid, "CONT").await;
            for backend in children_of(pid) {
                signal(backend, "CONT").await;
            }
        }
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client
    }

    /// The account's high-water mark, read straight from the table.
    pub async fn mark(&self, account: &str) -> Option<i64> {
        self.client()
            .await
            .query_opt(
                "SELECT highest_token FROM rail_high_water WHERE account_id = $1",
                &[&account],
            )
            .await
            .expect("query mark")
            .map(|row| row.get(0))
    }
}
