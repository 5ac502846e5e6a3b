//! The HTTP load generator: `connections` keep-alive HTTP/1.1 connections, each a closed loop
//! with one request in flight, until the time or the request budget runs out.
//!
//! Every request's latency is kept (microseconds, one `Vec<u32>` per connection, merged at the
//! end) so percentiles are exact rather than estimated from buckets. Every answer's status is
//! counted, and an answer other than the expected one is never averaged in silently: the caller
//! reports it.
//!
//! Raw `hyper::client::conn` is used rather than a pooled client so that "64 connections"
//! means exactly 64 TCP connections, none opened or closed during the run unless one fails.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use railguard::http::BoxError;

/// No single request may take longer than this; one that does counts as a transport error.
/// It also bounds how long a run can overstay its duration.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The payment every request carries. Its content is irrelevant to the fence.
pub(crate) const BODY: &[u8] = br#"{"amount_cents":100,"currency":"EUR"}"#;

/// Which accounts requests name: `{prefix}{n}` with `n` uniform in `1..=count`.
#[derive(Debug, Clone)]
pub(crate) struct Accounts {
    pub prefix: &'static str,
    pub count: u64,
}

/// One run of load.
#[derive(Debug, Clone)]
pub(crate) struct Load {
    pub target: SocketAddr,
    pub connections: usize,
    pub duration: Duration,
    /// Requests across all connections; a run stops at whichever of this and `duration` comes
    /// first.
    pub max_requests: u64,
    pub accounts: Accounts,
    pub token: i64,
}

/// What a run saw.
#[derive(Debug, Default)]
pub(crate) struct LoadResult {
    /// From the first request sent to the last answer received.
    pub elapsed: Duration,
    /// Latency of every answered request, sorted ascending.
    pub latencies_us: Vec<u32>,
    pub statuses: BTreeMap<u16, u64>,
    /// Requests that got no answer: connect failures, broken connections, timeouts.
    pub transport_errors: u64,
    pub first_transport_error: Option<String>,
}

impl LoadResult {
    pub(crate) fn answered(&self) -> u64 {
        self.latencies_us.len() as u64
    }

    /// Answers with `status`.
    pub(crate) fn count(&self, status: StatusCode) -> u64 {
        self.statuses.get(&status.as_u16()).copied().unwrap_or(0)
    }

    /// Nearest-rank percentile, `q` in `0.0..=1.0`.
    pub(crate) fn percentile_us(&self, q: f64) -> u32 {
        percentile(&self.latencies_us, q)
    }

    /// Counts one request (or cycle) begun at `started`: its latency and status if it was
    /// answered, a transport error if not, after which it pauses briefly so that a dead
    /// target is not spun on (the run stays bounded by its budget and time either way).
    pub(crate) async fn record(&mut self, started: Instant, outcome: Result<StatusCode, String>) {
        match outcome {
            Ok(status) => {
                let micros = started.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                self.latencies_us.push(micros);
                *self.statuses.entry(status.as_u16()).or_default() += 1;
            }
            Err(e) => {
                self.transport_errors += 1;
                self.first_transport_error.get_or_insert(e);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Splits `total` into `parts` shares that add up to exactly `total`; share `id` of them.
pub(crate) fn share(total: u64, parts: usize, id: usize) -> u64 {
    let parts = parts.max(1) as u64;
    total / parts + u64::from((id as u64) < total % parts)
}

/// Nearest-rank percentile of an ascending slice; 0 for an empty one.
pub(crate) fn percentile(sorted: &[u32], q: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Runs `load` and waits for every connection to finish its last request.
pub(crate) async fn run(load: &Load) -> LoadResult {
    let load = Arc::new(load.clone());
    let connections = load.connections.max(1);
    let started = Instant::now();
    let deadline = started + load.duration;
    let workers: Vec<_> = (0..connections)
        .map(|id| {
            let share = share(load.max_requests, connections, id);
            tokio::spawn(worker(load.clone(), id as u64, share, deadline))
        })
        .collect();
    collect(started, workers).await
}

/// Waits for every worker and merges what they saw; `started` is when the first was spawned.
pub(crate) async fn collect(
    started: Instant,
    workers: Vec<tokio::task::JoinHandle<LoadResult>>,
) -> LoadResult {
    let mut result = LoadResult::default();
    for worker in workers {
        match worker.await {
            Ok(part) => {
                result.latencies_us.extend(part.latencies_us);
                for (status, n) in part.statuses {
                    *result.statuses.entry(status).or_default() += n;
                }
                result.transport_errors += part.transport_errors;
                result.first_transport_error =
                    result.first_transport_error.or(part.first_transport_error);
            }
            Err(e) => {
                result.transport_errors += 1;
                result
                    .first_transport_error
                    .get_or_insert_with(|| format!("load worker failed: {e}"));
            }
        }
    }
    result.elapsed = started.elapsed();
    result.latencies_us.sort_unstable();
    result
}

async fn worker(load: Arc<Load>, id: u64, budget: u64, deadline: Instant) -> LoadResult {
    let mut rng = SplitMix64::new(id);
    let mut connection = Connection::new(load.target);
    let mut result = LoadResult::default();
    let mut sent = 0;
    while sent < budget && Instant::now() < deadline {
        sent += 1;
        let account = format!(
            "{}{}",
            load.accounts.prefix,
            1 + rng.below(load.accounts.count)
        );
        let started = Instant::now();
        let outcome = connection.send(&account, load.token).await;
        result
            .record(started, outcome.map_err(|e| e.to_string()))
            .await;
    }
    result
}

/// The grant-proof key of the benchmark's throwaway database: seeded before any proxy starts
/// (a proxy keeps the key it finds), so that every payment carries the proof a worker's grant
/// would, computed per request as a worker without a cached grant would.
pub(crate) const BENCH_PROOF_KEY: [u8; 32] = *b"railguard-bench-grant-proof-key!";

/// Migrates the database at `url` and stores [`BENCH_PROOF_KEY`] as its grant-proof key.
pub(crate) async fn seed_proof_key(url: &str) -> Result<(), String> {
    railguard::db::migrate_url(url, Duration::from_secs(10))
        .await
        .map_err(|e| e.to_string())?;
    store_proof_key(url).await
}

/// Stores the benchmark's grant-proof key in a database whose schema is in place.
pub(crate) async fn store_proof_key(url: &str) -> Result<(), String> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| e.to_string())?;
    let connection = tokio::spawn(connection);
    client
        .execute(
            "INSERT INTO railguard_secret (name, value) VALUES ('grant_proof', $1)
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
            &[&BENCH_PROOF_KEY.as_slice()],
        )
        .await
        .map_err(|e| e.to_string())?;
    drop(client);
    let _ = connection.await;
    Ok(())
}

/// One keep-alive HTTP/1.1 connection, reopened after a failure.
pub(crate) struct Connection {
    target: SocketAddr,
    host: String,
    sender: Option<SendRequest<Full<Bytes>>>,
    proofs: railguard::proof::ProofKey,
}

impl Connection {
    pub(crate) fn new(target: SocketAddr) -> Self {
        Self {
            target,
            host: target.to_string(),
            sender: None,
            proofs: railguard::proof::ProofKey::from_bytes(&BENCH_PROOF_KEY),
        }
    }

    /// Sends one payment naming `account` and `token` and reads the whole answer. Any failure
    /// drops the connection, so the next call starts on a fresh one.
    pub(crate) async fn send(&mut self, account: &str, token: i64) -> Result<StatusCode, BoxError> {
        let outcome = tokio::time::timeout(REQUEST_TIMEOUT, self.send_once(account, token)).await;
        let outcome =
            outcome.unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}").into()));
        if outcome.is_err() {
            self.sender = None;
        }
        outcome
    }

    fn proof(&self, account: &str, token: i64) -> String {
        match railguard::token::FencingToken::new(token) {
            Some(token) => self.proofs.sign(account, token),
            None => String::new(),
        }
    }

    async fn send_once(&mut self, account: &str, token: i64) -> Result<StatusCode, BoxError> {
        let request = Request::post("/payments")
            .header(header::HOST, &self.host)
            .header(header::CONTENT_TYPE, "application/json")
            .header("fencing-token", token)
            .header("fencing-account", account)
            .header("fencing-proof", self.proof(account, token))
            .body(Full::new(Bytes::from_static(BODY)))?;
        let (status, _) = self.exchange(request).await?;
        Ok(status)
    }

    /// Sends one request to `path` (a POST with `body`, or a GET when `body` is `None`) and
    /// reads the whole answer, under the same timeout and reconnect rules as [`send`].
    ///
    /// [`send`]: Self::send
    pub(crate) async fn request(
        &mut self,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<(StatusCode, Bytes), BoxError> {
        let request = match body {
            Some(body) => Request::post(path)
                .header(header::HOST, &self.host)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(body))?,
            None => Request::get(path)
                .header(header::HOST, &self.host)
                .body(Full::new(Bytes::new()))?,
        };
        let outcome = tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request)).await;
        let outcome =
            outcome.unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}").into()));
        if outcome.is_err() {
            self.sender = None;
        }
        outcome
    }

    async fn exchange(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, Bytes), BoxError> {
        if self.sender.is_none() {
            let stream = TcpStream::connect(self.target).await?;
            stream.set_nodelay(true)?;
            let (sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            // Ends when `sender` is dropped or the peer closes.
            tokio::spawn(connection);
            self.sender = Some(sender);
        }
        let sender = self.sender.as_mut().expect("connected above");
        sender.ready().await?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }
}

/// A small, fast, seedable generator for picking accounts; statistical quality beyond
/// "uniform enough" does not matter here.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(stream: u64) -> Self {
        Self(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2^-40 for our `n`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n.max(1))) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let sorted: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&sorted, 0.5), 50);
        assert_eq!(percentile(&sorted, 0.99), 99);
        assert_eq!(percentile(&sorted, 1.0), 100);
        assert_eq!(percentile(&[7], 0.99), 7);
        assert_eq!(percentile(&[], 0.5), 0);
    }

    #[test]
    fn accounts_are_drawn_from_the_whole_range() {
        let mut rng = SplitMix64::new(3);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            seen[rng.below(10) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
    }
}
