//! `bare-proxy`: the wire suite's floors. A hyper 1 server (`service_fn`, a multi-thread tokio
//! runtime) that reads each request's body whole, forwards method, path and query, headers and
//! body to the upstream through hyper-util's pooled legacy client (HTTP/1.1, keep-alive),
//! reads the answer's body whole and returns it. No fencing, no database, no logging: what
//! railguard costs per request above this is its own work.
//!
//! With `--fence-database URL` it is the floor of a *fenced* forward instead: before the
//! forward, each request's grant proof is checked and its token compare-and-set against its
//! account's mark with railguard's own statement, group-committed: one statement in flight on
//! one session, every request that arrived meanwhile in the next. A request with an
//! `Idempotency-Key` has its record created in the same statement (`BATCH_SQL`, as railguard
//! does), and once the upstream has answered, that answer is stored by railguard's completion
//! (`COMPLETE_SQL`, grouped the same way on a session with the completions' settings) before
//! the client hears it. A token below the mark is answered 409. With `--last-look` too, an
//! accepted request's mark is read again just before its forward (`LAST_LOOK_SQL`, grouped, on
//! a session with the look's settings).
//!
//! Nothing else railguard does is here: no replay or refusal of a key's repeats, no ordering
//! between overlapping requests or processes, no mark cache, deadlines, limits, logging or
//! metrics, no handling of a failed statement beyond a 503. So railguard's CPU per request
//! above these phases' is what those and its stack cost, and these phases' above the bare
//! proxy's is what the contract's statements cost a hyper proxy built on tokio-postgres at the
//! least.
//!
//! `bare-proxy --listen 127.0.0.1:PORT --upstream http://127.0.0.1:PORT [--fence-database URL
//! [--last-look]]`

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use clap::Parser;
use http::uri::{PathAndQuery, Uri};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use railguard::proof::ProofKey;
use railguard::proxy::idempotency::{fingerprint, new_owner};
use railguard::store::completions::COMPLETE_SQL;
use railguard::store::marks::{ADVANCE_BATCH_SQL, BATCH_SQL, LAST_LOOK_SQL};
use railguard::token::FencingToken;
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{Client as Db, NoTls, Statement};

type Upstream = Client<HttpConnector, Full<Bytes>>;

/// A plain HTTP/1.1 reverse proxy, the floor railguard's CPU per request is compared against.
#[derive(Parser)]
#[command(name = "bare-proxy")]
struct Cli {
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// Where to forward: `http://host:port`.
    #[arg(long)]
    upstream: Uri,
    /// Fence each request against the marks of this database (migrated by `railguard
    /// migrate`, holding the grant-proof key) before forwarding it, and store a keyed
    /// request's answer before answering.
    #[arg(long)]
    fence_database: Option<String>,
    /// With `--fence-database`: read each accepted request's mark again just before its
    /// forward, and answer 409 when it has passed the request's token.
    #[arg(long, requires = "fence_database")]
    last_look: bool,
}

/// What every connection shares.
struct Shared {
    client: Upstream,
    upstream: Uri,
    fence: Option<Fence>,
}

/// The fence's half: the proof key, and where each statement's requests queue for its next
/// batch.
struct Fence {
    proofs: ProofKey,
    advance: Queue<Advance>,
    look: Option<Queue<Look>>,
    complete: Queue<Complete>,
}

/// A request's place in a statement's next batch; the answer gives the item back with whether
/// it went through (`Err`: the statement failed).
struct Job<T> {
    item: T,
    reply: oneshot::Sender<(T, Result<bool, ()>)>,
}

type Queue<T> = mpsc::UnboundedSender<Job<T>>;

/// A statement run a batch at a time.
trait Batched: Send + 'static {
    type Item: Send + 'static;
    /// Whether `item` may join `batch` (otherwise it waits for the next).
    fn fits(&self, _batch: &[Job<Self::Item>], _item: &Self::Item) -> bool {
        true
    }
    /// Runs the statement for `batch`: for each job, whether it went through.
    fn run(
        &mut self,
        batch: &[Job<Self::Item>],
    ) -> impl Future<Output = Result<Vec<bool>, tokio_postgres::Error>> + Send;
}

/// Largest batch, as railguard's default `fencing.batch_max`.
const BATCH_MAX: usize = 512;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new()).build(connector);
    let fence = match &cli.fence_database {
        Some(url) => Some(fence(url, cli.last_look).await?),
        None => None,
    };
    let shared = Arc::new(Shared {
        client,
        upstream: cli.upstream.clone(),
        fence,
    });
    let listener = tokio::net::TcpListener::bind(cli.listen).await?;
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| forward(shared.clone(), request));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// A session on `url` with `options` (`-c name=value …`).
async fn session(url: &str, options: &str) -> Result<Db, Box<dyn std::error::Error>> {
    let mut config: tokio_postgres::Config = url.parse()?;
    config.options(options);
    let (db, connection) = config.connect(NoTls).await?;
    tokio::spawn(connection);
    Ok(db)
}

/// Connects to `url`, reads the grant-proof key and starts the batchers, each on a session of
/// its own with the settings railguard gives that statement's sessions.
async fn fence(url: &str, last_look: bool) -> Result<Fence, Box<dyn std::error::Error>> {
    let db = session(url, "").await?;
    let key: Vec<u8> = db
        .query_one(
            "SELECT value FROM railguard_secret WHERE name = 'grant_proof'",
            &[],
        )
        .await?
        .get(0);
    let advance = Advancing {
        plain: db.prepare(ADVANCE_BATCH_SQL).await?,
        keyed: db.prepare(BATCH_SQL).await?,
        db,
        seq: 0,
    };
    let look = if last_look {
        let db = session(
            url,
            "-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c jit=off",
        )
        .await?;
        let statement = db.prepare(LAST_LOOK_SQL).await?;
        Some(start(Looking { db, statement }))
    } else {
        None
    };
    let db = session(
        url,
        "-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c enable_hashjoin=off \
         -c enable_mergejoin=off -c enable_nestloop=on -c enable_tidscan=on \
         -c enable_indexscan=on -c jit=off -c synchronous_commit=off",
    )
    .await?;
    let statement = db.prepare(COMPLETE_SQL).await?;
    Ok(Fence {
        proofs: ProofKey::from_bytes(&key),
        advance: start(advance),
        look,
        complete: start(Completing { db, statement }),
    })
}

/// Starts `statement`'s batcher: one statement at a time, each holding every job that arrived
/// while the one before ran (and fits).
fn start<B: Batched>(mut statement: B) -> Queue<B::Item> {
    let (queue, mut arrivals) = mpsc::unbounded_channel::<Job<B::Item>>();
    tokio::spawn(async move {
        let mut later: Vec<Job<B::Item>> = Vec::new();
        loop {
            if later.is_empty() {
                match arrivals.recv().await {
                    Some(first) => later.push(first),
                    None => return,
                }
            }
            let mut batch: Vec<Job<B::Item>> = Vec::new();
            let mut next = Vec::new();
            let waiting = std::mem::take(&mut later).into_iter();
            for job in waiting.chain(std::iter::from_fn(|| arrivals.try_recv().ok())) {
                if statement.fits(&batch, &job.item) {
                    batch.push(job);
                } else {
                    next.push(job);
                }
                if batch.len() == BATCH_MAX {
                    break;
                }
            }
            later = next;
            let verdicts = statement.run(&batch).await;
            for (n, job) in batch.into_iter().enumerate() {
                let verdict = match &verdicts {
                    Ok(verdicts) => Ok(verdicts.get(n).copied().unwrap_or(false)),
                    Err(_) => Err(()),
                };
                let _ = job.reply.send((job.item, verdict));
            }
        }
    });
    queue
}

/// Puts `item` in `queue`'s next batch; it back, if it went through; the answer for the
/// client if not (409 when the statement said no, 503 when it failed).
async fn ask<T>(queue: &Queue<T>, item: T) -> Result<T, Response<Full<Bytes>>> {
    let unavailable = || status(StatusCode::SERVICE_UNAVAILABLE);
    let (reply, verdict) = oneshot::channel();
    queue.send(Job { item, reply }).map_err(|_| unavailable())?;
    match verdict.await {
        Ok((item, Ok(true))) => Ok(item),
        Ok((_, Ok(false))) => Err(status(StatusCode::CONFLICT)),
        Ok((_, Err(()))) | Err(_) => Err(unavailable()),
    }
}

/// A request's compare-and-set, and its idempotency record if it has a key.
struct Advance {
    account: String,
    token: i64,
    record: Option<NewRecord>,
}

struct NewRecord {
    key: String,
    fingerprint: String,
    owner: String,
}

/// How long a record stays in flight before it is in doubt, as railguard's default.
const IN_DOUBT_AFTER_MS: i64 = 30_000;

struct Advancing {
    db: Db,
    plain: Statement,
    keyed: Statement,
    seq: i64,
}

impl Batched for Advancing {
    type Item = Advance;

    /// At most one token per account and one record per key in a statement, as railguard's
    /// (`ON CONFLICT` may not touch a row twice).
    fn fits(&self, batch: &[Job<Advance>], item: &Advance) -> bool {
        batch.iter().all(|job| {
            job.item.account != item.account
                || (job.item.token == item.token
                    && !matches!((&job.item.record, &item.record),
                        (Some(a), Some(b)) if a.key == b.key))
        })
    }

    async fn run(&mut self, batch: &[Job<Advance>]) -> Result<Vec<bool>, tokio_postgres::Error> {
        // This process's entry among an account's forwarders, as railguard writes it.
        const INSTANCE: i64 = 1;
        self.seq += 1;
        let mut seen = HashSet::new();
        let (mut accounts, mut tokens) = (Vec::new(), Vec::new());
        let (mut r_accounts, mut keys, mut fingerprints) = (Vec::new(), Vec::new(), Vec::new());
        let (mut r_tokens, mut owners, mut in_doubt) = (Vec::new(), Vec::new(), Vec::new());
        for Job { item, .. } in batch {
            if seen.insert(item.account.as_str()) {
                accounts.push(item.account.as_str());
                tokens.push(item.token);
            }
            if let Some(record) = &item.record {
                r_accounts.push(item.account.as_str());
                keys.push(record.key.as_str());
                fingerprints.push(record.fingerprint.as_str());
                r_tokens.push(item.token);
                owners.push(record.owner.as_str());
                in_doubt.push(IN_DOUBT_AFTER_MS);
            }
        }
        let keyed = !keys.is_empty();
        let rows = if keyed {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
                &accounts,
                &tokens,
                &r_accounts,
                &keys,
                &fingerprints,
                &r_tokens,
                &owners,
                &in_doubt,
                &INSTANCE,
                &self.seq,
            ];
            self.db.query(&self.keyed, &params).await?
        } else {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&accounts, &tokens, &INSTANCE, &self.seq];
            self.db.query(&self.plain, &params).await?
        };
        // The accounts advanced, and (keyed) the records made, read in place from the rows.
        let mut advanced: HashSet<&str> = HashSet::new();
        let mut recorded: HashSet<(&str, &str)> = HashSet::new();
        for row in &rows {
            let account: &str = row.get(0);
            match keyed.then(|| row.get::<_, Option<&str>>(1)).flatten() {
                Some(key) => recorded.insert((account, key)),
                None => advanced.insert(account),
            };
        }
        Ok(batch
            .iter()
            .map(|Job { item, .. }| {
                advanced.contains(item.account.as_str())
                    && item
                        .record
                        .as_ref()
                        .is_none_or(|r| recorded.contains(&(item.account.as_str(), r.key.as_str())))
            })
            .collect())
    }
}

/// The last look at an accepted request's account.
struct Look {
    account: String,
    token: i64,
}

struct Looking {
    db: Db,
    statement: Statement,
}

impl Batched for Looking {
    type Item = Look;

    async fn run(&mut self, batch: &[Job<Look>]) -> Result<Vec<bool>, tokio_postgres::Error> {
        let accounts: Vec<&str> = batch.iter().map(|job| job.item.account.as_str()).collect();
        let marks: HashMap<String, i64> = self
            .db
            .query(&self.statement, &[&accounts])
            .await?
            .into_iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        Ok(batch
            .iter()
            .map(|Job { item, .. }| marks.get(&item.account).is_some_and(|m| *m <= item.token))
            .collect())
    }
}

/// The upstream's answer to a keyed request, to be stored in its record.
struct Complete {
    account: String,
    record: NewRecord,
    status: i16,
    headers: String,
    body: Bytes,
}

struct Completing {
    db: Db,
    statement: Statement,
}

impl Batched for Completing {
    type Item = Complete;

    async fn run(&mut self, batch: &[Job<Complete>]) -> Result<Vec<bool>, tokio_postgres::Error> {
        let items = || batch.iter().map(|job| &job.item);
        let accounts: Vec<&str> = items().map(|c| c.account.as_str()).collect();
        let keys: Vec<&str> = items().map(|c| c.record.key.as_str()).collect();
        let owners: Vec<&str> = items().map(|c| c.record.owner.as_str()).collect();
        let statuses: Vec<i16> = items().map(|c| c.status).collect();
        let headers: Vec<&str> = items().map(|c| c.headers.as_str()).collect();
        let bodies: Vec<&[u8]> = items().map(|c| &c.body[..]).collect();
        let stored: Vec<bool> = vec![true; batch.len()];
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
            &accounts, &keys, &owners, &statuses, &headers, &bodies, &stored,
        ];
        let rows = self.db.query(&self.statement, &params).await?;
        let done: HashSet<(&str, &str)> = rows.iter().map(|row| (row.get(0), row.get(1))).collect();
        Ok(items()
            .map(|c| done.contains(&(c.account.as_str(), c.record.key.as_str())))
            .collect())
    }
}

/// The request's token and account, if its proof shows the token was granted for the account.
fn admit(proofs: &ProofKey, headers: &HeaderMap) -> Option<(String, FencingToken)> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let token = FencingToken::new(text("fencing-token")?.parse().ok()?)?;
    let account = text("fencing-account")?;
    proofs
        .verify(account, token, text("fencing-proof")?)
        .then(|| (account.to_string(), token))
}

async fn forward(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(fenced_forward(&shared, request)
        .await
        .unwrap_or_else(|refused| refused))
}

async fn fenced_forward(
    shared: &Shared,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Response<Full<Bytes>>> {
    let (mut parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|_| status(StatusCode::BAD_REQUEST))?
        .to_bytes();
    // A keyed request's record, once its compare-and-set made it.
    let mut recorded = None;
    if let Some(fence) = &shared.fence {
        let (account, token) =
            admit(&fence.proofs, &parts.headers).ok_or_else(|| status(StatusCode::BAD_REQUEST))?;
        let record = match parts.headers.get("idempotency-key") {
            Some(key) => Some(NewRecord {
                key: key
                    .to_str()
                    .map_err(|_| status(StatusCode::BAD_REQUEST))?
                    .to_string(),
                fingerprint: fingerprint(
                    parts.method.as_str(),
                    parts.uri.path_and_query().map_or("/", |p| p.as_str()),
                    &body,
                ),
                owner: new_owner(),
            }),
            None => None,
        };
        let advance = Advance {
            account,
            token: token.get(),
            record,
        };
        let Advance {
            account,
            token,
            record,
        } = ask(&fence.advance, advance).await?;
        let account = match &fence.look {
            Some(look) => ask(look, Look { account, token }).await?.account,
            None => account,
        };
        recorded = record.map(|record| (fence, account, record));
    }
    let mut uri = shared.upstream.clone().into_parts();
    uri.path_and_query = Some(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    parts.uri = Uri::from_parts(uri).map_err(|_| status(StatusCode::BAD_REQUEST))?;
    let bad_gateway = |_| status(StatusCode::BAD_GATEWAY);
    let answer = shared
        .client
        .request(Request::from_parts(parts, Full::new(body)))
        .await
        .map_err(bad_gateway)?;
    let (parts, body) = answer.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|_| status(StatusCode::BAD_GATEWAY))?;
    let body = body.to_bytes();
    if let Some((fence, account, record)) = recorded {
        // Stored before the client hears it, as railguard does: a repeat must find it.
        let headers: Vec<(&str, &str)> = parts
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.to_str().unwrap_or("")))
            .collect();
        let complete = Complete {
            account,
            record,
            status: i16::try_from(parts.status.as_u16()).unwrap_or(i16::MAX),
            headers: serde_json::to_string(&headers).unwrap_or_default(),
            body: body.clone(),
        };
        ask(&fence.complete, complete).await?;
    }
    Ok(Response::from_parts(parts, Full::new(body)))
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = code;
    response
}
