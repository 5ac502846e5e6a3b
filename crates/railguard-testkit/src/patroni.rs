//! A throwaway high-availability PostgreSQL: Debian's Patroni (3.0) managing two or three
//! PostgreSQL members on loopback, with a single etcd member of its own as the configuration
//! store, so that tests can fail a primary over as production would and see what railguard
//! sees: a new primary, a new timeline, and, with asynchronous replication, acknowledged
//! commits the new primary never received.
//!
//! Every member runs Patroni under the system Python (`/usr/bin/python3 /usr/bin/patroni`) as
//! the `postgres` user when the tests run as root, and keeps its configuration, its data
//! directory and its log (Patroni's and PostgreSQL's, interleaved) in its own directory of the
//! cluster's temp dir. Patroni starts the postmaster detached (it is re-parented to PID 1), so
//! a kill reads `postmaster.pid` and signals the postmaster and its children itself; and every
//! process whose working directory lies in a member's directory (Patroni, the postmaster and
//! its children, `pg_basebackup`, `pg_rewind`) belongs to that member, which is how dropping
//! the cluster finds them all.
//!
//! Timings follow the defaults a test can wait for: a ttl of 10 s (a hard failover takes about
//! that long), loop_wait 2 s, retry_timeout 5 s, and a fast checkpoint for a clone's base
//! backup. Authentication is `trust` on loopback for every user and for replication.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};

use crate::process::{children_of, signal};
use crate::{EtcdCluster, Http, LaunchError, free_loopback_port};

const PYTHON: &str = "/usr/bin/python3";
const PATRONI: &str = "/usr/bin/patroni";
/// How long a new cluster may take to have a writable primary and every standby streaming.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a restarted member, or the cluster after a switchover, may take to stream again.
const REJOIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long [`PatroniCluster::primary`] waits for a primary.
const PRIMARY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a switchover may take to give a writable new primary.
const SWITCHOVER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one REST request or one SQL connection may take; a paused member never answers.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a killed member's processes may take to be gone.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// The database user that owns the cluster, and its database.
const SUPERUSER: &str = "postgres";
/// The user standbys replicate as (created by Patroni when it bootstraps).
const REPLICATION_USER: &str = "replicator";

/// A running Patroni cluster: two or three PostgreSQL members, one of them primary.
pub struct PatroniCluster {
    members: Vec<Member>,
    synchronous_mode: bool,
    /// Walsenders stopped by [`pause_replication`](PatroniCluster::pause_replication).
    paused: Vec<u32>,
    http: Http,
    // Dropped after `Drop::drop` has killed every member: etcd next, then the temp dir.
    etcd: EtcdCluster,
    dir: TempDir,
}

/// How to start a [`PatroniCluster`]: two members, asynchronous replication, fsync off.
#[derive(Debug, Clone)]
pub struct PatroniBuilder {
    members: usize,
    synchronous_mode: bool,
    durable: bool,
    temp_dir_in: Option<PathBuf>,
    settings: Vec<(String, String)>,
}

impl Default for PatroniBuilder {
    fn default() -> Self {
        PatroniBuilder {
            members: 2,
            synchronous_mode: false,
            durable: false,
            temp_dir_in: None,
            settings: Vec::new(),
        }
    }
}

struct Member {
    name: String,
    pg_port: u16,
    rest_port: u16,
    dir: PathBuf,
    patroni: Option<Child>,
}

impl Member {
    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn config_path(&self) -> PathBuf {
        self.dir.join("patroni.yml")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("patroni.log")
    }

    fn url(&self) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/postgres", self.pg_port)
    }

    fn rest_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.rest_port)
    }

    fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The postmaster's pid from `postmaster.pid`, if that process runs in this member's data
    /// directory (so a stale file naming a reused pid is ignored).
    fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?;
        let pid: u32 = text.lines().next()?.trim().parse().ok()?;
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok()?;
        let data = std::fs::canonicalize(self.data_dir()).ok()?;
        (cwd == data && alive(pid)).then_some(pid)
    }
}

impl PatroniBuilder {
    /// How many PostgreSQL members (default 2).
    pub fn members(mut self, members: usize) -> Self {
        self.members = members;
        self
    }

    /// Patroni's `synchronous_mode` (default off): a commit waits until one standby has it, and
    /// only that standby may be promoted. Not strict: a primary left alone accepts writes.
    pub fn synchronous_mode(mut self, on: bool) -> Self {
        self.synchronous_mode = on;
        self
    }

    /// `true`: PostgreSQL's defaults, every commit flushed to disk. `false`, the default: fsync
    /// off and `initdb --no-sync`. full_page_writes stays on either way: pg_rewind, which a
    /// killed primary needs to rejoin, requires it.
    pub fn durable(mut self, durable: bool) -> Self {
        self.durable = durable;
        self
    }

    /// Makes the cluster's temp dir under `dir` rather than the system temp dir.
    pub fn temp_dir_in(mut self, dir: impl Into<PathBuf>) -> Self {
        self.temp_dir_in = Some(dir.into());
        self
    }

    /// A server setting on every member, after the builder's own so that it wins.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Starts etcd and every member, and waits until a primary accepts writes and every
    /// standby streams from it (in synchronous mode: one of them as the synchronous standby).
    pub async fn start(self) -> Result<PatroniCluster, LaunchError> {
        if self.members == 0 {
            return Err(LaunchError::Patroni("a cluster needs a member".into()));
        }
        for program in [PYTHON, PATRONI] {
            if !Path::new(program).exists() {
                return Err(LaunchError::Patroni(format!(
                    "{program} not found; install it: apt-get install patroni python3-etcd"
                )));
            }
        }
        let bin_dir = railguard::db::server::find_bin_dir().await?;
        let run_as = run_as()?;
        let mut etcd = EtcdCluster::builder();
        if let Some(parent) = &self.temp_dir_in {
            etcd = etcd.temp_dir_in(parent);
        }
        let etcd = etcd.start().await?;

        let mut temp = tempfile::Builder::new();
        temp.prefix("railguard-patroni-");
        let dir = match &self.temp_dir_in {
            Some(parent) => temp.tempdir_in(parent),
            None => temp.tempdir(),
        }
        .map_err(io("cannot create the Patroni cluster's temp dir"))?;
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 2 * self.members {
            let port = free_loopback_port();
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        let scope = unique_scope();
        let etcd_host = etcd.endpoint(0).trim_start_matches("http://").to_string();
        let mut members = Vec::new();
        for (i, pair) in ports.chunks(2).enumerate() {
            let member = Member {
                name: format!("m{i}"),
                pg_port: pair[0],
                rest_port: pair[1],
                dir: dir.path().join(format!("m{i}")),
                patroni: None,
            };
            std::fs::create_dir(&member.dir).map_err(io("cannot create a member's dir"))?;
            let config = self.config(&scope, &etcd_host, &bin_dir, &member);
            std::fs::write(member.config_path(), config.to_string())
                .map_err(io("cannot write a member's Patroni configuration"))?;
            if let Some((uid, gid)) = run_as {
                // The data directory's parent must be the server user's.
                std::os::unix::fs::chown(&member.dir, Some(uid), Some(gid))
                    .map_err(io("cannot hand a member's dir to the postgres user"))?;
            }
            members.push(member);
        }
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .map_err(io("cannot hand the cluster's dir to the postgres user"))?;
        }
        let mut cluster = PatroniCluster {
            members,
            synchronous_mode: self.synchronous_mode,
            paused: Vec::new(),
            http: Http::new(),
            etcd,
            dir,
        };
        for i in 0..cluster.members.len() {
            cluster.spawn(i).map_err(LaunchError::Patroni)?;
        }
        cluster
            .try_wait_healthy(BOOTSTRAP_TIMEOUT)
            .await
            .map_err(LaunchError::Patroni)?;
        Ok(cluster)
    }

    /// One member's Patroni configuration. JSON is YAML, so it is written as JSON.
    fn config(&self, scope: &str, etcd_host: &str, bin_dir: &Path, member: &Member) -> Value {
        let mut parameters = serde_json::Map::new();
        parameters.insert("unix_socket_directories".into(), json!(member.dir));
        parameters.insert("wal_retrieve_retry_interval".into(), json!("500ms"));
        if !self.durable {
            parameters.insert("fsync".into(), json!("off"));
        }
        for (name, value) in &self.settings {
            parameters.insert(name.clone(), json!(value));
        }
        let mut initdb = vec![json!({"encoding": "UTF8"}), json!({"locale": "C"})];
        if !self.durable {
            initdb.push(json!("no-sync"));
        }
        let rest = format!("127.0.0.1:{}", member.rest_port);
        let pg = format!("127.0.0.1:{}", member.pg_port);
        json!({
            "scope": scope,
            "name": member.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": rest, "connect_address": rest},
            "etcd3": {"hosts": [etcd_host], "protocol": "http"},
            "bootstrap": {
                "dcs": {
                    "ttl": 10,
                    "loop_wait": 2,
                    "retry_timeout": 5,
                    "synchronous_mode": self.synchronous_mode,
                    "postgresql": {"use_pg_rewind": true, "use_slots": true},
                },
                "initdb": initdb,
            },
            "postgresql": {
                "listen": pg,
                "connect_address": pg,
                "data_dir": member.data_dir(),
                "bin_dir": bin_dir,
                "pgpass": member.dir.join("pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER},
                    "replication": {"username": REPLICATION_USER},
                },
                "parameters": parameters,
                "pg_hba": [
                    "host replication all 127.0.0.1/32 trust",
                    "host all all 127.0.0.1/32 trust",
                    "local all all trust",
                ],
                "basebackup": [{"checkpoint": "fast"}],
                "remove_data_directory_on_rewind_failure": true,
                "remove_data_directory_on_diverged_timelines": true,
            },
            "watchdog": {"mode": "off"},
        })
    }
}

impl PatroniCluster {
    pub fn builder() -> PatroniBuilder {
        PatroniBuilder::default()
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// A URL naming every member with `target_session_attrs=read-write`, as a client of a real
    /// deployment would hold it: a connection reaches whichever member is primary now.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.pg_port))
            .collect();
        format!(
            "postgres://{SUPERUSER}@{}/postgres?target_session_attrs=read-write",
            hosts.join(",")
        )
    }

    /// Member `i`'s own URL, whatever its role.
    pub fn member_url(&self, i: usize) -> String {
        self.members[i].url()
    }

    /// Member `i`'s Patroni name (`m0`, `m1`, ...), its `application_name` on the primary.
    pub fn member_name(&self, i: usize) -> &str {
        &self.members[i].name
    }

    /// The configuration store's etcd, e.g. to pause it.
    pub fn etcd(&self) -> &EtcdCluster {
        &self.etcd
    }

    /// Member `i`'s log: Patroni's and its PostgreSQL's, every run appended.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.members[i].log_path()).unwrap_or_default()
    }

    /// Whether member `i` runs: started, and not killed since.
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].patroni.is_some()
    }

    /// A connection through [`url`](Self::url): to the primary.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url())
            .await
            .unwrap_or_else(|e| panic!("connect to the Patroni cluster's primary: {e}"))
    }

    /// A connection to member `i`, primary or standby.
    pub async fn member_client(&self, i: usize) -> tokio_postgres::Client {
        connect(&self.member_url(i))
            .await
            .unwrap_or_else(|e| panic!("connect to Patroni member {i}: {e}"))
    }

    /// The member that is primary now: Patroni holds the leader lock there (`GET /primary`
    /// answers 200) and its PostgreSQL accepts writes. Waits for one; panics after a bounded
    /// wait.
    pub async fn primary(&self) -> usize {
        let deadline = Instant::now() + PRIMARY_TIMEOUT;
        loop {
            if let Some(primary) = self.try_primary(None).await {
                return primary;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no Patroni primary after {PRIMARY_TIMEOUT:?}\n{}",
                    self.report().await
                );
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    /// One look for a writable primary other than `except`.
    async fn try_primary(&self, except: Option<usize>) -> Option<usize> {
        for i in 0..self.members.len() {
            if Some(i) == except || !self.is_running(i) {
                continue;
            }
            if self.rest_status(i, "/primary").await == Some(StatusCode::OK)
                && self.writable(i).await
            {
                return Some(i);
            }
        }
        None
    }

    /// Waits until a member other than `old` is primary and accepts writes (Patroni promoted
    /// it); panics after `limit`.
    pub async fn wait_for_new_primary(&self, old: usize, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(primary) = self.try_primary(Some(old)).await {
                return primary;
            }
            if Instant::now() >= deadline {
                panic!(
                    "no new Patroni primary (other than member {old}) after {limit:?}\n{}",
                    self.report().await
                );
            }
            sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until a primary accepts writes and every running member other than it streams
    /// from it (in synchronous mode: one of them synchronously); returns the primary. Panics
    /// after `limit`.
    pub async fn wait_healthy(&mut self, limit: Duration) -> usize {
        self.try_wait_healthy(limit)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn try_wait_healthy(&mut self, limit: Duration) -> Result<usize, String> {
        let deadline = Instant::now() + limit;
        loop {
            for i in 0..self.members.len() {
                let member = &mut self.members[i];
                let Some(child) = member.patroni.as_mut() else {
                    continue;
                };
                if let Ok(Some(status)) = child.try_wait() {
                    member.patroni = None;
                    return Err(format!(
                        "Patroni member {i} exited ({status}):\n{}",
                        member.log_tail(40)
                    ));
                }
            }
            if let Some(primary) = self.try_primary(None).await
                && self.replicating(primary).await
            {
                return Ok(primary);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the Patroni cluster has no writable primary with every standby streaming \
                     after {limit:?}\n{}",
                    self.report().await
                ));
            }
            sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether every running member other than `primary` streams from it, as
    /// `pg_stat_replication` on the primary shows (by `application_name`, the member's name),
    /// and in synchronous mode one of them is the synchronous standby.
    async fn replicating(&self, primary: usize) -> bool {
        let Ok(rows) = self.replication_rows(primary).await else {
            return false;
        };
        let standbys: Vec<&str> = (0..self.members.len())
            .filter(|&i| i != primary && self.is_running(i))
            .map(|i| self.member_name(i))
            .collect();
        let streaming = standbys.iter().all(|name| {
            rows.iter()
                .any(|(n, state, _)| n == name && state == "streaming")
        });
        if !streaming {
            return false;
        }
        if !self.synchronous_mode || standbys.is_empty() {
            return true;
        }
        // Synchronous for PostgreSQL, and for Patroni too: it records its synchronous standby
        // in etcd a loop later, and until then refuses a switchover to it.
        if !rows.iter().any(|(_, _, sync)| sync == "sync") {
            return false;
        }
        for i in 0..self.members.len() {
            if i != primary
                && self.is_running(i)
                && self.rest_status(i, "/sync").await == Some(StatusCode::OK)
            {
                return true;
            }
        }
        false
    }

    /// `(application_name, state, sync_state)` of every walsender of member `i`.
    async fn replication_rows(&self, i: usize) -> Result<Vec<(String, String, String)>, String> {
        let client = connect(&self.member_url(i)).await?;
        let rows = timeout(
            REQUEST_TIMEOUT,
            client.query(
                "SELECT application_name, coalesce(state, ''), coalesce(sync_state, '') \
                 FROM pg_stat_replication",
                &[],
            ),
        )
        .await
        .map_err(|_| "pg_stat_replication: no answer".to_string())?
        .map_err(|e| e.to_string())?;
        Ok(rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect())
    }

    /// Waits until every standby has replayed everything the primary has written so far, so
    /// that a commit made before the call survives any failover, even asynchronous.
    pub async fn wait_caught_up(&self, limit: Duration) {
        let primary = self.primary().await;
        let client = self.member_client(primary).await;
        let deadline = Instant::now() + limit;
        let target: String = client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .expect("read the primary's WAL position")
            .get(0);
        loop {
            let behind: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_stat_replication \
                     WHERE replay_lsn IS NULL OR replay_lsn < $1::text::pg_lsn",
                    &[&target],
                )
                .await
                .expect("read pg_stat_replication")
                .get(0);
            let standbys = (0..self.members.len())
                .filter(|&i| i != primary && self.is_running(i))
                .count();
            let connected: i64 = client
                .query_one("SELECT count(*) FROM pg_stat_replication", &[])
                .await
                .expect("read pg_stat_replication")
                .get(0);
            if behind == 0 && connected as usize >= standbys {
                return;
            }
            if Instant::now() >= deadline {
                panic!("standbys have not replayed up to {target} after {limit:?}");
            }
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// Hard failover: kills the primary's Patroni, postmaster and every PostgreSQL process of
    /// it with SIGKILL, as a machine crash would; returns which member it was. The standbys
    /// promote one of them once the leader key expires (Patroni's ttl, 10 s).
    pub async fn kill_primary(&mut self) -> usize {
        let primary = self.primary().await;
        self.kill_member(primary).await;
        primary
    }

    /// SIGKILL to member `i`'s Patroni and PostgreSQL, all at one instant: the postmaster and
    /// its children are stopped first, so none of them acts after Patroni is gone.
    pub async fn kill_member(&mut self, i: usize) {
        let member = &mut self.members[i];
        let mut postgres = Vec::new();
        if let Some(postmaster) = member.postmaster_pid() {
            signal(postmaster, "STOP").await;
            postgres.push(postmaster);
            postgres.extend(children_of(postmaster));
            for &pid in &postgres[1..] {
                signal(pid, "STOP").await;
            }
        }
        if let Some(mut child) = member.patroni.take() {
            let _ = child.kill().await;
        }
        for &pid in &postgres {
            signal(pid, "KILL").await;
        }
        self.paused.retain(|pid| !postgres.contains(pid));
        // Whatever else runs in the member's directory (pg_basebackup, pg_rewind, a backend
        // forked a moment ago) goes too; then wait until all are gone, so that a restart finds
        // no shared memory still attached.
        let dir = self.members[i].dir.clone();
        let deadline = Instant::now() + KILL_TIMEOUT;
        loop {
            let left: Vec<u32> = processes_in(&dir)
                .into_iter()
                .chain(postgres.iter().copied().filter(|&pid| alive(pid)))
                .collect();
            if left.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                panic!("member {i}'s processes {left:?} still run after SIGKILL");
            }
            for pid in left {
                signal(pid, "KILL").await;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts member `i`'s Patroni again after a kill, on its ports and data directory, and
    /// waits until it streams from the primary as a standby (rewound with pg_rewind if it had
    /// commits the primary lacks). Returns the primary.
    pub async fn restart_member(&mut self, i: usize) -> usize {
        assert!(!self.is_running(i), "member {i} is running");
        self.spawn(i).unwrap_or_else(|e| panic!("{e}"));
        self.wait_healthy(REJOIN_TIMEOUT).await
    }

    /// Planned switchover through Patroni's REST API (`POST /switchover` on the leader, to a
    /// streaming standby, in synchronous mode the synchronous one); waits until the new
    /// primary accepts writes and the old one streams from it. Returns the new primary.
    pub async fn switchover(&mut self) -> usize {
        let old = self.primary().await;
        let rows = self.replication_rows(old).await.unwrap_or_default();
        let candidate = (0..self.members.len())
            .filter(|&i| i != old && self.is_running(i))
            .find(|&i| {
                rows.iter().any(|(name, state, sync)| {
                    name == self.member_name(i)
                        && state == "streaming"
                        && (!self.synchronous_mode || sync == "sync")
                })
            })
            .unwrap_or_else(|| panic!("no standby to switch over to: {rows:?}"));
        let body = json!({
            "leader": self.member_name(old),
            "candidate": self.member_name(candidate),
        });
        let deadline = Instant::now() + SWITCHOVER_TIMEOUT;
        loop {
            // Patroni refuses (412, 503) while it thinks the candidate unfit; ask again.
            match self.rest_post(old, "/switchover", body.clone()).await {
                Ok((StatusCode::OK, _)) => break,
                Ok((status, reply)) if Instant::now() >= deadline => {
                    panic!("Patroni refused the switchover: {status}: {reply}")
                }
                Err(e) if Instant::now() >= deadline => panic!("switchover request: {e}"),
                _ => sleep(Duration::from_millis(250)).await,
            }
        }
        let new = self
            .wait_for_new_primary(old, deadline.saturating_duration_since(Instant::now()))
            .await;
        let primary = self.wait_healthy(REJOIN_TIMEOUT).await;
        assert_eq!(
            primary, new,
            "the primary changed again after the switchover"
        );
        new
    }

    /// The async-loss case, first half: SIGSTOP every walsender of the primary, so that what
    /// it commits from now on reaches no standby while clients are told it is committed (the
    /// standbys' walreceivers stay connected and notice nothing). Then commit, then
    /// [`kill_primary`](Self::kill_primary): the promoted standby lacks those commits.
    /// Returns the primary. In synchronous mode commits wait instead, unacknowledged.
    pub async fn pause_replication(&mut self) -> usize {
        let primary = self.primary().await;
        let postmaster = self.members[primary]
            .postmaster_pid()
            .unwrap_or_else(|| panic!("member {primary} has no running postmaster"));
        let walsenders: Vec<u32> = children_of(postmaster)
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("walsender"))
            })
            .collect();
        assert!(
            !walsenders.is_empty(),
            "the primary (member {primary}) has no walsender to pause"
        );
        for &pid in &walsenders {
            assert!(signal(pid, "STOP").await, "kill -STOP {pid} failed");
        }
        self.paused.extend(walsenders);
        primary
    }

    /// SIGCONT after [`pause_replication`](Self::pause_replication): the standbys catch up.
    pub async fn resume_replication(&mut self) {
        for pid in std::mem::take(&mut self.paused) {
            signal(pid, "CONT").await;
        }
    }

    /// The current primary's timeline, from the name of the WAL file it writes now (which
    /// changes at promotion, before `pg_control_checkpoint()` does).
    pub async fn timeline(&self) -> i64 {
        let primary = self.primary().await;
        let name: String = self
            .member_client(primary)
            .await
            .query_one("SELECT pg_walfile_name(pg_current_wal_lsn())", &[])
            .await
            .expect("read the primary's WAL file name")
            .get(0);
        i64::from_str_radix(&name[..8], 16)
            .unwrap_or_else(|_| panic!("not a WAL file name: {name}"))
    }

    /// The current primary's database system identifier, which every physical replica shares
    /// and a failover keeps.
    pub async fn system_identifier(&self) -> i64 {
        let primary = self.primary().await;
        self.member_client(primary)
            .await
            .query_one("SELECT system_identifier FROM pg_control_system()", &[])
            .await
            .expect("read the system identifier")
            .get(0)
    }

    fn spawn(&mut self, i: usize) -> Result<(), String> {
        let run_as = run_as().map_err(|e| e.to_string())?;
        let member = &mut self.members[i];
        if member.patroni.is_some() {
            return Err(format!("member {i} is already running"));
        }
        let log_error = |e: std::io::Error| format!("member {i}'s log file: {e}");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(member.log_path())
            .map_err(log_error)?;
        let mut command = Command::new(PYTHON);
        command
            .arg(PATRONI)
            .arg(member.config_path())
            .current_dir(&member.dir)
            // Neither a Python environment nor PATRONI_* settings of the caller's.
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", &member.dir)
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(log_error)?)
            .stderr(log)
            .kill_on_drop(true)
            .process_group(0);
        if let Some((uid, gid)) = run_as {
            command.uid(uid).gid(gid);
        }
        let child = command
            .spawn()
            .map_err(|e| format!("cannot start {PATRONI} (Debian package patroni): {e}"))?;
        member.patroni = Some(child);
        Ok(())
    }

    /// Whether member `i` accepts a write now (assigning a transaction id fails in recovery).
    async fn writable(&self, i: usize) -> bool {
        let probe = async {
            let client = connect(&self.member_url(i)).await.ok()?;
            client.query_one("SELECT txid_current()", &[]).await.ok()
        };
        matches!(timeout(REQUEST_TIMEOUT, probe).await, Ok(Some(_)))
    }

    async fn rest_status(&self, i: usize, path: &str) -> Option<StatusCode> {
        let url = self.members[i].rest_url(path);
        match timeout(REQUEST_TIMEOUT, self.http.get(&url)).await {
            Ok(Ok((status, _))) => Some(status),
            _ => None,
        }
    }

    async fn rest_post(
        &self,
        i: usize,
        path: &str,
        body: Value,
    ) -> Result<(StatusCode, String), String> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(self.members[i].rest_url(path))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        // A switchover answers once it is done, which takes a few seconds.
        let reply = timeout(SWITCHOVER_TIMEOUT, self.http.send(request))
            .await
            .map_err(|_| format!("no answer within {SWITCHOVER_TIMEOUT:?}"))??;
        Ok((reply.status, reply.body))
    }

    /// Each member's Patroni state and its log's tail, for a failure message.
    async fn report(&self) -> String {
        let mut report = String::new();
        for (i, member) in self.members.iter().enumerate() {
            let state = if member.patroni.is_none() {
                "killed".to_string()
            } else {
                match timeout(REQUEST_TIMEOUT, self.http.get(&member.rest_url("/patroni"))).await {
                    Ok(Ok((status, body))) => format!("{status} {body}"),
                    Ok(Err(e)) => format!("REST API: {e}"),
                    Err(_) => "REST API: no answer".into(),
                }
            };
            report.push_str(&format!(
                "--- member {i} ({}): {state}\n{}\n",
                member.name,
                member.log_tail(25)
            ));
        }
        report
    }
}

impl Drop for PatroniCluster {
    /// Kills every process of the cluster: each Patroni, then everything running in the
    /// cluster's directory (postmasters, backends, walsenders, base backups), stopped before
    /// being killed so that none forks a new one meanwhile. Then etcd and the temp dir go.
    fn drop(&mut self) {
        for member in &mut self.members {
            if let Some(child) = member.patroni.as_mut() {
                let _ = child.start_kill();
            }
        }
        for _ in 0..200 {
            let pids = processes_in(self.dir.path());
            if pids.is_empty() {
                break;
            }
            kill_now("STOP", &pids);
            let pids = processes_in(self.dir.path());
            kill_now("KILL", &pids);
        }
    }
}

/// Pids of the live processes whose working directory is `dir` or lies below it.
fn processes_in(dir: &Path) -> Vec<u32> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let dir = dir.to_string_lossy().into_owned();
    let below = format!("{dir}/");
    let deleted = format!("{dir} (deleted)");
    crate::process::pids_where(|pid, proc_dir| {
        let cwd = std::fs::read_link(proc_dir.join("cwd")).ok()?;
        let cwd = cwd.to_string_lossy();
        Some(
            (cwd == dir.as_str() || cwd.starts_with(&below) || cwd == deleted.as_str())
                && alive(pid),
        )
    })
}

/// Whether `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|end| stat[end + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X") | None)
}

/// `kill -<name> pids...`, blocking: for `Drop`, which cannot await.
fn kill_now(name: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .args(pids.iter().map(u32::to_string))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A connection to `url`, without TLS, within [`REQUEST_TIMEOUT`].
async fn connect(url: &str) -> Result<tokio_postgres::Client, String> {
    let (client, conn) = timeout(
        REQUEST_TIMEOUT,
        tokio_postgres::connect(url, tokio_postgres::NoTls),
    )
    .await
    .map_err(|_| format!("{url}: no answer within {REQUEST_TIMEOUT:?}"))?
    .map_err(|e| match std::error::Error::source(&e) {
        Some(cause) => format!("{url}: {e}: {cause}"),
        None => format!("{url}: {e}"),
    })?;
    tokio::spawn(conn);
    Ok(client)
}

/// The `postgres` user's uid and gid when we are root (PostgreSQL refuses root); `None` when
/// we are not, and the members run as we do.
fn run_as() -> Result<Option<(u32, u32)>, LaunchError> {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if !root {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(io("cannot read /etc/passwd"))?;
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() < 4 || fields[0] != "postgres" {
                return None;
            }
            Some((fields[2].parse().ok()?, fields[3].parse().ok()?))
        })
        .map(Some)
        .ok_or_else(|| {
            LaunchError::Patroni(
                "running as root and no `postgres` user to run PostgreSQL as; \
                 apt-get install postgresql creates it"
                    .into(),
            )
        })
}

/// A Patroni scope no other cluster on this machine uses: a scope seen before (in an etcd
/// that outlived its data directories) waits forever for its leader to bootstrap.
fn unique_scope() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "railguard-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn io(what: &str) -> impl Fn(std::io::Error) -> LaunchError + '_ {
    move |source| LaunchError::Io {
        what: what.to_string(),
        source,
    }
}
