//! The processes of the comparison, each started on its own so that its CPU time and context
//! switches can be read from `/proc` without anything else mixed in: nginx as the static
//! upstream and as a plain reverse proxy, the bare hyper proxy (`bare-proxy`),
//! `railguard rail-sim`, and `railguard serve`.
//!
//! Every process listens on 127.0.0.1 only, keeps its files in the run's temp dir, and is
//! killed, with the processes it started, when its [`Spawned`] is stopped or dropped.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::time::Instant;

use railguard::config::{Config, DatabaseUrl, Upstream};
use railguard_testkit::{children_of, free_loopback_port};

const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A started process, killed on drop.
pub(crate) struct Spawned {
    pub name: String,
    pub addr: SocketAddr,
    /// railguard's admin listener (its `/metrics`).
    pub admin: Option<SocketAddr>,
    child: Child,
    log: PathBuf,
}

impl Spawned {
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The last lines of its log, for an error message.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(5).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// Whether it has exited.
    pub(crate) fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Kills it and the processes it started: nginx's workers outlive a killed master, and
    /// would keep their ports and memory until the machine restarts.
    pub(crate) async fn stop(mut self) {
        self.kill_family();
        let _ = self.child.wait().await;
    }

    /// SIGKILL to it, then to its children: nginx's master replaces a worker that dies
    /// before it does.
    fn kill_family(&mut self) {
        if let Some(pid) = self.child.id() {
            let children = children_of(pid);
            let _ = self.child.start_kill();
            kill_all(&children);
        }
    }
}

impl Drop for Spawned {
    /// An early return (a process that never became ready, a failed phase) kills the whole
    /// family too; `kill_on_drop` alone would reach only the process itself.
    fn drop(&mut self) {
        self.kill_family();
    }
}

/// SIGKILL to each of `pids`; a pid already gone is no error.
fn kill_all(pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg("-KILL")
        .args(pids.iter().map(u32::to_string))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free_loopback_port()))
}

fn spawn(
    name: &str,
    command: &mut Command,
    dir: &Path,
    addr: SocketAddr,
) -> Result<Spawned, String> {
    let log = dir.join(format!("{name}.log"));
    let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out
        .try_clone()
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let child = command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    Ok(Spawned {
        name: name.to_string(),
        addr,
        admin: None,
        child,
        log,
    })
}

/// Waits until `addr` accepts TCP connections (the process is listening), or fails.
async fn listening(spawned: &mut Spawned) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if spawned.exited() {
            return Err(format!(
                "{} exited during start-up; its log ends: {}",
                spawned.name,
                spawned.log_tail()
            ));
        }
        if tokio::net::TcpStream::connect(spawned.addr).await.is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} not listening within {READY_TIMEOUT:?}",
                spawned.name
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where nginx is: Debian's `nginx-light` (or any nginx) on the PATH or in /usr/sbin.
fn nginx_binary() -> Result<PathBuf, String> {
    for candidate in ["/usr/sbin/nginx", "/usr/bin/nginx"] {
        if Path::new(candidate).exists() {
            return Ok(candidate.into());
        }
    }
    Err("nginx not found (apt-get install nginx-light; scripts/bench.sh installs it)".into())
}

/// The `nginx` directives every instance here shares: in the foreground, everything in `dir`,
/// no access log (railguard keeps none either).
fn nginx_preamble(dir: &Path, workers: usize) -> String {
    // Its workers run as root when the benchmark does, so that they can use the run's dir.
    let user = if is_root() { "user root;\n" } else { "" };
    format!(
        "{user}worker_processes {workers};\ndaemon off;\nmaster_process on;\n\
         pid {dir}/nginx.pid;\nerror_log {dir}/error.log warn;\n\
         events {{ worker_connections 4096; multi_accept on; }}\n",
        dir = dir.display(),
    )
}

fn nginx_http_common(dir: &Path) -> String {
    let d = dir.display();
    format!(
        "access_log off;\nkeepalive_requests 10000000;\nkeepalive_timeout 120s;\n\
         client_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\nuwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n"
    )
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

async fn start_nginx(
    name: &str,
    dir: &Path,
    config: String,
    addr: SocketAddr,
) -> Result<Spawned, String> {
    let binary = nginx_binary()?;
    let prefix = dir.join(name);
    std::fs::create_dir_all(&prefix).map_err(|e| format!("{}: {e}", prefix.display()))?;
    let path = prefix.join("nginx.conf");
    std::fs::write(&path, config).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut command = Command::new(binary);
    command.arg("-p").arg(&prefix).arg("-c").arg(&path);
    let mut spawned = spawn(name, &mut command, dir, addr)?;
    listening(&mut spawned).await?;
    Ok(spawned)
}

/// nginx answering every request itself with a fixed 201 and a small JSON body: an upstream
/// whose cost is small and the same for every phase. One worker.
pub(crate) async fn static_upstream(dir: &Path) -> Result<Spawned, String> {
    let addr = loopback();
    let prefix = dir.join("upstream");
    let config = format!(
        "{}http {{\n{}server {{\n listen {addr} reuseport;\n location / {{\n  \
         default_type application/json;\n  return 201 '{{\"status\":\"accepted\"}}';\n }}\n}}\n}}\n",
        nginx_preamble(&prefix, 1),
        nginx_http_common(&prefix),
    );
    start_nginx("upstream", dir, config, addr).await
}

/// nginx as a plain reverse proxy in front of `upstream`: keep-alive to the upstream, HTTP/1.1,
/// `X-Forwarded-For` appended, as railguard does. As many workers as CPUs.
pub(crate) async fn nginx_proxy(
    dir: &Path,
    upstream: SocketAddr,
    workers: usize,
) -> Result<Spawned, String> {
    let addr = loopback();
    let prefix = dir.join("nginx-proxy");
    let config = format!(
        "{}http {{\n{}upstream rail {{\n server {upstream};\n keepalive 256;\n \
         keepalive_requests 10000000;\n}}\nserver {{\n listen {addr} reuseport;\n location / {{\n  \
         proxy_pass http://rail;\n  proxy_http_version 1.1;\n  proxy_set_header Connection \"\";\n  \
         proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n }}\n}}\n}}\n",
        nginx_preamble(&prefix, workers),
        nginx_http_common(&prefix),
    );
    start_nginx("nginx-proxy", dir, config, addr).await
}

/// `bare-proxy`, this crate's plain hyper reverse proxy, in front of `upstream`, as a process
/// of its own: one runtime thread per CPU, as railguard's default. With `fence`, it fences
/// each request against that database's marks first, and with its flag set takes the last
/// look too (the floors of a fenced forward).
pub(crate) async fn bare_proxy(
    dir: &Path,
    upstream: SocketAddr,
    fence: Option<(&str, bool)>,
) -> Result<Spawned, String> {
    let addr = loopback();
    let mut command = Command::new(bare_proxy_binary()?);
    command
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--upstream")
        .arg(format!("http://{upstream}"));
    let name = match fence {
        None => "bare-proxy",
        Some((url, last_look)) => {
            command.arg("--fence-database").arg(url);
            if last_look {
                command.arg("--last-look");
                "bare-proxy-looked"
            } else {
                "bare-proxy-fenced"
            }
        }
    };
    let mut spawned = spawn(name, &mut command, dir, addr)?;
    listening(&mut spawned).await?;
    Ok(spawned)
}

/// `bare-proxy` beside this executable (both are built into the same target directory).
fn bare_proxy_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this executable's path: {e}"))?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let binary = dir.join("bare-proxy");
    if binary.is_file() {
        Ok(binary)
    } else {
        Err(format!(
            "no bare-proxy at {} (cargo build --release -p railguard-bench --bin bare-proxy; \
             scripts/bench.sh builds it)",
            binary.display()
        ))
    }
}

/// `railguard rail-sim`, the rail simulator, as a process of its own.
pub(crate) async fn rail_sim(dir: &Path) -> Result<Spawned, String> {
    let addr = loopback();
    let mut command = Command::new(railguard_testkit::railguard_binary());
    command
        .arg("rail-sim")
        .arg("--listen")
        .arg(addr.to_string())
        .env("RUST_LOG", "warn");
    let mut spawned = spawn("rail-sim", &mut command, dir, addr)?;
    listening(&mut spawned).await?;
    Ok(spawned)
}

/// Writes `config` for `binary` to `<dir>/<name>.toml`: every key for this build's binary; for
/// another build's (`--baseline-bin`), only the keys whose values differ from this build's
/// defaults, so that a binary older than a key still reads the file and keeps its own defaults.
fn write_config(binary: &Path, dir: &Path, name: &str, config: &Config) -> Result<PathBuf, String> {
    let error = |e: &dyn std::fmt::Display| format!("cannot write the config: {e}");
    let text = if binary == railguard_testkit::railguard_binary() {
        toml::to_string(config).map_err(|e| error(&e))?
    } else {
        let value = toml::Value::try_from(config).map_err(|e| error(&e))?;
        let defaults = toml::Value::try_from(Config::default()).map_err(|e| error(&e))?;
        let changed = changed(value, &defaults).unwrap_or(toml::Value::Table(toml::Table::new()));
        toml::to_string(&changed).map_err(|e| error(&e))?
    };
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// What of `value` differs from `default`, key by key; `None` when nothing does.
fn changed(value: toml::Value, default: &toml::Value) -> Option<toml::Value> {
    match (value, default) {
        (toml::Value::Table(table), toml::Value::Table(defaults)) => {
            let kept: toml::Table = table
                .into_iter()
                .filter_map(|(key, value)| match defaults.get(&key) {
                    Some(default) => changed(value, default).map(|value| (key, value)),
                    None => Some((key, value)),
                })
                .collect();
            (!kept.is_empty()).then_some(toml::Value::Table(kept))
        }
        (value, default) => (value != *default).then_some(value),
    }
}

/// `railguard migrate` with `binary` (the binary under test, or a baseline's), its config
/// written as `<dir>/<name>.toml`.
pub(crate) async fn migrate(
    binary: &Path,
    name: &str,
    dir: &Path,
    mut config: Config,
    database_url: &str,
) -> Result<(), String> {
    config.database.url = DatabaseUrl::Postgres(database_url.to_string());
    let path = write_config(binary, dir, name, &config)?;
    let out = Command::new(binary)
        .arg("migrate")
        .arg("--config")
        .arg(&path)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| format!("cannot run railguard migrate: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "railguard migrate failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// `railguard serve` of `binary` with `config` (listeners, upstream and database set here),
/// ready once its `/readyz` answers 200.
pub(crate) async fn railguard(
    binary: &Path,
    name: &str,
    dir: &Path,
    mut config: Config,
    upstream: SocketAddr,
    database_url: &str,
) -> Result<Spawned, String> {
    config.proxy.listen = loopback();
    railguard_on(binary, name, dir, config, upstream, database_url).await
}

/// `count` processes of `railguard serve` with `config` (which sets `proxy.reuse_port`) on one
/// database, sharing one proxy address; each with admin and lock listeners of its own.
pub(crate) async fn railguards_sharing(
    binary: &Path,
    name: &str,
    dir: &Path,
    config: &Config,
    upstream: SocketAddr,
    database_url: &str,
    count: usize,
) -> Result<Vec<Spawned>, String> {
    let mut config = config.clone();
    config.proxy.listen = loopback();
    let mut started = Vec::with_capacity(count);
    for i in 0..count {
        let name = format!("{name}-{i}");
        started
            .push(railguard_on(binary, &name, dir, config.clone(), upstream, database_url).await?);
    }
    Ok(started)
}

/// [`railguard()`] on the proxy address `config` names.
async fn railguard_on(
    binary: &Path,
    name: &str,
    dir: &Path,
    mut config: Config,
    upstream: SocketAddr,
    database_url: &str,
) -> Result<Spawned, String> {
    config.admin.listen = loopback();
    config.lock.listen = loopback();
    config.proxy.upstream = Upstream::parse(&format!("http://{upstream}"))?;
    config.database.url = DatabaseUrl::Postgres(database_url.to_string());
    let path = write_config(binary, dir, name, &config)?;
    let mut command = Command::new(binary);
    command.arg("serve").arg("--config").arg(&path);
    let mut spawned = spawn(name, &mut command, dir, config.proxy.listen)?;
    let admin = config.admin.listen;
    spawned.admin = Some(admin);
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut probe = crate::load::Connection::new(admin);
    loop {
        if spawned.exited() {
            return Err(format!(
                "{name} exited during start-up; its log ends: {}",
                spawned.log_tail()
            ));
        }
        if let Ok((http::StatusCode::OK, _)) = probe.request("/readyz", None).await {
            return Ok(spawned);
        }
        if Instant::now() > deadline {
            return Err(format!("{name} not ready within {READY_TIMEOUT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`histogram`] summed over several railguards.
pub(crate) async fn histograms(admins: &[Option<SocketAddr>], name: &str) -> (f64, f64) {
    let mut total = (0.0, 0.0);
    for admin in admins {
        let (sum, count) = histogram(*admin, name).await;
        total = (total.0 + sum, total.1 + count);
    }
    total
}

/// The sum and count of a histogram on railguard's `/metrics` (0, 0 when it cannot be read).
pub(crate) async fn histogram(admin: Option<SocketAddr>, name: &str) -> (f64, f64) {
    let Some(admin) = admin else {
        return (0.0, 0.0);
    };
    let mut connection = crate::load::Connection::new(admin);
    let Ok((_, body)) = connection.request("/metrics", None).await else {
        return (0.0, 0.0);
    };
    let text = String::from_utf8_lossy(&body);
    let value = |suffix: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}_{suffix} ")))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("sum"), value("count"))
}

/// CPU time and context switches of a process and its children, cumulative.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    /// utime + stime of the process, its live children, and its reaped children, in ticks.
    pub ticks: u64,
    /// Voluntary and involuntary context switches of every thread of the process and its
    /// children.
    pub switches: u64,
    /// Of those, the involuntary ones: a thread that could have gone on running was taken off
    /// its core (on a machine whose cores the load, the upstream and PostgreSQL share, often by
    /// a peer its own write had just woken).
    pub involuntary: u64,
}

impl Usage {
    /// Reads the counters of `pid` and its children; zero when it cannot be read.
    pub(crate) fn of(pid: Option<u32>) -> Self {
        let Some(pid) = pid else {
            return Self::default();
        };
        let mut usage = Self::default();
        for (i, p) in std::iter::once(pid).chain(children_of(pid)).enumerate() {
            if let Some((own, reaped)) = ticks(p) {
                usage.ticks += own + if i == 0 { reaped } else { 0 };
            }
            let (all, involuntary) = switches(p);
            usage.switches += all;
            usage.involuntary += involuntary;
        }
        usage
    }

    /// [`of`](Self::of) summed over several processes.
    pub(crate) fn of_all(pids: &[Option<u32>]) -> Self {
        pids.iter().fold(Self::default(), |total, pid| {
            let one = Self::of(*pid);
            Self {
                ticks: total.ticks + one.ticks,
                switches: total.switches + one.switches,
                involuntary: total.involuntary + one.involuntary,
            }
        })
    }

    /// CPU seconds and switches from `self` until `later`.
    pub(crate) fn until(&self, later: &Usage) -> (f64, u64) {
        (
            later.ticks.saturating_sub(self.ticks) as f64 / 100.0,
            later.switches.saturating_sub(self.switches),
        )
    }

    /// Involuntary switches from `self` until `later`.
    pub(crate) fn involuntary_until(&self, later: &Usage) -> u64 {
        later.involuntary.saturating_sub(self.involuntary)
    }
}

/// CPU ticks of a PostgreSQL server's live client backends (the sessions that run the
/// statements), leaving out its background processes (WAL writer, checkpointer, background
/// writer, autovacuum) and the postmaster. A backend's time is lost here when it exits, so
/// this suits clients that keep their connections: railguard's pools.
pub(crate) fn postgres_backend_ticks(postmaster: Option<u32>) -> u64 {
    let Some(postmaster) = postmaster else {
        return 0;
    };
    children_of(postmaster)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                // `postgres: <user> <database> <host>(<port>) <state>`
                let text = String::from_utf8_lossy(&cmdline);
                text.starts_with("postgres: ") && text.contains("127.0.0.1(")
            })
        })
        .filter_map(|pid| ticks(pid).map(|(own, _)| own))
        .sum()
}

/// CPU ticks (utime + stime) of one process itself; 0 when it cannot be read.
pub(crate) fn ticks_of(pid: u32) -> u64 {
    ticks(pid).map_or(0, |(own, _)| own)
}

fn ticks(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    Some((field(11)? + field(12)?, field(13)? + field(14)?))
}

/// Context switches summed over every thread of `pid`: all of them, and the involuntary ones.
fn switches(pid: u32) -> (u64, u64) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0);
    };
    let count = |line: &str| -> u64 {
        line.split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .fold((0, 0), |(all, involuntary), status| {
            let (mut voluntary, mut taken) = (0, 0);
            for line in status.lines() {
                if line.starts_with("voluntary_ctxt_switches:") {
                    voluntary = count(line);
                } else if line.starts_with("nonvoluntary_ctxt_switches:") {
                    taken = count(line);
                }
            }
            (all + voluntary + taken, involuntary + taken)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_build_gets_only_the_keys_that_differ_from_the_defaults() {
        let mut config = Config::default();
        config.database.pool_size += 1;
        let value = toml::Value::try_from(&config).expect("a config serializes");
        let defaults = toml::Value::try_from(Config::default()).expect("a config serializes");
        let kept = changed(value, &defaults).expect("one key differs");
        let expected: toml::Table = toml::from_str(&format!(
            "database.pool_size = {}",
            config.database.pool_size
        ))
        .expect("valid toml");
        assert_eq!(kept, toml::Value::Table(expected));
        assert_eq!(changed(defaults.clone(), &defaults), None);
    }

    #[test]
    fn reads_this_process() {
        let usage = Usage::of(Some(std::process::id()));
        assert!(usage.switches > 0, "{usage:?}");
        assert!(usage.involuntary <= usage.switches, "{usage:?}");
    }
}
