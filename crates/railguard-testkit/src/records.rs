//! Idempotency records made straight in PostgreSQL, batches that complete them, and a store
//! over a pool: for the tests of the statements behind records (railguard's own path makes
//! records over HTTP).

use std::time::Duration;

use railguard::store::batch::Batching;
use railguard::store::records::{IdempotencyStore, OutcomeMetrics};
use tokio_postgres::types::ToSql;

/// In-flight records for accounts `acct-{from..=to}`, key `key-{n}`, owner `owner-{n}`.
pub async fn insert_in_flight(client: &tokio_postgres::Client, from: i64, to: i64) {
    client
        .execute(
            "INSERT INTO idempotency_record
                 (account_id, idempotency_key, fingerprint, token, owner, state)
             SELECT 'acct-' || g, 'key-' || g, 'fp', g, 'owner-' || g, 'in_flight'
             FROM generate_series($1::bigint, $2::bigint) g",
            &[&from, &to],
        )
        .await
        .unwrap();
}

/// Each record's (key, state), in key order.
pub async fn record_states(client: &tokio_postgres::Client) -> Vec<(String, String)> {
    client
        .query(
            "SELECT idempotency_key, state FROM idempotency_record ORDER BY idempotency_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// The arrays of a completion batch (`railguard::store::records::COMPLETE_SQL`) for the
/// records [`insert_in_flight`] made: a 201 with a small JSON answer each.
pub struct Completions {
    accounts: Vec<String>,
    keys: Vec<String>,
    owners: Vec<String>,
    statuses: Vec<i16>,
    headers: Vec<String>,
    bodies: Vec<Vec<u8>>,
    stored: Vec<bool>,
}

impl Completions {
    pub fn of(ids: &[i64]) -> Self {
        Self {
            accounts: ids.iter().map(|i| format!("acct-{i}")).collect(),
            keys: ids.iter().map(|i| format!("key-{i}")).collect(),
            owners: ids.iter().map(|i| format!("owner-{i}")).collect(),
            statuses: ids.iter().map(|_| 201).collect(),
            headers: ids
                .iter()
                .map(|_| r#"{"content-type":"application/json"}"#.to_string())
                .collect(),
            bodies: ids
                .iter()
                .map(|i| format!(r#"{{"payment":{i},"status":"accepted"}}"#).into_bytes())
                .collect(),
            stored: ids.iter().map(|_| true).collect(),
        }
    }

    /// The statement's seven parameters, in order.
    pub fn params(&self) -> [&(dyn ToSql + Sync); 7] {
        [
            &self.accounts,
            &self.keys,
            &self.owners,
            &self.statuses,
            &self.headers,
            &self.bodies,
            &self.stored,
        ]
    }
}

/// An idempotency store over `pool`, with completion sessions of its own on `url` and metrics
/// of its own.
pub fn idempotency_store(
    url: &str,
    pool: deadpool_postgres::Pool,
    timeout: Duration,
) -> IdempotencyStore {
    let batching = Batching::default();
    let sessions = railguard::db::build_completion_pool(
        url,
        railguard::store::batch::most_in_flight(batching.concurrency),
        timeout,
    )
    .expect("completion sessions");
    IdempotencyStore::new(
        pool,
        sessions,
        timeout,
        batching,
        OutcomeMetrics {
            pending: ::prometheus::IntGauge::new("pending", "pending").unwrap(),
            lost: ::prometheus::IntCounter::new("lost", "lost").unwrap(),
            batch_sizes: ::prometheus::Histogram::with_opts(::prometheus::HistogramOpts::new(
                "completion_batch",
                "completion_batch",
            ))
            .unwrap(),
        },
    )
}

/// How many idempotency records carry `key`, on any account.
pub async fn records_keyed(client: &tokio_postgres::Client, key: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM idempotency_record WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

/// The state of the idempotency record carrying `key` (one account's), if there is one.
pub async fn state_of(client: &tokio_postgres::Client, key: &str) -> Option<String> {
    client
        .query_opt(
            "SELECT state FROM idempotency_record WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}
