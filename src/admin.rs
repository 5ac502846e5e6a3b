//! The admin listener: `/metrics`, `/healthz`, `/readyz`, and the operator's actions: reading
//! one account's mark (`POST /marks`), the way out of an idempotency record in doubt
//! (`POST /idempotency/forget`) and of a poisoned account (`POST /recover`, [`recover`]).
//! Actions that change something are recorded in `railguard_audit`. `/openapi.yaml`
//! describes every listener's HTTP contract (`crate::openapi`); `/runbook` is
//! docs/operations.md, where the alerts' `runbook_url` links lead ([`runbook`]).
//!
//! It has its own port (loopback by default) so that a scrape or a health probe never queues
//! behind payment traffic, and so that the proxy's port carries nothing but the rail's API.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde::Deserialize;

mod forget;
pub mod recover;
pub mod runbook;

pub use self::forget::ForgetRefusal;

use crate::auth::{Authenticator, Listener, PeerCertificate, Permission, Refusal};
use crate::config::LockKeyTemplate;
use crate::http::{ResponseBody, full};
use crate::lock::guard::{SourceGuard, Verdict};
use crate::metrics::Metrics;
use crate::store::instance::InstanceId;
use crate::store::marks::HighWaterStore;
use crate::store::records::{IdempotencyStore, OwnerStopped};
use crate::store::replication::ReplicationCheck;
use crate::token::AccountId;

#[derive(Clone)]
pub struct Admin {
    pub metrics: Arc<Metrics>,
    /// Ready only while the token source is known to be ahead of every fencing mark.
    pub guard: Arc<SourceGuard>,
    pub store: HighWaterStore,
    pub idempotency: IdempotencyStore,
    pub max_account_len: usize,
    /// `fencing.lock_key_template`: the lock key a recovered account's grants use.
    pub lock_key_template: LockKeyTemplate,
    /// `None`: authentication is off and every route is open.
    pub auth: Option<Arc<Authenticator>>,
    /// Not ready while PostgreSQL can lose an accepted compare-and-set, with
    /// `database.replication_risk = "refuse"`.
    pub replication: Arc<ReplicationCheck>,
}

/// What a route needs of an operator, with authentication on. Health probes need nothing:
/// a load balancer or an orchestrator asks them without credentials. Nor does the runbook: it
/// ships with every copy of railguard, and an alert's link to it opens in a browser, which
/// has no bearer secret to send ([`runbook`]).
fn permission_for(method: &Method, path: &str) -> Option<Permission> {
    match (method, path) {
        (&Method::POST, "/idempotency/forget" | "/recover") => Some(Permission::Write),
        (_, "/healthz" | "/readyz" | "/runbook") => None,
        _ => Some(Permission::Read),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecoverRequest {
    account: String,
    /// Why, for the audit record: required.
    reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MarkRequest {
    account: String,
}

/// The in-doubt procedure: what an operator checks, and in which order, before forgetting an
/// idempotency record in doubt. The same text is in docs/contract.md, in docs/operations.md ("In
/// doubt") and in `railguard idempotency-forget --help` (a test holds the documents to it);
/// forget's refusals name their code and the section of docs/operations.md for it. railguard checks the owner's stop (its clean stop, or `--owner-stopped`)
/// and the time (`IdempotencyStore::forget_in_doubt`); the rest is the operator's.
pub const IN_DOUBT_PROCEDURE: &str = "\
The in-doubt procedure, in this order (railguard idempotency-forget):
1. Stop the railguard process that owns the record: forget names its instance N, and that
   process logged \"holding this process's instance lock as instance N\" when it started.
   SIGTERM it and wait until it has exited; paused is not stopped. If it crashed, was killed,
   or stopped with forwards still out, make sure it is not running and add --owner-stopped N
   to every forget below.
2. Run idempotency-forget with --dry-run. It changes nothing and names the time after which
   nothing the owner sent can still reach the rail: the record's in-doubt deadline plus
   proxy.rail_transit_ms, and not before the quiet_after of the owner's clean stop. With
   --owner-stopped, also count proxy.rail_transit_ms from the moment the process stopped:
   only you saw that moment.
3. Once that time has passed, and not before, ask the rail about the payment by its
   idempotency key (the key reaches the rail with the request).
4. If the rail has the payment: do not forget and do not send the retry. The payment was
   made; take its outcome from the rail. The record stays in doubt, and repeats of the key
   keep getting 409 in_doubt.
5. If the rail does not have it: run idempotency-forget without --dry-run. It refuses while
   the time has not passed; otherwise it deletes the record (audited in railguard_audit) and
   the next retry of the key is forwarded.

proxy.rail_transit_ms is your statement of the longest a request can spend between any
railguard and the rail (socket buffers, relays, load balancers): railguard cannot measure it,
and a path that holds a request longer defeats step 3. A rail that deduplicates by
Idempotency-Key, which railguard forwards, absorbs such a request.
";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForgetRequest {
    account: String,
    key: String,
    /// Decide and change nothing: whether the record would be forgotten now, or why not and
    /// until when (step 2 of [`IN_DOUBT_PROCEDURE`]).
    #[serde(default)]
    dry_run: bool,
    /// The operator's word that the railguard process of this instance has stopped, or
    /// `"unrecorded"`: every railguard running when a record naming no owner was made; heard
    /// only when PostgreSQL cannot tell (`IdempotencyStore::forget_in_doubt`).
    #[serde(default)]
    owner_stopped: Option<serde_json::Value>,
}

/// `owner_stopped` as the API takes it: an instance number (a JSON integer), or the string
/// `"unrecorded"`; nothing else, not a number inside a string.
fn parse_owner_stopped(value: serde_json::Value) -> Result<OwnerStopped, String> {
    match &value {
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(n) => Ok(OwnerStopped::Instance(InstanceId::from_stored(n))),
            None => Err(format!(
                "owner_stopped: {value} is not an instance number; nothing was done"
            )),
        },
        serde_json::Value::String(word) if word == "unrecorded" => Ok(OwnerStopped::Unrecorded),
        _ => Err(format!(
            "owner_stopped: {value} is neither an instance number nor \"unrecorded\"; nothing \
             was done"
        )),
    }
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response<ResponseBody> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(full(body))
        .expect("static response parts")
}

impl Admin {
    /// With authentication on: 401 without an operator's credentials, 403 without the
    /// permission the route needs. Nothing is read or changed before this passes.
    fn refusal(&self, request: &Request<Incoming>, path: &str) -> Option<Response<ResponseBody>> {
        let auth = self.auth.as_ref()?;
        let permission = permission_for(request.method(), path)?;
        let identity = match auth.identify(
            request.headers(),
            PeerCertificate::of(request.extensions()).as_ref(),
        ) {
            Ok(identity) => identity,
            Err(e) => {
                auth.metrics
                    .refused(Listener::Admin, Refusal::Unauthenticated);
                let mut refused = error(StatusCode::UNAUTHORIZED, "unauthenticated", e.to_string());
                refused
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, e.challenge());
                return Some(refused);
            }
        };
        if identity.may(permission) {
            return None;
        }
        auth.metrics.refused(Listener::Admin, Refusal::Forbidden);
        tracing::warn!(identity = %identity.name, path, "admin request refused: not permitted");
        let what = match permission {
            Permission::Read => "read",
            Permission::Write => "write",
        };
        Some(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "identity {:?} may not do this: it needs an operator credential with {what:?}; \
                 nothing was read or changed",
                identity.name
            ),
        ))
    }

    pub async fn handle(
        self,
        request: Request<Incoming>,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let path = request.uri().path().to_string();
        if let Some(refused) = self.refusal(&request, &path) {
            return Ok(refused);
        }
        Ok(match (request.method().clone(), path.as_str()) {
            (Method::GET, "/metrics") => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            (Method::GET, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n".into()),
            (Method::GET, "/readyz") => match self.ready().await {
                Ok(()) => reply(StatusCode::OK, "text/plain", "ready\n".into()),
                Err(why) => reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                ),
            },
            (Method::POST, "/idempotency/forget") => self.forget(request).await,
            (Method::POST, "/marks") => self.mark(request).await,
            (Method::POST, "/recover") => self.recover(request).await,
            (Method::GET, "/openapi.yaml") => crate::openapi::response(),
            (Method::GET, "/runbook") => {
                reply(StatusCode::OK, "text/html; charset=utf-8", runbook::html())
            }
            (_, "/metrics" | "/healthz" | "/readyz" | "/openapi.yaml" | "/runbook") => {
                method_not_allowed("GET")
            }
            (_, "/idempotency/forget" | "/marks" | "/recover") => method_not_allowed("POST"),
            _ => error(
                StatusCode::NOT_FOUND,
                "not_found",
                "not found; try /metrics, /healthz, /readyz, POST /idempotency/forget, POST /marks, \
                 POST /recover, /openapi.yaml, /runbook"
                    .into(),
            ),
        })
    }

    /// PostgreSQL answers, the schema is current, its replication is accepted
    /// (`database.replication_risk`), and the token source is ahead of every mark.
    async fn ready(&self) -> Result<(), String> {
        self.store.ready().await?;
        self.idempotency.ready().await?;
        self.replication.ready()?;
        match self.guard.verdict() {
            Verdict::Ahead { .. } => Ok(()),
            Verdict::Unchecked => Err("the token source has not been checked against the \
                 fencing marks yet; the lock API grants nothing"
                .into()),
            // No numbers: /readyz needs no credentials, and the highest mark is for operators
            // only (ADR-002 §A2.3). The guard's log line has the position and the mark.
            Verdict::Behind { .. } => Err(format!(
                "the token source ({}) is behind the highest fencing mark (the log line \
                 \"THE TOKEN SOURCE IS BEHIND THE FENCING MARKS\" has both numbers); the lock API grants nothing \
                 until `railguard fast-forward` has run (docs/operations.md)",
                self.guard.source().name()
            )),
        }
    }

    /// A small JSON body, or the answer why not: 400, or 408 when it did not arrive within
    /// the listener's `header_read_timeout_ms` (nothing was done either way).
    async fn read_json<T: serde::de::DeserializeOwned>(
        request: Request<Incoming>,
        expected: &str,
    ) -> Result<T, Response<ResponseBody>> {
        let body = match crate::http::read_small_body(request, 4096).await {
            Ok(body) => body,
            Err(e @ crate::http::SmallBodyError::TimedOut(_)) => {
                return Err(error(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    format!("{e}; nothing was done"),
                ));
            }
            Err(e) => return Err(bad_request(e.to_string())),
        };
        serde_json::from_slice(&body).map_err(|e| bad_request(format!("expected {expected}: {e}")))
    }

    /// The request's account, or why not (for a 400).
    fn account(&self, text: &str) -> Result<AccountId, String> {
        AccountId::parse(text, self.max_account_len).map_err(|e| format!("account {e}"))
    }

    /// An operator reads one account's mark (`railguard marks ACCOUNT`). Offered here only,
    /// never on the proxy or lock listeners: a worker that learned a mark could present it
    /// (ADR-002 §A2.3).
    async fn mark(&self, request: Request<Incoming>) -> Response<ResponseBody> {
        let asked: MarkRequest = match Self::read_json(request, "{\"account\"}").await {
            Ok(asked) => asked,
            Err(refused) => return refused,
        };
        let account = match self.account(&asked.account) {
            Ok(account) => account,
            Err(why) => return bad_request(why),
        };
        match self.store.current_mark(&account).await {
            Ok(mark) => {
                tracing::info!(account = %account, "an operator read an account's mark");
                let body = serde_json::json!({ "account": account.as_str(), "mark": mark });
                reply(StatusCode::OK, "application/json", format!("{body}\n"))
            }
            Err(e) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!("database: {e}"),
            ),
        }
    }

    /// Moves the token source past one account's mark, never lowering it ([`recover`]).
    async fn recover(&self, request: Request<Incoming>) -> Response<ResponseBody> {
        use recover::RecoverError;
        let asked: RecoverRequest =
            match Self::read_json(request, "{\"account\", \"reason\"}").await {
                Ok(asked) => asked,
                Err(refused) => return refused,
            };
        let account = match self.account(&asked.account) {
            Ok(account) => account,
            Err(why) => return bad_request(why),
        };
        let reason = asked.reason.trim();
        if reason.is_empty() || reason.len() > 1000 {
            return bad_request("reason must say why, in 1 to 1000 bytes (it is audited)".into());
        }
        let mark = match self.store.current_mark(&account).await {
            Ok(mark) => mark,
            Err(e) => return recover_error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", &e),
        };
        let lock_key = format!(
            "{}{}{}",
            self.lock_key_template.prefix(),
            account.as_str(),
            self.lock_key_template.suffix()
        );
        let pool = self.store.pool().clone();
        let (guard, reason, who) = (self.guard.clone(), reason.to_string(), account.clone());
        // In a task of its own: a client that goes away (Ctrl-C, its timeout during a long
        // etcd advance) must not stop the recovery half-way with its outcome unrecorded.
        let task = tokio::spawn(async move {
            recover::recover_account(&guard, &pool, &who, lock_key, mark, &reason).await
        });
        let outcome = match task.await {
            Ok(outcome) => outcome,
            Err(e) => Err(recover::RecoverError::Database(format!(
                "the recovery task failed: {e}"
            ))),
        };
        match outcome {
            Ok(done) => reply(
                StatusCode::OK,
                "application/json",
                format!("{}\n", serde_json::to_string(&done).expect("serializable")),
            ),
            Err(e) => {
                let (status, code) = match &e {
                    RecoverError::GapTooLarge { .. } => (StatusCode::CONFLICT, "gap_too_large"),
                    RecoverError::Unpassable => (StatusCode::CONFLICT, "unpassable_mark"),
                    RecoverError::Source(_) | RecoverError::Database(_) => {
                        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
                    }
                    RecoverError::NotAbove { .. } => {
                        (StatusCode::INTERNAL_SERVER_ERROR, "not_above")
                    }
                };
                tracing::error!(account = %account, error = %e, "account recovery failed");
                recover_error(status, code, &e)
            }
        }
    }

    async fn forget(&self, request: Request<Incoming>) -> Response<ResponseBody> {
        let asked: ForgetRequest = match Self::read_json(
            request,
            "{\"account\", \"key\", \"owner_stopped\"?: INSTANCE or \"unrecorded\", \"dry_run\"?: BOOL}",
        )
        .await
        {
            Ok(asked) => asked,
            Err(refused) => return refused,
        };
        let account = match self.account(&asked.account) {
            Ok(account) => account,
            Err(why) => return bad_request(why),
        };
        let owner_stopped = match asked.owner_stopped.map(parse_owner_stopped).transpose() {
            Ok(word) => word,
            Err(why) => return bad_request(why),
        };
        let forgot = self
            .idempotency
            .forget_in_doubt(&account, &asked.key, owner_stopped, asked.dry_run)
            .await;
        forget::answer(forgot, &account, &asked.key)
    }
}

fn recover_error(
    status: StatusCode,
    code: &'static str,
    e: &dyn std::fmt::Display,
) -> Response<ResponseBody> {
    error(status, code, e.to_string())
}

/// An error answer, in the shape the other listeners use: `{"error": code, "message"}`.
pub(crate) fn error(
    status: StatusCode,
    code: &'static str,
    message: String,
) -> Response<ResponseBody> {
    let body = serde_json::json!({ "error": code, "message": message });
    reply(status, "application/json", format!("{body}\n"))
}

/// 405 for a path that takes only `allow`, saying so in `Allow`.
pub(crate) fn method_not_allowed(allow: &'static str) -> Response<ResponseBody> {
    let mut response = error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("method not allowed; this path takes {allow}"),
    );
    response
        .headers_mut()
        .insert(header::ALLOW, http::HeaderValue::from_static(allow));
    response
}

fn bad_request(why: String) -> Response<ResponseBody> {
    error(StatusCode::BAD_REQUEST, "bad_request", why)
}

/// The `idempotency-forget` command: asks the railguard whose admin listener is `admin` to
/// forget `key` of `account`. Returns its answer, as an error unless it forgot the record.
pub async fn forget_idempotency_key(
    admin: &AdminEndpoint,
    account: &str,
    key: &str,
    owner_stopped: Option<OwnerStopped>,
    dry_run: bool,
) -> Result<String, String> {
    let mut body = serde_json::json!({ "account": account, "key": key });
    if dry_run {
        body["dry_run"] = true.into();
    }
    match owner_stopped {
        Some(OwnerStopped::Instance(instance)) => body["owner_stopped"] = instance.get().into(),
        Some(OwnerStopped::Unrecorded) => body["owner_stopped"] = "unrecorded".into(),
        None => {}
    }
    ask(admin, "/idempotency/forget", body).await
}

/// The `recover-account` command: moves the token source past `account`'s mark through the
/// admin listener `admin`, audited with `reason`. Returns the JSON answer.
pub async fn recover_account(
    admin: &AdminEndpoint,
    account: &str,
    reason: &str,
) -> Result<String, String> {
    let body = serde_json::json!({ "account": account, "reason": reason });
    ask_within(admin, "/recover", body, Duration::from_secs(600)).await
}

/// The `marks` command: one account's mark, read through the admin listener `admin`.
pub async fn read_mark(admin: &AdminEndpoint, account: &str) -> Result<i64, String> {
    let text = ask(admin, "/marks", serde_json::json!({ "account": account })).await?;
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["mark"].as_i64())
        .ok_or_else(|| format!("unexpected answer: {text}"))
}

/// The environment variable whose bearer secret the operator commands (`marks`, `inspect`,
/// `idempotency-forget`, `recover-account`) send to a railguard with authentication on.
pub const SECRET_VAR: &str = "RAILGUARD_SECRET";

/// A running railguard's admin listener, as the operator commands reach it.
#[derive(Debug, Clone)]
pub struct AdminEndpoint {
    pub addr: SocketAddr,
    /// The operator's bearer secret (`$RAILGUARD_SECRET`), for a railguard with
    /// authentication on.
    pub secret: Option<String>,
    /// Whether the listener serves TLS only (`admin.tls_cert_file`). The commands speak plain
    /// HTTP, so they refuse to call such a listener rather than send the secret in clear text.
    pub tls: bool,
}

/// POSTs `body` to `path` on the admin listener `admin`; its text, as an error unless 200.
async fn ask(admin: &AdminEndpoint, path: &str, body: serde_json::Value) -> Result<String, String> {
    ask_within(admin, path, body, Duration::from_secs(10)).await
}

async fn ask_within(
    admin: &AdminEndpoint,
    path: &str,
    body: serde_json::Value,
    limit: Duration,
) -> Result<String, String> {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    if admin.tls {
        return Err(format!(
            "the admin listener at {} serves TLS only (admin.tls_cert_file) and this command \
             speaks plain HTTP: nothing was sent (not ${SECRET_VAR} either)",
            admin.addr
        ));
    }
    let host = if admin.addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], admin.addr.port()))
    } else {
        admin.addr
    };
    let mut request = Request::post(format!("http://{host}{path}"))
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(secret) = &admin.secret {
        request = request.header(header::AUTHORIZATION, format!("Bearer {secret}"));
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let response = tokio::time::timeout(limit, client.request(request))
        .await
        .map_err(|_| format!("railguard's admin listener at {host} did not answer"))?
        .map_err(|e| {
            format!("cannot reach railguard's admin listener at {host} (is it running?): {e}")
        })?;
    let status = response.status();
    let text = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    if status == StatusCode::OK {
        return Ok(text);
    }
    // Errors are JSON: show the code and the message as text.
    let answer = serde_json::from_str::<serde_json::Value>(&text).ok();
    match answer
        .as_ref()
        .and_then(|a| Some((a["error"].as_str()?, a["message"].as_str()?)))
    {
        Some((code, message)) => match answer.as_ref().and_then(|a| a["see"].as_str()) {
            Some(see) => Err(format!("{status} {code}: {message}\nWhat to do: {see}")),
            None => Err(format!("{status} {code}: {message}")),
        },
        None => Err(format!("{status}: {text}")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn owner_stopped_is_an_instance_number_or_unrecorded_and_nothing_else() {
        assert_eq!(
            parse_owner_stopped(json!(7)),
            Ok(OwnerStopped::Instance(InstanceId::from_stored(7)))
        );
        assert_eq!(
            parse_owner_stopped(json!("unrecorded")),
            Ok(OwnerStopped::Unrecorded)
        );
        for refused in [
            json!("7"),
            json!("Unrecorded"),
            json!(" unrecorded"),
            json!(7.5),
            json!(u64::MAX),
            json!(true),
            json!(null),
            json!([7]),
        ] {
            let why = parse_owner_stopped(refused.clone()).unwrap_err();
            assert!(why.starts_with("owner_stopped: "), "{refused}: {why}");
            assert!(why.contains("nothing was done"), "{refused}: {why}");
        }
    }

    /// Every refusal's `see` names a section of the runbook that exists: its code is an anchor
    /// of docs/operations.md as GitHub and `/runbook` make them.
    #[test]
    fn every_forget_refusal_names_a_section_of_the_runbook() {
        let anchors = runbook::anchors();
        for refusal in ForgetRefusal::ALL {
            assert!(
                anchors.iter().any(|a| a == refusal.code()),
                "docs/operations.md has no section `{}`",
                refusal.code()
            );
        }
    }

    /// The procedure reads the same wherever an operator meets it: the contract, the runbook,
    /// `idempotency-forget --help` (`src/cli/idempotency_forget.rs` shows this constant).
    #[test]
    fn the_in_doubt_procedure_is_the_same_text_in_the_contract_and_the_runbook() {
        for (name, text) in [
            ("docs/contract.md", include_str!("../docs/contract.md")),
            ("docs/operations.md", include_str!("../docs/operations.md")),
        ] {
            assert!(
                text.contains(IN_DOUBT_PROCEDURE),
                "{name} does not carry admin::IN_DOUBT_PROCEDURE word for word"
            );
        }
    }
}
