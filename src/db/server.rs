//! A private PostgreSQL server run from the installed server binaries, for
//! `database.url = "embedded"`: railguard owns a cluster in its data directory for its whole
//! life, so nobody has to install, configure and secure a PostgreSQL to try it or to run a
//! single instance.
//!
//! What that needs done right lives here: find the binaries, `initdb` once, run the server as
//! an unprivileged user when we are root (PostgreSQL refuses root), let no other local user
//! reach it, and notice when the server dies, during start-up or later. The test kit
//! (`crates/railguard-testkit`) starts its throwaway clusters through this same type, so the
//! tests run this code; what only tests want stays there: it passes its own server settings
//! ([`ServerOptions::settings`], e.g. fsync off) and listens on loopback ([`Access::Loopback`]),
//! and it kills and pauses a cluster itself, by signalling [`PostgresServer::pid`].
//!
//! The server is our child process, started with `postgres -D` rather than `pg_ctl`, so that
//! we hold its pid and can signal it directly. It runs in its own process group, so a Ctrl-C
//! at the terminal reaches railguard only, which stops the server *after* draining requests.
//!
//! One data directory, one owner: a lock file beside the directory (`<data_dir>.lock`) is
//! held for as long as a `PostgresServer` exists, so a second railguard (a `migrate` run next
//! to a `serve`, say) is refused instead of stopping the first one's database.
//!
//! Access: the embedded server ([`Access::Socket`]) listens on a Unix socket inside its own
//! data directory (mode 0700) and on no TCP port, so no other local user can reach it; test
//! clusters ([`Access::Loopback`]) listen on a loopback port so tools like `pgbench` can.
//! Either way, readiness is confirmed by asking the server for its data directory, so we never
//! mistake another cluster for ours.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// What failed while preparing or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(
        "no PostgreSQL server binaries found (looked in `pg_config --bindir` and \
         /usr/lib/postgresql/*/bin); install them: apt-get install postgresql"
    )]
    BinariesNotFound,
    #[error(
        "railguard runs as root and PostgreSQL refuses to; no unprivileged `postgres` user \
         exists to run it as. Create one (apt-get install postgresql does) or run railguard \
         as an unprivileged user"
    )]
    NoUnprivilegedUser,
    #[error("data directory {path}: {message}")]
    DataDir { path: PathBuf, message: String },
    #[error("{program} failed: {message}")]
    Command { program: String, message: String },
    #[error("PostgreSQL did not become ready within {0:?}; its log: {1}")]
    NotReady(Duration, String),
    #[error("PostgreSQL exited during start-up ({status}); its log: {log}")]
    Exited { status: String, log: String },
    #[error(
        "data directory {0} is in use by another railguard (its lock file is held); stop that \
         one first, or give this one its own database.data_dir"
    )]
    InUse(PathBuf),
}

/// How clients reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A Unix socket in the data directory only: private to the server's user (and root).
    Socket,
    /// 127.0.0.1 on `port`, trust authentication: for throwaway test clusters.
    Loopback,
}

/// Options for a server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The cluster's data directory; created and initialised if it holds no cluster.
    pub data_dir: PathBuf,
    /// Loopback TCP port to listen on.
    pub port: u16,
    pub access: Access,
    /// Extra server settings, `(name, value)`, passed as `-c name=value` after railguard's
    /// own so that they win. The embedded server has none; the test kit turns fsync off for
    /// its throwaway clusters.
    pub settings: Vec<(String, String)>,
    /// Extra `initdb` arguments (the test kit's throwaway clusters skip its fsync with
    /// `--no-sync`). The embedded server has none.
    pub initdb_args: Vec<String>,
}

/// A PostgreSQL server child process. Dropping it kills the server.
#[derive(Debug)]
pub struct PostgresServer {
    options: ServerOptions,
    bin_dir: PathBuf,
    run_as: Option<(u32, u32)>,
    child: Option<Child>,
    /// Held while this value lives: the data directory is ours.
    _lock: std::fs::File,
}

/// The database user and database railguard's clusters are created with.
pub const SUPERUSER: &str = "railguard";

impl PostgresServer {
    /// Finds the binaries, decides which user runs the server and initialises the data
    /// directory if it holds no cluster yet. Does not start the server.
    pub async fn init(options: ServerOptions) -> Result<Self, ServerError> {
        let bin_dir = find_bin_dir().await?;
        let run_as = if effective_uid_is_root() {
            Some(unprivileged_user()?)
        } else {
            None
        };
        let lock = lock_data_dir(&options.data_dir)?;
        let server = Self {
            _lock: lock,
            options,
            bin_dir,
            run_as,
            child: None,
        };
        server.prepare_data_dir().await?;
        Ok(server)
    }

    /// Connection string for the server: a `postgres://` URL on loopback, or key-value form
    /// naming the socket directory.
    pub fn url(&self) -> String {
        match self.options.access {
            Access::Loopback => format!(
                "postgres://{SUPERUSER}@127.0.0.1:{}/postgres",
                self.options.port
            ),
            Access::Socket => {
                let dir = self
                    .options
                    .data_dir
                    .display()
                    .to_string()
                    .replace('\\', "\\\\")
                    .replace('\'', "\\'");
                format!(
                    "host='{dir}' port={} user={SUPERUSER} dbname=postgres",
                    self.options.port
                )
            }
        }
    }

    pub fn port(&self) -> u16 {
        self.options.port
    }

    pub fn data_dir(&self) -> &Path {
        &self.options.data_dir
    }

    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The postmaster's pid while it runs (its backends are its children): for whoever must
    /// signal the server itself, such as the test kit's kill and pause.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    fn log_path(&self) -> PathBuf {
        self.options.data_dir.join("railguard-postgres.log")
    }

    async fn prepare_data_dir(&self) -> Result<(), ServerError> {
        let dir = &self.options.data_dir;
        let dir_error = |message: String| ServerError::DataDir {
            path: dir.clone(),
            message,
        };
        if dir.join("PG_VERSION").exists() {
            return Ok(());
        }
        std::fs::create_dir_all(dir).map_err(|e| dir_error(format!("cannot create it: {e}")))?;
        let not_empty = std::fs::read_dir(dir)
            .map_err(|e| dir_error(format!("cannot read it: {e}")))?
            .next()
            .is_some();
        if not_empty {
            return Err(dir_error(
                "exists, is not empty and holds no PostgreSQL cluster; refusing to touch it".into(),
            ));
        }
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))
                .map_err(|e| dir_error(format!("cannot hand it to uid {uid}: {e}")))?;
            check_reachable(dir, uid)?;
        }
        let mut initdb = self.command("initdb");
        initdb.arg("-D").arg(dir).args([
            "-U",
            SUPERUSER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
        ]);
        initdb.args(&self.options.initdb_args);
        let out = initdb.output().await.map_err(|e| ServerError::Command {
            program: "initdb".into(),
            message: e.to_string(),
        })?;
        if !out.status.success() {
            return Err(ServerError::Command {
                program: "initdb".into(),
                message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(())
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(program));
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        // The server must not inherit our working directory's permissions problems.
        cmd.current_dir(&self.options.data_dir);
        cmd.stdin(Stdio::null());
        cmd
    }

    fn access_flags(&self) -> Vec<String> {
        match self.options.access {
            Access::Loopback => vec![
                "-c".into(),
                "listen_addresses=127.0.0.1".into(),
                "-c".into(),
                "unix_socket_directories=".into(),
            ],
            Access::Socket => vec![
                "-c".into(),
                "listen_addresses=".into(),
                "-c".into(),
                format!(
                    "unix_socket_directories={}",
                    self.options.data_dir.display()
                ),
                "-c".into(),
                "unix_socket_permissions=0700".into(),
            ],
        }
    }

    /// Starts the server and waits until it accepts connections.
    pub async fn start(&mut self) -> Result<(), ServerError> {
        if self.child.is_some() {
            return Ok(());
        }
        self.stop_stale_server().await;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| ServerError::DataDir {
                path: self.log_path(),
                message: format!("cannot open the server log: {e}"),
            })?;
        let log2 = log.try_clone().map_err(|e| ServerError::DataDir {
            path: self.log_path(),
            message: e.to_string(),
        })?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.options.data_dir)
            .args(["-p", &self.options.port.to_string()])
            .args(self.access_flags())
            .args(["-c", "max_connections=200"])
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(true)
            .process_group(0);
        for (name, value) in &self.options.settings {
            cmd.arg("-c").arg(format!("{name}={value}"));
        }
        let child = cmd.spawn().map_err(|e| ServerError::Command {
            program: "postgres".into(),
            message: e.to_string(),
        })?;
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(60)).await
    }

    async fn wait_ready(&mut self, limit: Duration) -> Result<(), ServerError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(ServerError::Exited {
                    status: status.to_string(),
                    log: self.log_tail(),
                });
            }
            let url = self.url();
            let probe = async {
                // TLS if the server offers it (a test cluster may accept nothing else); its
                // certificate is not checked: the data directory it names is.
                let connect =
                    crate::tls::postgres::connect_config(&url).map_err(|e| e.to_string())?;
                let (client, conn) = super::establish(&connect.config, connect.tls)
                    .await
                    .map_err(|e| e.to_string())?;
                let conn = tokio::spawn(conn);
                let result = client
                    .query_one("SHOW data_directory", &[])
                    .await
                    .map(|row| row.get::<_, String>(0))
                    .map_err(|e| e.to_string());
                drop(client);
                let _ = conn.await;
                result
            };
            if let Ok(Ok(served)) = tokio::time::timeout(Duration::from_secs(2), probe).await {
                // Whoever answers on our port must be serving our data directory.
                let ours = std::fs::canonicalize(&self.options.data_dir)
                    .unwrap_or_else(|_| self.options.data_dir.clone());
                if Path::new(&served) == ours {
                    return Ok(());
                }
                tracing::warn!(served, ours = %ours.display(), "another PostgreSQL answers on our port");
            }
            if tokio::time::Instant::now() > deadline {
                return Err(ServerError::NotReady(limit, self.log_tail()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A server left behind by a railguard that died without stopping it still holds the data
    /// directory. We hold the directory's lock, so no live railguard owns it: if the pid in
    /// `postmaster.pid` is a `postgres` from our binaries running in our data directory, it is
    /// that orphan, and we stop it. Anything else (a reused pid) is left alone.
    async fn stop_stale_server(&self) {
        let Ok(text) = std::fs::read_to_string(self.options.data_dir.join("postmaster.pid")) else {
            return;
        };
        let Some(pid) = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok())
        else {
            return;
        };
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let exe = std::fs::read_link(proc_dir.join("exe")).ok();
        let cwd = std::fs::read_link(proc_dir.join("cwd")).ok();
        let ours = std::fs::canonicalize(&self.options.data_dir).ok();
        let our_postgres = std::fs::canonicalize(self.bin_dir.join("postgres")).ok();
        if exe.is_none() || exe != our_postgres || cwd != ours {
            return;
        }
        tracing::warn!(pid, data_dir = %self.options.data_dir.display(),
            "a PostgreSQL server from an earlier run still holds the data directory; stopping it");
        signal(pid, "INT").await;
        for _ in 0..600 {
            if !proc_dir.exists() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        signal(pid, "KILL").await;
    }

    /// Resolves when the running server exits on its own (it crashed, or was killed), after
    /// which [`start`](Self::start) starts a new one. Pending forever when it is not running.
    pub async fn exited(&mut self) -> String {
        match self.child.as_mut() {
            Some(child) => {
                let status = child.wait().await;
                self.child = None;
                match status {
                    Ok(status) => status.to_string(),
                    Err(e) => e.to_string(),
                }
            }
            None => std::future::pending().await,
        }
    }

    /// Fast shutdown: disconnects clients, checkpoints and exits. Waits for it.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                signal(pid, "INT").await;
            }
            if tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }

    /// The last lines of the server's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
    }
}

async fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
}

/// Takes the data directory's lock file (`<data_dir>.lock`, beside it), or says who has it.
fn lock_data_dir(data_dir: &Path) -> Result<std::fs::File, ServerError> {
    let dir_error = |message: String| ServerError::DataDir {
        path: data_dir.to_path_buf(),
        message,
    };
    let mut name = data_dir.as_os_str().to_owned();
    name.push(".lock");
    let path = PathBuf::from(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| dir_error(format!("cannot create its parent: {e}")))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| dir_error(format!("cannot open its lock file {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(ServerError::InUse(data_dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(dir_error(format!("cannot lock {}: {e}", path.display())))
        }
    }
}

fn effective_uid_is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// uid and gid of the `postgres` system user, from /etc/passwd.
fn unprivileged_user() -> Result<(u32, u32), ServerError> {
    let passwd =
        std::fs::read_to_string("/etc/passwd").map_err(|_| ServerError::NoUnprivilegedUser)?;
    passwd
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.len() >= 4 && fields[0] == "postgres")
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .next()
        .ok_or(ServerError::NoUnprivilegedUser)
}

/// The server runs as `uid`; every ancestor of its data directory must let it through.
fn check_reachable(dir: &Path, uid: u32) -> Result<(), ServerError> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    for ancestor in dir.ancestors().skip(1) {
        let Ok(meta) = std::fs::metadata(ancestor) else {
            continue;
        };
        let mode = meta.mode();
        let passable = mode & 0o001 != 0 || (meta.uid() == uid && mode & 0o100 != 0);
        if !passable {
            return Err(ServerError::DataDir {
                path: dir.clone(),
                message: format!(
                    "the PostgreSQL server runs as uid {uid} and cannot enter {}; choose a \
                     data_dir it can reach, such as one under /var/tmp",
                    ancestor.display()
                ),
            });
        }
    }
    Ok(())
}

/// The directory holding `postgres` and `initdb`: `pg_config --bindir` if it has them, else
/// the newest `/usr/lib/postgresql/<version>/bin` (Debian does not put them on PATH).
pub async fn find_bin_dir() -> Result<PathBuf, ServerError> {
    let has_server = |dir: &Path| dir.join("postgres").is_file() && dir.join("initdb").is_file();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output().await
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_server(&dir) {
            return Ok(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, dir)| has_server(dir))
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, dir)| dir)
        .ok_or(ServerError::BinariesNotFound)
}
