//! Throwaway etcd clusters from Debian's `etcd-server` binary (3.4), for tests that must kill,
//! stop, pause and restart members, and for the benchmark's etcd suite.
//!
//! Every member listens on free loopback ports and keeps its data and its log in its own temp
//! dir. Timings are small (25 ms heartbeat, 250 ms election timeout) so elections take well
//! under a second and the minimum lease TTL is one second. etcd 3.4 has no switch to turn its
//! fsyncs off: a member whose temp dir is on a disk ([`EtcdBuilder::temp_dir_in`]) pays them
//! as in production.
//!
//! Tests talk to the cluster through etcd's v3 JSON gateway on the client URL: bytes travel as
//! base64 and 64-bit integers as decimal strings, and fields with zero values are omitted.
//! Leases are read the same way, and counted from a member's own `/metrics`, so that a test
//! can tell how many leases railguard granted and revoked, not only which exist now.
//!
//! A cluster can be put back in time with `etcdctl` (Debian's `etcd-client`):
//! [`EtcdCluster::snapshot`] saves a snapshot while the cluster serves, and
//! [`EtcdCluster::restore`] stops every member and restores each from it into a fresh data
//! directory, with the name, peer URL, initial cluster and cluster token it was started with,
//! then starts them again on the same ports. Every write made after the snapshot is gone and
//! the revision is back where it was (etcd 3.4 has no `--bump-revision`).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::free_loopback_port;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};

use crate::process::signal;
use crate::{Http, LaunchError};

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
/// How long a whole cluster (or a restarted member) may take to report healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long `leader()` waits for the responsive members to agree on a leader.
const LEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one gateway request may take; a paused member never answers.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `get`, `put_raw` and `revision` keep retrying across members (elections).
const KV_TIMEOUT: Duration = Duration::from_secs(10);
/// The backend quota of a test cluster: a runaway test fills its disk no further.
const TEST_QUOTA_BACKEND_BYTES: u64 = 256 << 20;

/// A running etcd cluster of one or three members.
pub struct EtcdCluster {
    members: Vec<Member>,
    token: String,
    quota_backend_bytes: Option<u64>,
    http: Http,
}

/// A snapshot of an [`EtcdCluster`]'s keyspace (`etcdctl snapshot save`), to restore with
/// [`EtcdCluster::restore`]. Removed when dropped.
#[derive(Debug)]
pub struct EtcdSnapshot {
    dir: TempDir,
    /// The cluster's revision in the snapshot: a restored cluster is back at it.
    pub revision: i64,
    /// When the snapshot was complete.
    pub taken: Instant,
}

impl EtcdSnapshot {
    fn path(&self) -> PathBuf {
        self.dir.path().join("snapshot.db")
    }
}

/// Lease operations one etcd member has counted (`etcd_debugging_lease_*_total`). `revoked`
/// includes leases revoked because they expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCounts {
    pub granted: u64,
    pub revoked: u64,
    pub renewed: u64,
}

/// How to start an [`EtcdCluster`]; [`EtcdCluster::single`] and [`EtcdCluster::three`] are
/// the defaults for one and three members.
#[derive(Debug, Clone)]
pub struct EtcdBuilder {
    members: usize,
    temp_dir_in: Option<PathBuf>,
    quota_backend_bytes: Option<u64>,
}

impl Default for EtcdBuilder {
    fn default() -> Self {
        EtcdBuilder {
            members: 1,
            temp_dir_in: None,
            quota_backend_bytes: Some(TEST_QUOTA_BACKEND_BYTES),
        }
    }
}

impl EtcdBuilder {
    /// How many members (default 1).
    pub fn members(mut self, members: usize) -> Self {
        self.members = members;
        self
    }

    /// Makes the members' temp dirs under `dir` rather than the system temp dir (which may be
    /// a tmpfs, where fsync costs nothing).
    pub fn temp_dir_in(mut self, dir: impl Into<PathBuf>) -> Self {
        self.temp_dir_in = Some(dir.into());
        self
    }

    /// `--quota-backend-bytes`: 256 MiB unless set; `None` leaves etcd's own default (2 GiB),
    /// for a long run that writes without ever compacting, like the benchmark's.
    pub fn quota_backend_bytes(mut self, bytes: Option<u64>) -> Self {
        self.quota_backend_bytes = bytes;
        self
    }

    /// Starts every member and waits until all are healthy (so a leader has been elected).
    pub async fn start(self) -> Result<EtcdCluster, LaunchError> {
        if self.members == 0 {
            return Err(LaunchError::Etcd("a cluster needs a member".into()));
        }
        // Ports must differ within a cluster; free_loopback_port only promises "free now".
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 2 * self.members {
            let port = free_loopback_port();
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        let mut members = Vec::new();
        for (i, pair) in ports.chunks(2).enumerate() {
            let mut temp = tempfile::Builder::new();
            temp.prefix("railguard-etcd-");
            let dir = match &self.temp_dir_in {
                Some(parent) => temp.tempdir_in(parent),
                None => temp.tempdir(),
            }
            .map_err(|source| LaunchError::Io {
                what: "cannot create an etcd member's temp dir".into(),
                source,
            })?;
            members.push(Member {
                name: format!("m{i}"),
                client_port: pair[0],
                peer_port: pair[1],
                child: None,
                paused: false,
                dir,
            });
        }
        let mut cluster = EtcdCluster {
            members,
            token: cluster_token(),
            quota_backend_bytes: self.quota_backend_bytes,
            http: Http::new(),
        };
        for i in 0..self.members {
            cluster.spawn(i, "new").map_err(LaunchError::Etcd)?;
        }
        for i in 0..self.members {
            cluster.wait_healthy(i).await.map_err(LaunchError::Etcd)?;
        }
        Ok(cluster)
    }
}

/// What one member is doing, as far as the harness has made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    Running,
    Paused,
    Stopped,
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    // Dropped before `dir`: kill_on_drop sends SIGKILL (which also ends a paused process),
    // then the data dir is removed.
    child: Option<Child>,
    paused: bool,
    dir: TempDir,
}

impl Member {
    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    fn state(&self) -> MemberState {
        match (&self.child, self.paused) {
            (None, _) => MemberState::Stopped,
            (Some(_), true) => MemberState::Paused,
            (Some(_), false) => MemberState::Running,
        }
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl EtcdCluster {
    /// One member, healthy. Panics if it cannot start.
    pub async fn single() -> EtcdCluster {
        EtcdCluster::launch(EtcdCluster::builder()).await
    }

    /// Three members, all healthy (so a leader has been elected). Panics if they cannot start.
    pub async fn three() -> EtcdCluster {
        EtcdCluster::launch(EtcdCluster::builder().members(3)).await
    }

    pub fn builder() -> EtcdBuilder {
        EtcdBuilder::default()
    }

    async fn launch(builder: EtcdBuilder) -> EtcdCluster {
        builder.start().await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// `3.4.23`, from `etcd --version`; `unknown` if it cannot be run.
    pub async fn version() -> String {
        match Command::new(ETCD).arg("--version").output().await {
            Ok(out) => String::from_utf8_lossy(&out.stdout)
                .lines()
                .find_map(|l| l.strip_prefix("etcd Version: "))
                .unwrap_or("unknown")
                .trim()
                .to_string(),
            Err(_) => "unknown".into(),
        }
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize, state: &str) -> Result<(), String> {
        let initial_cluster = self.initial_cluster();
        let token = self.token.clone();
        let quota = self.quota_backend_bytes;
        let member = &mut self.members[i];
        if member.child.is_some() {
            return Err(format!("member {i} is already running"));
        }
        let log_error = |e: std::io::Error| format!("member {i}'s log file: {e}");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(member.log_path())
            .map_err(log_error)?;
        let endpoint = member.endpoint();
        let peer = member.peer_url();
        let mut command = Command::new(ETCD);
        command
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(member.data_dir())
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", &token])
            // etcd requires election-timeout >= 5 × heartbeat-interval. The minimum lease TTL
            // is 1.5 election timeouts rounded up to a second: 1 s here.
            .args(["--heartbeat-interval", "25", "--election-timeout", "250"])
            .args(["--logger", "zap", "--log-level", "warn"]);
        if let Some(bytes) = quota {
            command.args(["--quota-backend-bytes", &bytes.to_string()]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(log_error)?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {ETCD} (Debian package etcd-server): {e}"))?;
        member.child = Some(child);
        member.paused = false;
        Ok(())
    }

    /// Polls `/health` on member `i` until it says `{"health":"true"}`; fails with the
    /// member's log tail if it exits or the timeout passes.
    async fn wait_healthy(&mut self, i: usize) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let member = &mut self.members[i];
            let Some(child) = member.child.as_mut() else {
                return Err(format!("member {i} is not running"));
            };
            if let Ok(Some(status)) = child.try_wait() {
                member.child = None;
                return Err(format!(
                    "member {i} exited during start-up ({status}):\n{}",
                    member.log_tail()
                ));
            }
            if self.healthy(i).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "member {i} not healthy after {READY_TIMEOUT:?}:\n{}",
                    self.members[i].log_tail()
                ));
            }
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether member `i` answers `/health` with `{"health":"true"}` right now.
    pub async fn healthy(&self, i: usize) -> bool {
        let url = format!("{}/health", self.members[i].endpoint());
        let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        match timeout(REQUEST_TIMEOUT, self.http.send(request)).await {
            Ok(Ok(reply)) if reply.status == StatusCode::OK => {
                serde_json::from_str::<Value>(&reply.body)
                    .is_ok_and(|v| v["health"].as_str() == Some("true"))
            }
            _ => false,
        }
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The client URL of every member, running or not, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::endpoint).collect()
    }

    /// [`endpoints`](Self::endpoints), comma-separated (etcdctl's `--endpoints` form).
    pub fn endpoints_csv(&self) -> String {
        self.endpoints().join(",")
    }

    /// The client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> String {
        self.members[i].endpoint()
    }

    pub fn state(&self, i: usize) -> MemberState {
        self.members[i].state()
    }

    /// Member `i`'s log (stdout and stderr, every run appended).
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.members[i].log_path()).unwrap_or_default()
    }

    /// SIGTERM, then wait for the process to exit. A leader hands over leadership first.
    pub async fn stop(&mut self, i: usize) -> std::process::ExitStatus {
        let member = &mut self.members[i];
        let mut child = member.child.take().expect("member is running");
        let pid = child.id().expect("child pid");
        must_signal(pid, "TERM").await;
        if member.paused {
            // A stopped process only acts on SIGTERM once it is continued.
            must_signal(pid, "CONT").await;
            member.paused = false;
        }
        timeout(Duration::from_secs(20), child.wait())
            .await
            .unwrap_or_else(|_| panic!("etcd member {i} exits after SIGTERM"))
            .expect("wait for etcd")
    }

    /// SIGKILL: a crash. Also works on a paused member.
    pub async fn kill(&mut self, i: usize) {
        let member = &mut self.members[i];
        let mut child = member.child.take().expect("member is running");
        child.kill().await.expect("SIGKILL etcd");
        member.paused = false;
    }

    /// Restarts member `i` after `stop` or `kill`, on the same ports and data dir, and waits
    /// until it is healthy again (in a three-member cluster: rejoined and sees a leader).
    pub async fn start(&mut self, i: usize) {
        // With an existing data dir etcd ignores the initial-cluster flags.
        let started = match self.spawn(i, "existing") {
            Ok(()) => self.wait_healthy(i).await,
            Err(e) => Err(e),
        };
        if let Err(e) = started {
            panic!("etcd: {e}");
        }
    }

    /// Saves a snapshot of the keyspace from a running member, while the cluster serves.
    pub async fn snapshot(&self) -> Result<EtcdSnapshot, String> {
        let i = (0..self.members.len())
            .find(|i| self.state(*i) == MemberState::Running)
            .ok_or("no running etcd member to take a snapshot from")?;
        let dir = tempfile::Builder::new()
            .prefix("railguard-etcd-snapshot-")
            .tempdir()
            .map_err(|e| format!("cannot create the snapshot's temp dir: {e}"))?;
        let mut snapshot = EtcdSnapshot {
            dir,
            revision: 0,
            taken: Instant::now(),
        };
        let path = snapshot.path();
        etcdctl(&[
            "--endpoints",
            &self.members[i].endpoint(),
            "snapshot",
            "save",
            path.to_str().ok_or("snapshot path is not UTF-8")?,
        ])
        .await?;
        snapshot.taken = Instant::now();
        let status = etcdctl(&[
            "snapshot",
            "status",
            path.to_str().ok_or("snapshot path is not UTF-8")?,
            "--write-out",
            "json",
        ])
        .await?;
        snapshot.revision = serde_json::from_str::<Value>(&status)
            .ok()
            .and_then(|v| v["revision"].as_i64())
            .ok_or_else(|| format!("etcdctl snapshot status: no revision in {status}"))?;
        Ok(snapshot)
    }

    /// Restores the whole cluster from `snapshot`: SIGKILLs every member still running,
    /// replaces each data directory with `etcdctl snapshot restore` (same name, peer URL,
    /// initial cluster and cluster token as at the first start, so the member and cluster ids
    /// stay the same), starts every member on its old ports and waits until all are healthy.
    pub async fn restore(&mut self, snapshot: &EtcdSnapshot) -> Result<(), String> {
        let initial_cluster = self.initial_cluster();
        let path = snapshot.path();
        let path = path.to_str().ok_or("snapshot path is not UTF-8")?;
        for i in 0..self.members.len() {
            if self.state(i) != MemberState::Stopped {
                self.kill(i).await;
            }
            let member = &self.members[i];
            let data = member.data_dir();
            if data.exists() {
                std::fs::remove_dir_all(&data)
                    .map_err(|e| format!("cannot remove {}: {e}", data.display()))?;
            }
            etcdctl(&[
                "snapshot",
                "restore",
                path,
                "--name",
                &member.name,
                "--initial-cluster",
                &initial_cluster,
                "--initial-cluster-token",
                &self.token,
                "--initial-advertise-peer-urls",
                &member.peer_url(),
                "--data-dir",
                data.to_str().ok_or("data dir is not UTF-8")?,
            ])
            .await
            .map_err(|e| format!("member {i}: {e}"))?;
        }
        for i in 0..self.members.len() {
            self.spawn(i, "existing")?;
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i).await?;
        }
        Ok(())
    }

    /// Member `i`'s pid while it runs (paused included), e.g. to sample its CPU time.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].pid()
    }

    /// SIGSTOP: the member is frozen and its connections hang, as in a GC pause or a partition.
    pub async fn pause(&mut self, i: usize) {
        let member = &mut self.members[i];
        assert!(!member.paused, "member {i} is already paused");
        let pid = member.pid().expect("member is running");
        must_signal(pid, "STOP").await;
        member.paused = true;
    }

    /// SIGCONT after `pause`.
    pub async fn resume(&mut self, i: usize) {
        let member = &mut self.members[i];
        assert!(member.paused, "member {i} is not paused");
        let pid = member.pid().expect("member is running");
        must_signal(pid, "CONT").await;
        member.paused = false;
    }

    /// Which member is the leader: waits until every running, unpaused member answers
    /// `/v3/maintenance/status`, they all name the same leader, and that leader is one of them
    /// (its own `header.member_id` equals `leader`). Panics after a bounded wait.
    pub async fn leader(&self) -> usize {
        let deadline = Instant::now() + LEADER_TIMEOUT;
        loop {
            if let Some(leader) = self.try_leader().await {
                return leader;
            }
            if Instant::now() >= deadline {
                let mut report = String::new();
                for i in 0..self.members.len() {
                    report.push_str(&format!(
                        "member {i} ({:?}): {:?}\n",
                        self.state(i),
                        self.status(i).await
                    ));
                }
                panic!("no agreed etcd leader after {LEADER_TIMEOUT:?}:\n{report}");
            }
            sleep(Duration::from_millis(50)).await;
        }
    }

    /// One look at [`leader`](Self::leader): `None` while there is no agreed leader.
    pub async fn try_leader(&self) -> Option<usize> {
        let mut leader_id = None;
        let mut leader = None;
        for i in 0..self.members.len() {
            if self.state(i) != MemberState::Running {
                continue;
            }
            let (member_id, says) = self.status(i).await?;
            if says == 0 || leader_id.is_some_and(|id| id != says) {
                return None;
            }
            leader_id = Some(says);
            if member_id == says {
                leader = Some(i);
            }
        }
        leader
    }

    /// Member `i`'s `(member_id, leader_id)` from `/v3/maintenance/status`, if it answers.
    pub async fn status(&self, i: usize) -> Option<(u64, u64)> {
        let url = format!("{}/v3/maintenance/status", self.members[i].endpoint());
        let reply = self.post(&url, json!({})).await.ok()?;
        let member_id = uint(&reply["header"]["member_id"])?;
        let leader = uint(&reply["leader"]).unwrap_or(0);
        Some((member_id as u64, leader as u64))
    }

    /// Reads `key` straight from etcd (a linearizable range through the JSON gateway, on any
    /// running member): `(create_revision, mod_revision, value, lease)`, lease 0 when none.
    pub async fn get(&self, key: &str) -> Option<(i64, i64, String, i64)> {
        self.range(None, key).await
    }

    /// [`get`](Self::get) through member `i` only, e.g. to show a restarted member has caught
    /// up.
    pub async fn get_from(&self, i: usize, key: &str) -> Option<(i64, i64, String, i64)> {
        self.range(Some(i), key).await
    }

    async fn range(&self, only: Option<usize>, key: &str) -> Option<(i64, i64, String, i64)> {
        let body = json!({ "key": base64_encode(key.as_bytes()) });
        let reply = self.kv(only, "/v3/kv/range", body).await;
        // The gateway omits zero-valued fields: no `kvs` when absent, no `value` when empty,
        // no `lease` without a lease.
        let kv = reply["kvs"].as_array()?.first()?;
        let value = base64_decode(kv["value"].as_str().unwrap_or("")).expect("value is base64");
        Some((
            uint(&kv["create_revision"]).unwrap_or(0),
            uint(&kv["mod_revision"]).unwrap_or(0),
            String::from_utf8_lossy(&value).into_owned(),
            uint(&kv["lease"]).unwrap_or(0),
        ))
    }

    /// Writes `key` = `value` without a lease; returns the revision of the write. Retried on
    /// another member after an error, so a write whose reply was lost may apply twice.
    pub async fn put_raw(&self, key: &str, value: &str) -> i64 {
        let body = json!({
            "key": base64_encode(key.as_bytes()),
            "value": base64_encode(value.as_bytes()),
        });
        let reply = self.kv(None, "/v3/kv/put", body).await;
        uint(&reply["header"]["revision"]).expect("put reply has a revision")
    }

    /// Writes `key` = `value` attached to lease `lease`; returns the revision of the write.
    pub async fn put_with_lease(&self, key: &str, value: &str, lease: i64) -> i64 {
        let body = json!({
            "key": base64_encode(key.as_bytes()),
            "value": base64_encode(value.as_bytes()),
            "lease": lease.to_string(),
        });
        let reply = self.kv(None, "/v3/kv/put", body).await;
        uint(&reply["header"]["revision"]).expect("put reply has a revision")
    }

    /// The cluster's current revision (1 on a fresh cluster).
    pub async fn revision(&self) -> i64 {
        let probe = base64_encode(b"railguard-test-revision-probe");
        let reply = self.kv(None, "/v3/kv/range", json!({ "key": probe })).await;
        uint(&reply["header"]["revision"]).expect("range reply has a revision")
    }

    /// [`revision`](Self::revision) in one try on the running members: `None` when none
    /// answers.
    pub async fn try_revision(&self) -> Option<i64> {
        let probe = base64_encode(b"railguard-test-revision-probe");
        for i in 0..self.members.len() {
            if self.state(i) != MemberState::Running {
                continue;
            }
            let url = format!("{}/v3/kv/range", self.members[i].endpoint());
            if let Ok(reply) = self.post(&url, json!({ "key": probe })).await {
                return uint(&reply["header"]["revision"]);
            }
        }
        None
    }

    /// The ids of every lease that exists now (granted, neither revoked nor expired), from
    /// `/v3/lease/leases`, sorted.
    pub async fn leases(&self) -> Vec<i64> {
        let reply = self.kv(None, "/v3/lease/leases", json!({})).await;
        let mut ids: Vec<i64> = reply["leases"]
            .as_array()
            .map(|leases| leases.iter().filter_map(|l| uint(&l["ID"])).collect())
            .unwrap_or_default();
        ids.sort_unstable();
        ids
    }

    /// Lease `id`'s `(remaining, granted)` TTL in seconds from `/v3/lease/timetolive`, or `None`
    /// when it does not exist. etcd rounds the remaining TTL down to whole seconds, so a
    /// live lease may have 0 left.
    pub async fn lease_ttl(&self, id: i64) -> Option<(i64, i64)> {
        let reply = self
            .kv(
                None,
                "/v3/lease/timetolive",
                json!({ "ID": id.to_string() }),
            )
            .await;
        // A lease that is gone has TTL -1; one in its last second has TTL 0, which the
        // gateway omits like every zero.
        let remaining = match &reply["TTL"] {
            Value::Null => 0,
            Value::String(s) => s.parse::<i64>().expect("TTL is a decimal string"),
            other => other.as_i64().expect("TTL is a number"),
        };
        (remaining >= 0).then(|| (remaining, uint(&reply["grantedTTL"]).unwrap_or(0)))
    }

    /// Grants a lease of `ttl_secs` seconds (etcd may raise it to its minimum); returns its id.
    pub async fn grant_lease(&self, ttl_secs: i64) -> i64 {
        let body = json!({ "TTL": ttl_secs.to_string() });
        let reply = self.kv(None, "/v3/lease/grant", body).await;
        uint(&reply["ID"]).expect("grant reply has an ID")
    }

    /// Revokes lease `id` (deleting its keys), as its expiry would; true if it existed.
    pub async fn revoke_lease(&self, id: i64) -> bool {
        let body = json!({ "ID": id.to_string() });
        // The gateway answers a missing lease with a non-200 error, which `kv` would retry.
        for i in 0..self.members.len() {
            if self.state(i) != MemberState::Running {
                continue;
            }
            let url = format!("{}/v3/lease/revoke", self.members[i].endpoint());
            match self.post(&url, body.clone()).await {
                Ok(_) => return true,
                Err(e) if e.contains("requested lease not found") => return false,
                Err(_) => continue,
            }
        }
        panic!("no running etcd member revoked lease {id}");
    }

    /// Member `i`'s lease counters since it started, from its `/metrics`. Grants and revokes
    /// are counted by every member as it applies them; keep-alives only by the leader, so on
    /// a three-member cluster `renewed` is the leader's share.
    pub async fn lease_counts(&self, i: usize) -> LeaseCounts {
        let url = format!("{}/metrics", self.members[i].endpoint());
        let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        let reply = timeout(REQUEST_TIMEOUT, self.http.send(request))
            .await
            .unwrap_or_else(|_| panic!("etcd member {i} /metrics within {REQUEST_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("etcd member {i} /metrics: {e}"));
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
        // Read line by line: etcd also exposes summaries, which the strict
        // `Metrics` parser (made for railguard's own exposition) does not take.
        let count = |name: &str| {
            let name = format!("etcd_debugging_lease_{name}_total ");
            let value = reply
                .body
                .lines()
                .find_map(|line| line.strip_prefix(name.as_str()))
                .unwrap_or_else(|| panic!("etcd member {i} exposes no {name}"));
            value
                .trim()
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("{name}: not a number: {value}")) as u64
        };
        LeaseCounts {
            granted: count("granted"),
            revoked: count("revoked"),
            renewed: count("renewed"),
        }
    }

    /// Sends a KV request to the first running member (or only to member `only`) that answers
    /// 200, retrying (an election may be under way) until a bounded deadline.
    async fn kv(&self, only: Option<usize>, path: &str, body: Value) -> Value {
        let deadline = Instant::now() + KV_TIMEOUT;
        let mut errors = vec!["no running member".to_string()];
        loop {
            for i in 0..self.members.len() {
                if self.state(i) != MemberState::Running || only.is_some_and(|only| only != i) {
                    continue;
                }
                let url = format!("{}{path}", self.members[i].endpoint());
                match self.post(&url, body.clone()).await {
                    Ok(reply) => return reply,
                    Err(e) => errors.push(format!("member {i}: {e}")),
                }
            }
            if Instant::now() >= deadline {
                let last = &errors[errors.len().saturating_sub(6)..];
                panic!("etcd {path} failed on every member:\n{}", last.join("\n"));
            }
            sleep(Duration::from_millis(50)).await;
        }
    }

    async fn post(&self, url: &str, body: Value) -> Result<Value, String> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let reply = timeout(REQUEST_TIMEOUT, self.http.send(request))
            .await
            .map_err(|_| format!("no answer within {REQUEST_TIMEOUT:?}"))??;
        if reply.status != StatusCode::OK {
            return Err(format!("{}: {}", reply.status, reply.body));
        }
        serde_json::from_str(&reply.body).map_err(|e| format!("not JSON ({e}): {}", reply.body))
    }
}

impl Member {
    fn pid(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }
}

/// Runs `etcdctl` (v3 API) and returns its stdout, or why it failed.
async fn etcdctl(args: &[&str]) -> Result<String, String> {
    let out = timeout(
        Duration::from_secs(30),
        Command::new(ETCDCTL)
            .args(args)
            .env("ETCDCTL_API", "3")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .map_err(|_| format!("etcdctl {} did not finish within 30 s", args.join(" ")))?
    .map_err(|e| format!("cannot run {ETCDCTL} (Debian package etcd-client): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "etcdctl {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A token no other cluster on this machine uses, so stray peers can never join.
fn cluster_token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "railguard-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// [`signal`], which must reach the member.
async fn must_signal(pid: u32, name: &str) {
    assert!(signal(pid, name).await, "kill -{name} {pid} failed");
}

/// The gateway writes 64-bit integers as decimal strings; accept numbers too.
fn uint(value: &Value) -> Option<i64> {
    match value {
        Value::String(s) => s.parse::<u64>().ok().map(|v| v as i64),
        Value::Number(n) => n.as_u64().map(|v| v as i64),
        _ => None,
    }
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as the gateway's protobuf `bytes` fields expect.
pub fn base64_encode(input: &[u8]) -> String {
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (k, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(BASE64[(n >> shift) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); `None` on any other character.
pub fn base64_decode(input: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(input.len() / 4 * 3);
    let mut n: u32 = 0;
    let mut bits = 0;
    for c in input.trim_end_matches('=').bytes() {
        let v = BASE64.iter().position(|&a| a == c)? as u32;
        n = (n << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((n >> bits) as u8);
            n &= (1 << bits) - 1;
        }
    }
    Some(out)
}
