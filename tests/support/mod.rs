//! The shared test harness: real PostgreSQL, the rail simulator and railguard itself, each on
//! free loopback ports, each throwaway, each killable.
//!
//! - [`Pg`]: a PostgreSQL cluster initialised into a temp dir (run as the `postgres` user when
//!   the tests run as root), which a test can stop, kill, pause and restart.
//! - [`Rail`]: the rail simulator, in-process, whose ledger a test reads directly.
//! - [`Railguard`]: the real `railguard serve` binary as a child process, with a config file
//!   written for the test and environment overrides on top.
//! - [`Http`]: an HTTP client over real sockets, and a strict Prometheus text parser.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use railguard::db::{Access, PostgresServer, ServerOptions};
use railguard::net::free_loopback_port;
use railguard::proof::ProofKey;
use railguard::railsim::{LedgerEntry, RailSim};
use std::sync::Arc;
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::process::{Child, Command};

pub mod etcd;
pub mod relay;

/// Installs a test log subscriber once (RUST_LOG controls it).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A throwaway PostgreSQL cluster.
pub struct Pg {
    pub server: PostgresServer,
    _dir: TempDir,
}

impl Pg {
    pub async fn start() -> Pg {
        let dir = tempfile::Builder::new()
            .prefix("railguard-pg-")
            .tempdir()
            .expect("temp dir");
        let options = ServerOptions {
            data_dir: dir.path().join("data"),
            port: free_loopback_port(),
            durable: false,
            access: Access::Loopback,
        };
        let mut server = PostgresServer::init(options).await.expect("initdb");
        server.start().await.expect("postgres starts");
        Pg { server, _dir: dir }
    }

    pub fn url(&self) -> String {
        self.server.url()
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

/// The rail simulator, served in-process on a free port.
pub struct Rail {
    pub addr: SocketAddr,
    sim: RailSim,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Rail {
    pub async fn start() -> Rail {
        Self::with_latency(Duration::ZERO).await
    }

    pub async fn with_latency(latency: Duration) -> Rail {
        Self::with_sim(RailSim::new(latency)).await
    }

    /// A rail behind a network path of variable delay (up to `jitter` before arrival).
    pub async fn with_jitter(latency: Duration, jitter: Duration) -> Rail {
        Self::with_sim(RailSim::new(latency).with_jitter(jitter)).await
    }

    /// A rail that deduplicates by `Idempotency-Key`, as most payment APIs do.
    pub async fn deduplicating() -> Rail {
        Self::with_sim(RailSim::new(Duration::ZERO).deduplicating()).await
    }

    /// Repeats of a seen idempotency key the rail answered without a new payment.
    pub fn absorbed(&self) -> u64 {
        self.sim.absorbed()
    }

    async fn with_sim(sim: RailSim) -> Rail {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind rail");
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = sim.clone();
        tokio::spawn(railguard::http_server::serve(
            listener,
            move |_| {
                let sim = served.clone();
                hyper::service::service_fn(move |r| sim.clone().handle(r))
            },
            async move {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Rail {
            addr,
            sim,
            stop: Some(stop),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.sim.ledger()
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// `railguard serve`, as a child process.
pub struct Railguard {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub lock: SocketAddr,
    child: Option<Child>,
    dir: TempDir,
    env: BTreeMap<String, String>,
    database_url: String,
    /// The database's grant-proof key, so that a test can present tokens as the lock service
    /// would have granted them (the proxy's tests send tokens they choose).
    proofs: Option<Arc<ProofKey>>,
}

impl Railguard {
    /// Starts railguard against `database_url` and `upstream`, with extra `RAILGUARD__…`
    /// overrides, and waits until /readyz says ready.
    pub async fn start(database_url: &str, upstream: &str, env: &[(&str, &str)]) -> Railguard {
        let dir = tempfile::Builder::new()
            .prefix("railguard-rg-")
            .tempdir()
            .expect("temp dir");
        let proxy: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let lock: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let config = format!(
            "[proxy]\nlisten = \"{proxy}\"\nupstream = \"{upstream}\"\nrequest_timeout_ms = 3000\n\
             [admin]\nlisten = \"{admin}\"\n\
             [lock]\nlisten = \"{lock}\"\n\
             [database]\nurl = \"{database_url}\"\ntimeout_ms = 1000\npool_size = 8\n\
             [log]\nformat = \"json\"\nlevel = \"info\"\n\
             [shutdown]\ngrace_ms = 3000\n"
        );
        std::fs::write(dir.path().join("railguard.toml"), config).unwrap();
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut rg = Railguard {
            proxy,
            admin,
            lock,
            child: None,
            dir,
            env,
            database_url: database_url.to_string(),
            proofs: None,
        };
        rg.spawn().await;
        rg.proofs = rg.read_proof_key().await;
        rg
    }

    async fn read_proof_key(&self) -> Option<Arc<ProofKey>> {
        // The embedded server listens on a socket in its data directory only.
        let url = match (
            self.database_url.as_str(),
            self.env.get("RAILGUARD__DATABASE__DATA_DIR"),
        ) {
            ("embedded", Some(dir)) => {
                format!("host='{dir}' port=5432 user=railguard dbname=postgres")
            }
            ("embedded", None) => return None,
            (url, _) => url.to_string(),
        };
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("the test reaches railguard's database");
        tokio::spawn(conn);
        let row = client
            .query_one(
                "SELECT value FROM railguard_secret WHERE name = 'grant_proof'",
                &[],
            )
            .await
            .expect("railguard created its proof key");
        Some(Arc::new(ProofKey::from_bytes(&row.get::<_, Vec<u8>>(0))))
    }

    /// The proof a grant of lock key `account` (the default mapping) with `token` carries.
    pub fn proof(&self, account: &str, token: i64) -> String {
        let token = railguard::token::FencingToken::new(token).expect("a valid token");
        self.proofs
            .as_ref()
            .expect("a railguard on a postgres:// database")
            .sign(account, token)
    }

    /// An HTTP/1.1 client that adds the grant proof to payments, like a worker with a grant.
    pub fn http(&self) -> Http {
        Http::new().with_proofs(self.proofs.clone())
    }

    /// The same over HTTP/2.
    pub fn http2(&self) -> Http {
        Http::http2().with_proofs(self.proofs.clone())
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("railguard.toml")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("railguard.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_railguard"))
            .arg("serve")
            .arg("--config")
            .arg(self.config_path())
            .envs(&self.env)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn railguard");
        self.child = Some(child);
        let http = Http::new();
        for _ in 0..300 {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "railguard exited during start-up ({status}):\n{}",
                    self.log()
                );
            }
            if let Ok((StatusCode::OK, _)) =
                http.get(&format!("http://{}/readyz", self.admin)).await
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("railguard did not become ready:\n{}", self.log());
    }

    /// SIGTERM, then wait for a clean exit.
    pub async fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let pid = child.id().unwrap();
        Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .expect("railguard exits after SIGTERM")
            .unwrap()
    }

    pub async fn restart(&mut self) {
        let status = self.stop().await;
        assert!(
            status.success(),
            "railguard stopped cleanly: {status}\n{}",
            self.log()
        );
        self.spawn().await;
    }

    /// SIGKILL: a crash, no draining.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// Starts again after `stop` or `kill`, on the same ports and config.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "railguard is still running");
        self.spawn().await;
    }

    /// `railguard idempotency-forget` against this railguard, as an operator runs it.
    pub async fn forget(&self, account: &str, key: &str) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_railguard"))
            .args([
                "idempotency-forget",
                "--account",
                account,
                "--key",
                key,
                "--config",
            ])
            .arg(self.config_path())
            .output()
            .await
            .unwrap()
    }

    pub fn lock_url(&self) -> String {
        format!("http://{}", self.lock)
    }

    pub fn lock_client(&self) -> railguard::sdk::LockClient {
        railguard::sdk::LockClient::new(self.lock_url()).with_timeout(Duration::from_secs(3))
    }

    pub fn proxy_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    pub async fn metrics(&self) -> Metrics {
        let (status, text) = Http::new()
            .get(&format!("http://{}/metrics", self.admin))
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        Metrics::parse(&text)
    }
}

/// An HTTP/1.1 client over real sockets.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    /// When set, [`Http::pay`] adds the proof of the token it sends, as the lock service
    /// would have issued it.
    proofs: Option<Arc<ProofKey>>,
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

impl Http {
    pub fn new() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new()).build_http(),
            proofs: None,
        }
    }

    pub fn http2() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
            proofs: None,
        }
    }

    pub fn with_proofs(mut self, proofs: Option<Arc<ProofKey>>) -> Http {
        self.proofs = proofs;
        self
    }

    /// The proof for a payment's headers: one valid token and one account, and no proof yet.
    fn proof_for(&self, headers: &[(&str, &str)]) -> Option<String> {
        let proofs = self.proofs.as_ref()?;
        let named = |name: &str| -> Vec<&str> {
            headers
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| *v)
                .collect()
        };
        if !named("fencing-proof").is_empty() {
            return None;
        }
        let (tokens, accounts) = (named("fencing-token"), named("fencing-account"));
        match (tokens.as_slice(), accounts.as_slice()) {
            ([token], [account]) => {
                let token = railguard::token::FencingToken::parse(token).ok()?;
                Some(proofs.sign(account, token))
            }
            _ => None,
        }
    }

    pub async fn get(&self, url: &str) -> Result<(StatusCode, String), String> {
        let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        let reply = self.send(request).await?;
        Ok((reply.status, reply.body))
    }

    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Reply, String> {
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// POSTs a payment with the given headers (name, value), repeated names allowed.
    ///
    /// With proofs (see [`Railguard::http`]) a grant proof is added for the token and account.
    pub async fn pay(&self, url: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        let mut request = Request::builder().method(Method::POST).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(proof) = self.proof_for(headers) {
            request = request.header("Fencing-Proof", proof);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        self.send(request).await.expect("proxy answers")
    }

    /// POSTs with `Fencing-Token: token` and `Fencing-Account: account`.
    /// POSTs with `Fencing-Token: token` and `Fencing-Account: account`, and the proof of
    /// that grant.
    pub async fn pay_with(&self, rg: &Railguard, token: i64, account: &str) -> Reply {
        let proof = rg.proof(account, token);
        let token = token.to_string();
        self.pay(
            &rg.proxy_url("/payments"),
            &[
                ("Fencing-Token", &token),
                ("Fencing-Account", account),
                ("Fencing-Proof", &proof),
            ],
            &format!("{{\"account\":\"{account}\",\"amount\":100}}"),
        )
        .await
    }
}

/// Samples of a Prometheus text exposition, keyed `name{labels}` exactly as exposed.
#[derive(Debug)]
pub struct Metrics(pub BTreeMap<String, f64>);

impl Metrics {
    /// Parses strictly: every sample line is `name[{labels}] value`, every sample belongs to a
    /// family announced by `# TYPE`, and every value is a number. Panics otherwise.
    pub fn parse(text: &str) -> Metrics {
        let mut types = BTreeMap::new();
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "{line}"
                );
                types.insert(name.to_string(), kind.to_string());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            assert!(!line.starts_with('#'), "unexpected comment: {line}");
            let (key, value) = line
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad sample: {line}"));
            let name = key.split('{').next().unwrap();
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
                "bad metric name: {line}"
            );
            if key.contains('{') {
                assert!(key.ends_with('}'), "bad labels: {line}");
            }
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
                })
                .unwrap_or(name);
            assert!(types.contains_key(family), "sample without # TYPE: {line}");
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("bad value: {line}"));
            samples.insert(key.to_string(), value);
        }
        Metrics(samples)
    }

    pub fn get(&self, key: &str) -> f64 {
        *self
            .0
            .get(key)
            .unwrap_or_else(|| panic!("metric {key} missing from {:?}", self.0.keys()))
    }
}
