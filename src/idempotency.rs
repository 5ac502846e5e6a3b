//! Idempotency records in PostgreSQL (C3 §3.1): what the proxy remembers about a request it
//! forwarded with an `Idempotency-Key`, so that a repeat gets the same answer without the rail
//! seeing the payment twice.
//!
//! A record is created by the fence's compare-and-set statement (`high_water::batch`), in the
//! same transaction, as `in_flight`; it becomes `done` with the rail's response. Keys are
//! scoped per account. A record still `in_flight` after the longest a forward can take
//! (`request_timeout` plus a margin) belongs to a proxy that crashed or lost its database
//! mid-request: whether the rail acted is unknown, so the record is *in doubt* and is never
//! forwarded again on its own. The operator's way out is `railguard idempotency-forget`, after
//! checking the rail's own records.

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
            let client = self
                .pool
                .get()
                .await
                .map_err(|e| StoreError::Pool(e.to_string()))?;
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

    /// Stores the rail's response: the record is `done` from now on.
    pub async fn complete(
        &self,
        account: &AccountId,
        key: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&response.headers).expect("headers serialize");
        let body: Option<&[u8]> = response.body.as_deref();
        self.bounded(async {
            let client = self
                .pool
                .get()
                .await
                .map_err(|e| StoreError::Pool(e.to_string()))?;
            client
                .execute(
                    "UPDATE idempotency_record
                     SET state = 'done', status = $3, headers = $4::text::jsonb, body = $5,
                         body_stored = $6, completed_at = now()
                     WHERE account_id = $1 AND idempotency_key = $2 AND state = 'in_flight'",
                    &[
                        &account.as_str(),
                        &key,
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

    /// Deletes an `in_flight` record: for a request known never to have reached the rail, or
    /// by an operator who checked. Returns whether one was deleted.
    pub async fn forget(&self, account: &AccountId, key: &str) -> Result<bool, StoreError> {
        self.bounded(async {
            let client = self
                .pool
                .get()
                .await
                .map_err(|e| StoreError::Pool(e.to_string()))?;
            let deleted = client
                .execute(
                    "DELETE FROM idempotency_record
                     WHERE account_id = $1 AND idempotency_key = $2 AND state = 'in_flight'",
                    &[&account.as_str(), &key],
                )
                .await?;
            Ok(deleted > 0)
        })
        .await
    }

    /// Deletes records created more than `retention` ago, a bounded number at a time.
    pub async fn sweep(&self, retention: Duration) -> Result<u64, StoreError> {
        let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        self.bounded(async {
            let client = self
                .pool
                .get()
                .await
                .map_err(|e| StoreError::Pool(e.to_string()))?;
            let deleted = client
                .execute(
                    "DELETE FROM idempotency_record WHERE ctid IN (
                         SELECT ctid FROM idempotency_record
                         WHERE created_at < now() - $1::bigint * interval '1 millisecond'
                         LIMIT 10000)",
                    &[&retention_ms],
                )
                .await?;
            Ok(deleted)
        })
        .await
    }
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
