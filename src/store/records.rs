//! Idempotency records in PostgreSQL (C3 §3.1): what the proxy remembers about a request it
//! forwarded with an `Idempotency-Key`, so that a repeat gets the same answer without the rail
//! seeing the payment twice.
//!
//! A record is created by the fence's compare-and-set statement (`proxy::fence`'s group commit), in the
//! same transaction, as `in_flight`; it becomes `done` with the rail's response. Keys are
//! scoped per account.
//!
//! **In doubt.** A record is *in doubt* when whether the rail acted is unknown: its owner said
//! so (its forward ended without an answer: a timeout, a broken connection), or the owner's
//! own deadline — recorded with the record by the owner, never taken from a reader's
//! configuration — passed without a completion (the owner crashed, or lost its database, or
//! is paused). A record in doubt is never forwarded again on its own, and retention does not
//! remove it either.
//!
//! **Forget** ([`IdempotencyStore::forget_in_doubt`]) removes a record in doubt so that the
//! next retry is forwarded — and refuses while its owner may still send it: a record is
//! forgotten only when its owner declared it in doubt (its forward is over) or the owner's
//! deadline passed, *and* the owning railguard process has stopped: it recorded a clean stop,
//! or an operator who saw it stop says so. Its instance lock ([`InstanceId`]) shows a running
//! owner, never a stopped one (see `instance`). A record that names no owner (made before
//! migration 0004) has neither lock nor clean stop to speak for it: only the operator's word
//! that every railguard running when it was made has stopped ([`OwnerStopped::Unrecorded`]).
//! And bytes already past the owner may still be on their way to the rail: forget waits until
//! the record's in-doubt deadline plus `proxy.rail_transit_ms` has passed, and, for an owner
//! whose forward ended without an answer shortly before its clean stop, until the `quiet_after`
//! that stop recorded — by the database's clock, and telling the operator when. What no check
//! here can see — a network slower than `proxy.rail_transit_ms` says, the time between an
//! operator's "it has stopped" and the stop itself, or a rail that received a request and has
//! not recorded it yet — is the operator's part of the procedure (`admin::IN_DOUBT_PROCEDURE`:
//! ask the rail only once all of that has passed), and why the proxy forwards
//! `Idempotency-Key` to the rail: a rail that deduplicates by it absorbs the rest.
//!
//! **The rail's lookup** (`resolve`, `[rail_lookup]`) completes a record in doubt with the
//! rail's answer when the rail has the payment ([`IdempotencyStore::complete_from_the_rail`]),
//! and, when it has not, forgets it through forget's own checks, without an operator's word
//! ([`IdempotencyStore::forget_not_on_the_rail`]); each with its audit record.
//!
//! **Completions are group-committed** (`outcomes`): concurrent requests'
//! answers are stored by one statement and one commit, and each request still waits for the
//! commit that holds its answer.
//!
//! **Outcomes are not dropped.** A completion (or a declaration of doubt) that cannot be
//! stored at once, because the database is down, is retried in the background until it is,
//! for up to an hour, so a payment that succeeded stays replayable.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::Pool;
use tokio::sync::{mpsc, oneshot};

use self::outcomes::{Complete, Completion};
use crate::db::DbError;
use crate::store::batch::{self, Batching};
use crate::store::instance::InstanceId;
use crate::token::AccountId;
use crate::work::{Tracked, Work};

mod api;
mod completion;
mod forget;
mod outcomes;

pub use self::api::{BoxFuture, Created, NewRecord, RecordId, Records};
pub use crate::store::completions::COMPLETE_SQL;

pub use self::completion::CompletionError;
use self::completion::Unstored;
pub use self::forget::{Because, FIRST_REQUEST_AFTER_STORE_CHANGE, Forgot, OwnerStopped};

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
    /// Its owner may still be forwarding it.
    InFlight,
    /// Whether the rail acted is unknown (see the module docs).
    InDoubt,
    Done(StoredResponse),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: String,
    /// The token of the grant whose request made the record.
    pub token: i64,
    pub state: RecordState,
}

/// Reads and writes idempotency records.
#[derive(Clone)]
pub struct IdempotencyStore {
    pool: Pool,
    /// Where the completion batcher runs its statements (`db::build_completion_pool`).
    completion_sessions: Pool,
    timeout: Duration,
    outcomes: OutcomeMetrics,
    /// The completion batcher's queue ([`outcomes`]); `None` in the handle the batcher keeps
    /// for its fallback, which only retries in the background.
    completions: Option<mpsc::Sender<Completion>>,
    /// Where the removal of a record nobody was told about is counted, so that shutdown waits
    /// for it (`store::batch::slots`).
    unanswered: Tracked,
    /// Outcomes retried in the background until the database takes them, counted so that a
    /// graceful stop waits for them within its grace ([`Self::outcomes_retrying`]).
    retrying: Tracked,
    /// `proxy.rail_transit_ms`: how long a request may spend on its way to the rail; forget
    /// waits for it past a record's in-doubt deadline ([`Self::forget_in_doubt`]).
    rail_transit: Duration,
}

/// How outcomes are shown: those waiting for the database, those given up on, and how
/// completions are grouped.
#[derive(Clone)]
pub struct OutcomeMetrics {
    pub pending: prometheus::IntGauge,
    pub lost: prometheus::IntCounter,
    pub batch_sizes: prometheus::Histogram,
}

/// Most outcomes retried at once; past it, new ones are given up on (and counted).
const MAX_PENDING_OUTCOMES: i64 = 100_000;
/// How long an outcome is retried.
const OUTCOME_RETRY_FOR: Duration = Duration::from_secs(3600);
/// `proxy.rail_transit_ms` of a store built without it (`config::ProxyConfig`'s default).
const DEFAULT_RAIL_TRANSIT: Duration = Duration::from_secs(30);

/// An outcome to store for a record this process owns.
#[derive(Debug, Clone)]
enum Outcome {
    Done(StoredResponse),
    /// The rail's answer after the forward had ended without it: completes a record in doubt
    /// too.
    LateDone(StoredResponse),
    InDoubt,
    /// The request never reached the rail: the record goes.
    Unsent,
}

impl IdempotencyStore {
    /// Starts the completion batcher (it stops when the last clone of the store is dropped);
    /// `batching` groups completions as the fence groups its compare-and-sets, and their
    /// statements run on `completion_sessions` (`db::build_completion_pool`).
    pub fn new(
        pool: Pool,
        completion_sessions: Pool,
        timeout: Duration,
        batching: Batching,
        outcomes: OutcomeMetrics,
    ) -> Self {
        let (completions, queue) = mpsc::channel(outcomes::QUEUE_LIMIT);
        let retrying = batching.unanswered.tracker().of(Work::Outcome);
        // Not a clone of the store: the batcher must not hold its own queue open.
        let retries = Self {
            pool: pool.clone(),
            completion_sessions: completion_sessions.clone(),
            timeout,
            outcomes: outcomes.clone(),
            completions: None,
            unanswered: batching.unanswered.clone(),
            retrying: retrying.clone(),
            rail_transit: DEFAULT_RAIL_TRANSIT,
        };
        let fallback: outcomes::Fallback = Arc::new(move |record: RecordId, response| {
            retries.complete_eventually(record.account, record.key, record.owner, response);
        });
        let max_batch = batching.max_batch;
        tokio::spawn(batch::run(
            Complete {
                pool: pool.clone(),
                sessions: completion_sessions.clone(),
                fallback,
            },
            batching.clone(),
            timeout,
            max_batch,
            Some(outcomes.batch_sizes.clone()),
            queue,
        ));
        Self {
            pool,
            completion_sessions,
            timeout,
            outcomes,
            completions: Some(completions),
            unanswered: batching.unanswered,
            retrying,
            rail_transit: DEFAULT_RAIL_TRANSIT,
        }
    }

    /// The network's `proxy.rail_transit_ms`, which forget waits for past a record's in-doubt
    /// deadline (by default `proxy.rail_transit_ms`'s default).
    pub fn with_rail_transit(mut self, rail_transit: Duration) -> Self {
        self.rail_transit = rail_transit;
        self
    }

    /// Outcomes still retried in the background (the database did not take them at once):
    /// a graceful stop waits for them within its grace, so that a stop
    /// while the database is briefly away does not leave their records in flight, then in
    /// doubt.
    pub fn outcomes_retrying(&self) -> Tracked {
        self.retrying.clone()
    }

    /// `/readyz`: a completion session can be opened (every keyed request's answer is stored
    /// on one).
    pub async fn ready(&self) -> Result<(), String> {
        let session = tokio::time::timeout(self.timeout, self.completion_sessions.get())
            .await
            .map_err(|_| format!("no answer within {:?}", self.timeout))?;
        session.map(drop).map_err(|e| {
            format!(
                "the idempotency completions' sessions: {}",
                DbError::from(e)
            )
        })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, DbError> {
        self.pool
            .get()
            .await
            .map_err(|e| DbError::Pool(e.to_string()))
    }

    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, DbError>>,
    ) -> Result<T, DbError> {
        tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or(Err(DbError::Timeout(self.timeout)))
    }

    pub async fn find(&self, account: &AccountId, key: &str) -> Result<Option<Record>, DbError> {
        self.bounded(async {
            let client = self.client().await?;
            let row = client
                .query_opt(
                    "SELECT fingerprint,
                            CASE WHEN state = 'done' THEN 'done'
                                 WHEN state = 'in_doubt'
                                   OR now() > COALESCE(in_doubt_at, created_at) THEN 'in_doubt'
                                 ELSE 'in_flight' END,
                            status, headers::text, body, body_stored, token
                     FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2",
                    &[&account.as_str(), &key],
                )
                .await?;
            Ok(row.map(|row| {
                let state: String = row.get(1);
                let state = if state == "in_doubt" {
                    RecordState::InDoubt
                } else if state == "in_flight" {
                    RecordState::InFlight
                } else {
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
                };
                Record {
                    fingerprint: row.get(0),
                    token: row.get(6),
                    state,
                }
            }))
        })
        .await
    }

    /// Deletes completed records older than `retention`, a bounded number at a time. Records
    /// still in flight are never removed here: a retry of one in doubt must not be forwarded
    /// just because time passed; an operator decides (`forget_in_doubt`).
    pub async fn sweep(&self, retention: Duration) -> Result<u64, DbError> {
        let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        self.bounded(async {
            let client = self.client().await?;
            let deleted = client
                .execute(
                    // `created_at` adds nothing to the condition (a record is completed
                    // after it is created) but names the column indexed for it, which the
                    // completion leaves alone, so that it stays a HOT update
                    // (`db::maintenance`); with migration 0003's index on `completed_at`
                    // instead, the same condition finds its rows through that one.
                    "DELETE FROM idempotency_record WHERE ctid IN (
                         SELECT ctid FROM idempotency_record
                         WHERE created_at < now() - $1::bigint * interval '1 millisecond'
                           AND state = 'done'
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

/// A key first sent under a token below the floor (before the store last went back) whose
/// record is not there now: it may have been made, and lost with the store.
const FIRST_ATTEMPT_LOST_SQL: &str = "\
SELECT (SELECT floor FROM railguard_store_epoch) > $3
   AND NOT EXISTS (SELECT 1 FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2)";

impl Records for IdempotencyStore {
    fn find<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, DbError>> {
        Box::pin(IdempotencyStore::find(self, account, key))
    }

    fn first_attempt_lost<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
        first_token: i64,
    ) -> BoxFuture<'a, Result<bool, DbError>> {
        Box::pin(self.bounded(async move {
            let client = self.client().await?;
            let row = client
                .query_one(
                    FIRST_ATTEMPT_LOST_SQL,
                    &[&account.as_str(), &key, &first_token],
                )
                .await?;
            Ok(row.get(0))
        }))
    }

    fn complete(&self, record: RecordId, response: StoredResponse) -> BoxFuture<'static, ()> {
        // Queued now rather than when the future is first polled: from here on the completion
        // is stored even if the caller stops waiting (its client hung up).
        let queued = match self.queue_completion(record.clone(), response.clone()) {
            Ok(queued) => queued,
            Err(e) => {
                self.complete_later(&e, record, response);
                return Box::pin(async {});
            }
        };
        let store = self.clone();
        Box::pin(async move {
            match queued.wait().await {
                Ok(()) => {}
                Err(Unstored::Retry(e)) => store.complete_later(&e, record, response),
                Err(Unstored::InBatch(e)) => tracing::warn!(error = %e, account = %record.account,
                    "the rail's response is not stored for replay yet; its batch keeps it, and \
                     retries it in the background should the batch fail"),
            }
        })
    }

    fn declare_in_doubt(&self, record: RecordId) {
        self.declare_in_doubt_eventually(record.account, record.key, record.owner);
    }

    fn complete_late(&self, record: RecordId, response: StoredResponse) {
        self.store_eventually(
            record.account,
            record.key,
            record.owner,
            Outcome::LateDone(response),
        );
    }

    fn forget_unsent(&self, record: RecordId) {
        self.delete_unsent(record);
    }

    fn complete_from_the_rail<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
        response: StoredResponse,
    ) -> BoxFuture<'a, Result<bool, DbError>> {
        Box::pin(async move {
            IdempotencyStore::complete_from_the_rail(self, account, key, &response).await
        })
    }

    fn audit_first_request_after_store_change<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), DbError>> {
        Box::pin(IdempotencyStore::audit_first_request_after_store_change(
            self, account, key,
        ))
    }

    fn forget_not_on_the_rail<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<Forgot, DbError>> {
        Box::pin(IdempotencyStore::forget_not_on_the_rail(
            self, account, key, dry_run,
        ))
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
