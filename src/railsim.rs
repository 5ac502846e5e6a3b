//! The rail simulator (`railguard rail-sim`): a deliberately non-idempotent payment rail.
//!
//! Every POST is a new payment, accepted and recorded as one ledger entry in arrival order —
//! two identical requests are two payments, which is exactly what makes duplicates visible to
//! the tests and the harness. `GET /ledger` returns the entries as JSON. The fencing headers
//! are recorded as the rail saw them, so a test can read which token each payment came with.
//!
//! [`RailSim::deduplicating`] makes it behave like most payment APIs instead: a POST whose
//! `Idempotency-Key` was already seen on its account is answered with the first payment's
//! response and is not a new payment (it is counted in [`RailSim::absorbed`]).
//!
//! `GET /payments?account=A&idempotency_key=K` is the rail's lookup by idempotency key (what
//! railguard's `[rail_lookup]` asks, and an operator following the in-doubt procedure): `200`
//! with the answer the rail gave the first payment of account `A` that carried key `K`, `404`
//! when the ledger has none; either with `Idempotency-Key: K`, the key it looked up. Read from the ledger alone, so it answers the same until a payment
//! with that key arrives.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::http::{ResponseBody, full};

/// One payment as the rail received it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LedgerEntry {
    /// Arrival order, from 1.
    pub seq: u64,
    pub method: String,
    pub path: String,
    pub account: Option<String>,
    pub token: Option<String>,
    pub idempotency_key: Option<String>,
    pub body_sha256: String,
    pub forwarded_for: Option<String>,
    /// Every header as received, lower-case names, in order.
    pub headers: Vec<(String, String)>,
    pub received_unix_ms: u64,
}

impl LedgerEntry {
    /// The value of header `name` (lower-case), if the rail received it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `(account, idempotency key)` → the payment it made.
type SeenKeys = HashMap<(String, String), u64>;

/// The simulator's state: its ledger and how slow it is.
#[derive(Clone, Default)]
pub struct RailSim {
    ledger: Arc<Mutex<Vec<LedgerEntry>>>,
    latency: Duration,
    jitter: Duration,
    /// `(account, idempotency key)` → payment seq, when deduplicating.
    seen: Option<Arc<Mutex<SeenKeys>>>,
    absorbed: Arc<AtomicU64>,
}

impl RailSim {
    /// A rail that answers each payment `latency` after recording it.
    pub fn new(latency: Duration) -> Self {
        Self {
            ledger: Arc::default(),
            latency,
            ..Self::default()
        }
    }

    /// Also waits a random time up to `jitter` *before* recording a payment, as a network
    /// path with variable delay would: requests sent in one order may arrive in another.
    pub fn with_jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Deduplicates by `Idempotency-Key` per account, as most payment APIs do.
    pub fn deduplicating(mut self) -> Self {
        self.seen = Some(Arc::default());
        self
    }

    /// Repeats of a seen idempotency key answered without a new payment.
    pub fn absorbed(&self) -> u64 {
        self.absorbed.load(Ordering::Relaxed)
    }

    fn arrival_delay(&self) -> Duration {
        use std::hash::{BuildHasher, RandomState};
        let max = self.jitter.as_micros() as u64;
        if max == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros(RandomState::new().hash_one(std::time::Instant::now()) % max)
    }

    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub async fn handle(
        self,
        request: Request<Incoming>,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let json = |status: StatusCode, value: serde_json::Value| {
            Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, "application/json")
                .body(full(value.to_string()))
                .expect("static response parts")
        };
        match (request.method(), request.uri().path()) {
            (&Method::GET, "/ledger") => {
                let entries = self.ledger();
                Ok(json(
                    StatusCode::OK,
                    serde_json::json!({ "entries": entries }),
                ))
            }
            (&Method::GET, LOOKUP_PATH) => Ok(self.lookup(request.uri().query())),
            (&Method::POST, _) => {
                // A payment that left the sender is on its way whether or not the sender is
                // still waiting: record it even if the client disconnects meanwhile.
                let sim = self.clone();
                let payment = tokio::spawn(async move { sim.pay(request).await });
                Ok(payment.await.unwrap_or_else(|e| {
                    json(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        serde_json::json!({"error": e.to_string()}),
                    )
                }))
            }
            _ => Ok(json(
                StatusCode::NOT_FOUND,
                serde_json::json!({
                    "error": "POST a payment, GET /ledger, or GET /payments?account=..&idempotency_key=.."
                }),
            )),
        }
    }

    /// The first payment of `account` that carried idempotency key `key`, if the rail has one.
    pub fn payment_with_key(&self, account: &str, key: &str) -> Option<u64> {
        self.ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|e| {
                e.account.as_deref() == Some(account) && e.idempotency_key.as_deref() == Some(key)
            })
            .map(|e| e.seq)
    }

    /// `GET /payments?account=..&idempotency_key=..`: `200` with the payment's answer, `404`
    /// when the rail has no payment with that key, `400` when either is missing.
    fn lookup(&self, query: Option<&str>) -> Response<ResponseBody> {
        let mut account = None;
        let mut key = None;
        for pair in query.unwrap_or("").split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "account" => account = form_decoded(value),
                "idempotency_key" => key = form_decoded(value),
                _ => {}
            }
        }
        let (Some(account), Some(key)) = (account, key) else {
            return json_response(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": "both account and idempotency_key are required"}),
            );
        };
        let mut response = match self.payment_with_key(&account, &key) {
            Some(seq) => json_response(StatusCode::OK, accepted(seq)),
            None => json_response(
                StatusCode::NOT_FOUND,
                serde_json::json!({"error": "no payment with this idempotency key"}),
            ),
        };
        // The key it looked up, echoed: what makes this an answer about that payment.
        if let Ok(value) = http::HeaderValue::from_str(&key) {
            response.headers_mut().insert(LOOKUP_KEY_HEADER, value);
        }
        response
    }

    async fn pay(self, request: Request<Incoming>) -> Response<ResponseBody> {
        let json = |status: StatusCode, value: serde_json::Value| {
            Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, "application/json")
                .body(full(value.to_string()))
                .expect("static response parts")
        };
        let (parts, body) = request.into_parts();
        let body = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                return json(
                    StatusCode::BAD_REQUEST,
                    serde_json::json!({"error": e.to_string()}),
                );
            }
        };
        let delay = self.arrival_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let dedupe_key = match (
            &self.seen,
            header("fencing-account"),
            header("idempotency-key"),
        ) {
            (Some(_), Some(account), Some(key)) => Some((account, key)),
            _ => None,
        };
        let seq = {
            let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
            if let (Some(seen), Some(dedupe_key)) = (&self.seen, &dedupe_key) {
                let seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(&first) = seen.get(dedupe_key) {
                    drop((seen, ledger));
                    self.absorbed.fetch_add(1, Ordering::Relaxed);
                    return json(StatusCode::CREATED, accepted(first));
                }
            }
            let seq = ledger.len() as u64 + 1;
            ledger.push(LedgerEntry {
                seq,
                method: parts.method.to_string(),
                path: parts
                    .uri
                    .path_and_query()
                    .map(|p| p.as_str().to_string())
                    .unwrap_or_else(|| "/".into()),
                account: header("fencing-account"),
                token: header("fencing-token"),
                idempotency_key: header("idempotency-key"),
                body_sha256: Sha256::digest(&body)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect(),
                forwarded_for: header("x-forwarded-for"),
                headers: parts
                    .headers
                    .iter()
                    .map(|(n, v)| {
                        (
                            n.as_str().to_string(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect(),
                received_unix_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
            });
            if let (Some(seen), Some(dedupe_key)) = (&self.seen, dedupe_key) {
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(dedupe_key, seq);
            }
            seq
        };
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        json(StatusCode::CREATED, accepted(seq))
    }
}

/// The header in which a lookup's answer names the key it looked up (railguard acts only on an
/// answer that does: `proxy::idempotency::resolve`).
pub const LOOKUP_KEY_HEADER: &str = "idempotency-key";

/// Where the rail answers its lookup by idempotency key.
pub const LOOKUP_PATH: &str = "/payments";

/// The rail's answer to payment `seq`: the same to the payment and to a lookup of it.
fn accepted(seq: u64) -> serde_json::Value {
    serde_json::json!({ "payment": seq, "status": "accepted" })
}

/// A query value, `application/x-www-form-urlencoded`: `+` is a space, `%XX` a byte. `None`
/// when it is not UTF-8 or a `%` is not followed by two hex digits.
fn form_decoded(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

fn json_response(status: StatusCode, value: serde_json::Value) -> Response<ResponseBody> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(value.to_string()))
        .expect("static response parts")
}
