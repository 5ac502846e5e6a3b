//! Idempotency records in PostgreSQL (C3 §3.1): what the proxy remembers about a request it
//! forwarded with an `Idempotency-Key`, so that a repeat gets the same answer without the rail
//! seeing the payment twice.
//!
//! A record is created by the fence's compare-and-set statement (`high_water::batch`), in the
//! same transaction, as `in_flight`; it becomes `done` with the rail's response. Keys are
//! scoped per account. A record still `in_flight` after the longest a forward can take
//! (`request_timeout` plus a margin) belongs to a proxy that crashed or lost its database
//! mid-request: whether the rail acted is unknown, so the record is *in doubt* and is never
//! forwarded again on its own, and retention does not remove it either. The operator's way out
//! is `railguard idempotency-forget`, after checking the rail's own records.

use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use sha2::{Digest, Sha256};

use crate::high_water::StoreError;
use crate::token::AccountId;

/// What identifies "the same request" for one key: method, path and query, and body.
pub fn fingerprint(method: &str, path_and_query: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    hash.update(method.as_bytes());
    hash.update([0]);
    hash.update(path_and_query.as_bytes());
    hash.update([0]);
    hash.update(body);
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A random id for the request that may create a record (128 bits, hex).
pub fn new_owner() -> String {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{:016x}{:016x}",
        state.hash_one(nanos),
        state.hash_one((nanos, std::process::id()))
    )
}

/// A key as received: 1 to 255 bytes of visible ASCII.
pub fn parse_key(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 255 {
        return Err("must be 1 to 255 bytes".into());
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be visible ASCII without spaces".into());
    }
    Ok(text.to_string())
}

/// A stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// `None` when the body was larger than `max_response_bytes` and was not kept.
    pub body: Option<Bytes>,
}

/// A record as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    InFlight { age: Duration },
    Done(StoredResponse),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: String,
    pub state: RecordState,
}

/// Reads and writes idempotency records.
#[derive(Clone)]
pub struct IdempotencyStore {
    pool: Pool,
    timeout: Duration,
}

impl IdempotencyStore {
    pub fn new(pool: Pool, timeout: Duration) -> Self {
        Self { pool, timeout }
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Pool(e.to_string()))
    }

    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.timeout)))
    }

    pub async fn find(&self, account: &AccountId, key: &str) -> Result<Option<Record>, StoreError> {
        self.bounded(async {
            let client = self.client().await?;
            let row = client
                .query_opt(
                    "SELECT fingerprint, state, status, headers::text, body, body_stored,
                            (extract(epoch FROM now() - created_at) * 1000)::bigint
                     FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2",
                    &[&account.as_str(), &key],
                )
                .await?;
            Ok(row.map(|row| {
                let state: String = row.get(1);
                let state = if state == "done" {
                    let headers: Option<String> = row.get(3);
                    let headers = headers
                        .and_then(|h| serde_json::from_str(&h).ok())
                        .unwrap_or_default();
                    let stored: bool = row.get::<_, Option<bool>>(5).unwrap_or(false);
                    let body: Option<Vec<u8>> = row.get(4);
                    RecordState::Done(StoredResponse {
                        status: row.get::<_, Option<i16>>(2).unwrap_or(0) as u16,
                        headers,
                        body: if stored {
                            Some(Bytes::from(body.unwrap_or_default()))
                        } else {
                            None
                        },
                    })
                } else {
                    RecordState::InFlight {
                        age: Duration::from_millis(row.get::<_, i64>(6).max(0) as u64),
                    }
                };
                Record {
                    fingerprint: row.get(0),
                    state,
                }
            }))
        })
        .await
    }

    /// Stores the rail's response: the record is `done` from now on. Only the request that
    /// owns the record can complete it.
    pub async fn complete(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&response.headers).expect("headers serialize");
        let body: Option<&[u8]> = response.body.as_deref();
        self.bounded(async {
            let client = self.client().await?;
            client
                .execute(
                    "UPDATE idempotency_record
                     SET state = 'done', status = $4, headers = $5::text::jsonb, body = $6,
                         body_stored = $7, completed_at = now()
                     WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3
                       AND state = 'in_flight'",
                    &[
                        &account.as_str(),
                        &key,
                        &owner,
                        &(response.status as i16),
                        &headers,
                        &body,
                        &response.body.is_some(),
                    ],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// Removes, in the background, the in-flight records of requests known never to have
    /// reached the rail, by owner id.
    pub fn forget_unsent(&self, owners: Vec<String>) {
        crate::high_water::forget_records(self.pool.clone(), owners, self.timeout);
    }

    /// The operator's way out of `in_doubt`: deletes the record if it is in flight and older
    /// than `in_doubt_after` — a record whose forward may still be running is never touched.
    pub async fn forget_in_doubt(
        &self,
        account: &AccountId,
        key: &str,
        in_doubt_after: Duration,
    ) -> Result<Forgot, StoreError> {
        let after_ms = i64::try_from(in_doubt_after.as_millis()).unwrap_or(i64::MAX);
        self.bounded(async {
            let client = self.pool.get().await.map_err(|e| StoreError::Pool(e.to_string()))?;
            let row = client
                .query_opt(
                    "WITH gone AS (
                         DELETE FROM idempotency_record
                         WHERE account_id = $1 AND idempotency_key = $2 AND state = 'in_flight'
                           AND created_at < now() - $3::bigint * interval '1 millisecond'
                         RETURNING 1)
                     SELECT (SELECT count(*) FROM gone),
                            (SELECT state FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2)",
                    &[&account.as_str(), &key, &after_ms],
                )
                .await?;
            let (deleted, state): (i64, Option<String>) = row.map(|r| (r.get(0), r.get(1))).unwrap_or((0, None));
            Ok(match (deleted, state.as_deref()) {
                (1.., _) => Forgot::Forgotten,
                (_, Some("done")) => Forgot::Completed,
                (_, Some(_)) => Forgot::StillInFlight,
                (_, None) => Forgot::NotFound,
            })
        })
        .await
    }

    /// Deletes completed records older than `retention`, a bounded number at a time. Records
    /// still in flight are never removed here: a retry of one in doubt must not be forwarded
    /// just because time passed; an operator decides (`forget_in_doubt`).
    pub async fn sweep(&self, retention: Duration) -> Result<u64, StoreError> {
        let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        self.bounded(async {
            let client = self.client().await?;
            let deleted = client
                .execute(
                    "DELETE FROM idempotency_record WHERE ctid IN (
                         SELECT ctid FROM idempotency_record
                         WHERE state = 'done'
                           AND completed_at < now() - $1::bigint * interval '1 millisecond'
                         LIMIT 10000)",
                    &[&retention_ms],
                )
                .await?;
            Ok(deleted)
        })
        .await
    }
}

/// What `forget_in_doubt` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgot {
    Forgotten,
    /// The record is complete: the rail answered; nothing to forget.
    Completed,
    /// In flight but not yet in doubt: its forward may still be running.
    StillInFlight,
    NotFound,
}

/// Removes expired records every `interval` until the process ends.
pub async fn sweep_forever(store: IdempotencyStore, retention: Duration, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        loop {
            match store.sweep(retention).await {
                Ok(n) if n >= 10_000 => continue,
                Ok(0) => break,
                Ok(n) => {
                    tracing::info!(
                        records = n,
                        ?retention,
                        "removed expired idempotency records"
                    );
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "idempotency retention sweep failed");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_separate_method_path_and_body() {
        let a = fingerprint("POST", "/pay", b"{}");
        assert_eq!(a, fingerprint("POST", "/pay", b"{}"));
        assert_ne!(a, fingerprint("PUT", "/pay", b"{}"));
        assert_ne!(a, fingerprint("POST", "/pay?x=1", b"{}"));
        assert_ne!(a, fingerprint("POST", "/pay", b"{ }"));
        assert_ne!(
            fingerprint("POST", "/a", b"b"),
            fingerprint("POST", "/ab", b"")
        );
    }

    #[test]
    fn key_grammar() {
        assert!(parse_key("pay-2026-12-02-0001").is_ok());
        assert!(parse_key("").is_err());
        assert!(parse_key("a b").is_err());
        assert!(parse_key(&"k".repeat(256)).is_err());
    }
}
