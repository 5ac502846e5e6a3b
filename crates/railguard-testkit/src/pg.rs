//! Throwaway PostgreSQL clusters: initialised into a temp dir, on a free loopback port, and
//! at a test's mercy — stop, kill, pause (SIGSTOP) and restart are the point.
//!
//! The cluster is railguard's own [`PostgresServer`] (the `database.url = "embedded"` code),
//! so tests run that code too; what only tests and the benchmark want lives here rather than
//! in the server: fsync off for speed (or left on, [`PgBuilder::durable`], for the
//! benchmark), loopback access for `pgbench`, and kill and pause, done by signalling the
//! postmaster and its backends.
//!
//! A cluster can also be put back in time: [`Pg::copy_data`] takes a `pg_basebackup` copy while
//! it serves, and [`Pg::rewind_to`] kills the server, puts the copy in place of its data
//! directory and starts it again on the same port. Every commit made after the copy is gone,
//! as when an asynchronous standby that missed the last commits is promoted: rows and
//! sequences go back together.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tempfile::TempDir;

use railguard::db::{Access, PostgresServer, ServerOptions};

use crate::Issued;
use crate::process::{children_of, signal};
use crate::{LaunchError, free_loopback_port};

/// Server settings of a cluster that is not [durable](PgBuilder::durable): a killed server
/// still loses nothing (the OS keeps the writes); only a machine crash would.
const NOT_DURABLE_SETTINGS: [(&str, &str); 2] = [("fsync", "off"), ("full_page_writes", "off")];

/// A throwaway PostgreSQL cluster.
pub struct Pg {
    pub server: PostgresServer,
    dir: TempDir,
}

/// A copy of a [`Pg`]'s data directory, taken by [`Pg::copy_data`] while the server ran; put
/// back with [`Pg::rewind_to`] (as often as wanted: the copy stays as it was). Removed when
/// dropped.
#[derive(Debug)]
pub struct DataCopy {
    dir: PathBuf,
    /// The WAL position the copy ends at (`pg_current_wal_lsn()` after the copy was made):
    /// a rewound server comes back with every commit up to here and none after.
    pub lsn: String,
    /// When the copy was complete.
    pub taken: tokio::time::Instant,
}

impl Drop for DataCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How to start a [`Pg`]; [`Pg::start`] is the default (not durable, in the system temp dir).
#[derive(Debug, Clone, Default)]
pub struct PgBuilder {
    durable: bool,
    temp_dir_in: Option<PathBuf>,
    tls: Option<Issued>,
    settings: Vec<(String, String)>,
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

    /// Serves TLS with `server`'s certificate (`ssl = on`) and accepts TCP connections over
    /// TLS only: `pg_hba.conf` is replaced by `hostssl all all 127.0.0.1/32 trust`, so a
    /// cleartext connection is refused.
    pub fn tls(mut self, server: &Issued) -> Self {
        self.tls = Some(server.clone());
        self
    }

    /// A server setting (`-c name=value`), after the builder's own so that it wins.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
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
        let (mut settings, initdb_args): (Vec<(String, String)>, _) = if self.durable {
            (Vec::new(), Vec::new())
        } else {
            let settings = NOT_DURABLE_SETTINGS
                .iter()
                .map(|(name, value)| (name.to_string(), value.to_string()))
                .collect();
            (settings, vec!["--no-sync".to_string()])
        };
        if self.tls.is_some() {
            // Relative to the data directory, where `start` copies them.
            for (name, value) in [
                ("ssl", "on"),
                ("ssl_cert_file", "server.crt"),
                ("ssl_key_file", "server.key"),
            ] {
                settings.push((name.into(), value.into()));
            }
        }
        settings.extend(self.settings.iter().cloned());
        let options = ServerOptions {
            data_dir: dir.path().join("data"),
            port: free_loopback_port(),
            access: Access::Loopback,
            settings,
            initdb_args,
        };
        let mut server = PostgresServer::init(options).await?;
        if let Some(issued) = &self.tls {
            serve_tls_only(server.data_dir(), issued)?;
        }
        server.start().await?;
        Ok(Pg { server, dir })
    }
}

/// Copies the certificate and key into the data directory, owned by the server's user with
/// the key at mode 0600 (PostgreSQL refuses a key others can read), and allows TLS only.
fn serve_tls_only(data_dir: &std::path::Path, issued: &Issued) -> Result<(), LaunchError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let io = |what: &str| {
        let what = what.to_string();
        move |source| LaunchError::Io {
            what: what.clone(),
            source,
        }
    };
    let owner = std::fs::metadata(data_dir).map_err(io("cannot read the data directory"))?;
    for (from, to, mode) in [
        (&issued.cert, "server.crt", 0o644),
        (&issued.key, "server.key", 0o600),
    ] {
        let to = data_dir.join(to);
        std::fs::copy(from, &to).map_err(io("cannot copy the server certificate"))?;
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))
            .map_err(io("cannot set the key's mode"))?;
        std::os::unix::fs::chown(&to, Some(owner.uid()), Some(owner.gid()))
            .map_err(io("cannot hand the key to the server's user"))?;
    }
    std::fs::write(
        data_dir.join("pg_hba.conf"),
        "# TLS only (railguard-testkit PgBuilder::tls)\nhostssl all all 127.0.0.1/32 trust\n",
    )
    .map_err(io("cannot write pg_hba.conf"))?;
    Ok(())
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

    /// Copies the data directory while the server runs (`pg_basebackup`, a fast checkpoint,
    /// the WAL streamed alongside), as the server's own user, into this cluster's temp dir.
    /// Needs the server's default replication access (`host replication all 127.0.0.1/32`),
    /// which a [TLS-only](PgBuilder::tls) cluster does not have.
    pub async fn copy_data(&self) -> Result<DataCopy, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = self
            .dir
            .path()
            .join(format!("copy-{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        let owner = owner_of(self.server.data_dir())?;
        std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        // Dropped on every path from here: a failed copy leaves nothing behind.
        let mut copy = DataCopy {
            dir,
            lsn: String::new(),
            taken: tokio::time::Instant::now(),
        };
        hand_over(&copy.dir, owner, 0o700)?;
        let mut command = tokio::process::Command::new(self.server.bin_dir().join("pg_basebackup"));
        command
            .arg("--dbname")
            .arg(self.url())
            .arg("--pgdata")
            .arg(&copy.dir)
            .args(["--wal-method=stream", "--checkpoint=fast", "--no-sync"])
            .current_dir(&copy.dir)
            .stdin(Stdio::null());
        if owner.0 != current_uid() {
            command.uid(owner.0).gid(owner.1);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .map_err(|_| "pg_basebackup did not finish within 60 s".to_string())?
            .map_err(|e| format!("cannot run pg_basebackup: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "pg_basebackup failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        copy.taken = tokio::time::Instant::now();
        copy.lsn = self
            .client_with(&self.url())
            .await?
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .map(|row| row.get(0))
            .unwrap_or_default();
        Ok(copy)
    }

    /// Puts the data directory back to `copy`: SIGKILLs the server (a crash: nothing is
    /// flushed or handed over), replaces the data directory with the copy and starts the
    /// server again on the same port, where it recovers to the end of the copy. Every commit
    /// made after the copy is lost. The server's log is kept across.
    pub async fn rewind_to(&mut self, copy: &DataCopy) -> Result<(), String> {
        self.kill().await;
        let data = self.server.data_dir().to_path_buf();
        let log = std::fs::read(data.join(SERVER_LOG)).unwrap_or_default();
        std::fs::remove_dir_all(&data)
            .map_err(|e| format!("cannot remove {}: {e}", data.display()))?;
        // `cp -a` keeps the server user's ownership and the 0700 modes PostgreSQL insists on.
        let out = tokio::process::Command::new("cp")
            .arg("-a")
            .arg(&copy.dir)
            .arg(&data)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("cannot run cp: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cannot put the copy in place: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        std::fs::write(data.join(SERVER_LOG), log)
            .map_err(|e| format!("cannot keep the server log: {e}"))?;
        self.server
            .start()
            .await
            .map_err(|e| format!("PostgreSQL did not start on the copy: {e}"))
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

    /// SIGSTOP to one backend: a session stopped mid-statement, keeping its locks, its
    /// connection open.
    pub async fn pause_backend(&self, pid: u32) {
        signal(pid, "STOP").await;
    }

    /// SIGCONT after [`pause_backend`](Self::pause_backend).
    pub async fn resume_backend(&self, pid: u32) {
        signal(pid, "CONT").await;
    }

    /// A connection of the test's own: TLS if the server offers it (certificate not
    /// checked), so that a [TLS-only](PgBuilder::tls) cluster answers too.
    pub async fn client(&self) -> tokio_postgres::Client {
        self.client_with(&self.url())
            .await
            .unwrap_or_else(|e| panic!("connect to the test cluster: {e}"))
    }

    /// A connection for `url` (this cluster's [`url`](Self::url) with its own `sslmode`,
    /// `sslrootcert`, ...), TLS as railguard does it (`railguard::tls::postgres`).
    pub async fn client_with(&self, url: &str) -> Result<tokio_postgres::Client, String> {
        let connect = railguard::tls::postgres::connect_config(url).map_err(|e| e.to_string())?;
        let (client, conn) = connect.config.connect(connect.tls).await.map_err(|e| {
            // tokio-postgres's message leaves the cause (the server's words) out.
            match std::error::Error::source(&e) {
                Some(cause) => format!("{e}: {cause}"),
                None => e.to_string(),
            }
        })?;
        tokio::spawn(conn);
        Ok(client)
    }

    /// The first column of the one row `sql` returns, over a new [`client`](Self::client).
    pub async fn one<T: tokio_postgres::types::FromSqlOwned>(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> T {
        crate::sql::one(&self.client().await, sql, params).await
    }

    /// The first column of every row `sql` returns, over a new [`client`](Self::client).
    pub async fn column<T: tokio_postgres::types::FromSqlOwned>(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Vec<T> {
        crate::sql::column(&self.client().await, sql, params).await
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

    /// The fencing floor, once a railguard has acknowledged this server as it runs now
    /// (`store::epoch`): a restart raises it, and every token from before is fenced out once.
    /// `None` until a railguard has used a session on it since it started.
    pub async fn floor(&self) -> Option<i64> {
        let client = self.client_with(&self.url()).await.ok()?;
        let row = client
            .query_one(
                "SELECT e.floor, e.postmaster_start IS NOT DISTINCT FROM \
                 pg_postmaster_start_time() FROM railguard_store_epoch e",
                &[],
            )
            .await
            .ok()?;
        row.get::<_, bool>(1).then(|| row.get(0))
    }
}

/// The server's log, inside its data directory (railguard's `PostgresServer` writes it there).
const SERVER_LOG: &str = "railguard-postgres.log";

/// `(uid, gid)` owning `path`.
fn owner_of(path: &Path) -> Result<(u32, u32), String> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .map(|m| (m.uid(), m.gid()))
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn current_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

/// Gives `dir` to the server's user with `mode`.
fn hand_over(dir: &Path, (uid, gid): (u32, u32), mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))?;
    if uid != current_uid() {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .map_err(|e| format!("cannot hand {} to uid {uid}: {e}", dir.display()))?;
    }
    Ok(())
}

/// What a PostgreSQL pooler that drops startup options passes on, for
/// [`Relay::rewrite_towards_target`](crate::relay::Relay::rewrite_towards_target): a chunk
/// that is a startup message (protocol 3.0) loses the `-c name=value` settings of its
/// `options` parameter whose name is in `names`, or the whole parameter when `names` is
/// empty. Every other chunk (an SSL request, queries) passes unchanged. Assumes the startup
/// message arrives in one chunk, as it does over loopback.
pub fn without_startup_settings(chunk: &[u8], names: &[&str]) -> Vec<u8> {
    const PROTOCOL_3: [u8; 4] = [0, 3, 0, 0];
    let Some((length, rest)) = chunk.split_first_chunk::<4>() else {
        return chunk.to_vec();
    };
    let length = u32::from_be_bytes(*length) as usize;
    if length > chunk.len() || length < 9 || rest[..4] != PROTOCOL_3 {
        return chunk.to_vec();
    }
    let mut fields: Vec<&[u8]> = chunk[8..length - 1].split(|b| *b == 0).collect();
    if fields.len() % 2 == 1 && fields.last().is_some_and(|f| f.is_empty()) {
        fields.pop();
    }
    let mut body = Vec::new();
    for pair in fields.chunks(2) {
        let [name, value] = pair else {
            return chunk.to_vec();
        };
        let value = if *name == b"options" {
            if names.is_empty() {
                continue;
            }
            let text = String::from_utf8_lossy(value);
            let mut kept = Vec::new();
            let mut words = text.split_whitespace();
            while let Some(word) = words.next() {
                if word == "-c"
                    && let Some(setting) = words.next()
                {
                    let name = setting.split('=').next().unwrap_or("");
                    if !names.contains(&name) {
                        kept.push(format!("-c {setting}"));
                    }
                } else {
                    kept.push(word.to_string());
                }
            }
            kept.join(" ").into_bytes()
        } else {
            value.to_vec()
        };
        body.extend_from_slice(name);
        body.push(0);
        body.extend_from_slice(&value);
        body.push(0);
    }
    body.push(0);
    let mut out = Vec::with_capacity(8 + body.len() + chunk.len() - length);
    out.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
    out.extend_from_slice(&PROTOCOL_3);
    out.extend_from_slice(&body);
    out.extend_from_slice(&chunk[length..]);
    out
}

#[cfg(test)]
mod tests {
    use super::without_startup_settings;

    fn startup(pairs: &[(&str, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, value) in pairs {
            body.extend_from_slice(name.as_bytes());
            body.push(0);
            body.extend_from_slice(value.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut message = ((8 + body.len()) as u32).to_be_bytes().to_vec();
        message.extend_from_slice(&[0, 3, 0, 0]);
        message.extend_from_slice(&body);
        message
    }

    #[test]
    fn drops_the_named_settings_or_the_whole_options_and_nothing_else() {
        let options = "-c statement_timeout=5000ms -c jit=off";
        let message = startup(&[("user", "u"), ("options", options), ("database", "d")]);
        assert_eq!(
            without_startup_settings(&message, &["jit"]),
            startup(&[
                ("user", "u"),
                ("options", "-c statement_timeout=5000ms"),
                ("database", "d")
            ])
        );
        assert_eq!(
            without_startup_settings(&message, &[]),
            startup(&[("user", "u"), ("database", "d")])
        );
        let long = "-c statement_timeout=2000ms -c plan_cache_mode=force_generic_plan \
                    -c enable_seqscan=off -c enable_hashjoin=off -c jit=off";
        let message = startup(&[("user", "u"), ("options", long)]);
        assert_eq!(
            without_startup_settings(&message, &["enable_hashjoin"]),
            startup(&[
                ("user", "u"),
                (
                    "options",
                    "-c statement_timeout=2000ms -c plan_cache_mode=force_generic_plan \
                     -c enable_seqscan=off -c jit=off"
                )
            ])
        );
        let ssl_request = [0, 0, 0, 8, 4, 210, 22, 47];
        assert_eq!(without_startup_settings(&ssl_request, &[]), ssl_request);
        assert_eq!(
            without_startup_settings(b"Q\0\0\0\x05x", &[]),
            b"Q\0\0\0\x05x"
        );
    }
}
