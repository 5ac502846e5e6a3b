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

use super::InstanceId;
use super::outcomes::{self, Completion};
use super::record::{BoxFuture, RecordId, Records};
use crate::db::DbError;
use crate::db::slots::Unanswered;
use crate::proxy::fence::Batching;
use crate::token::AccountId;

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

/// Takes the owner's instance lock, shared, for the rest of forget's transaction, if the owner
/// does not hold it: false while the owning process holds it (it is running), and an owner that
/// reconnects meanwhile waits until forget has committed, so a check and its delete see the
/// same owner. Shared, so that concurrent forgets of one owner's records do not refuse each
/// other.
const OWNER_LOCK_FREE_SQL: &str = "SELECT pg_try_advisory_xact_lock_shared($1)";

/// Whether the owning process said, as it stopped, that it had nothing left to send
/// ([`super::instance::record_clean_stop`]): from when nothing it sent can reach the rail
/// (`quiet_after`; NULL when it recorded no clean stop), and its `proxy.rail_transit_ms`. A
/// clean stop recorded by an older binary says no `quiet_after`: it is taken as the stop's
/// time plus this process's `rail_transit_ms` (`$2`).
const OWNER_STOPPED_CLEANLY_SQL: &str = "\
SELECT max(COALESCE((outcome->>'quiet_after')::timestamptz,
                    COALESCE(finished_at, at) + $2::bigint * interval '1 millisecond')),
       max((outcome->>'rail_transit_ms')::bigint)
FROM railguard_audit
WHERE action = 'instance_stopped' AND (outcome->>'instance')::bigint = $1";

/// When a record's request can no longer reach the rail, and whether that time has passed (by
/// the database's clock): its in-doubt deadline (`$1`) plus the transit time (`$2`, ms) — no
/// forward of it is written past its deadline by an owner that has stopped, except one whose end
/// its clean stop covers — and not before the owner's `quiet_after` (`$3`, if it stopped
/// cleanly). Also the wait left, in whole seconds.
const QUIET_SQL: &str = "\
SELECT now() > t, to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US\"Z\"'),
       GREATEST(ceil(extract(epoch FROM t - now())), 0)::bigint
FROM (SELECT GREATEST($1::timestamptz + $2::bigint * interval '1 millisecond',
                      $3::timestamptz) AS t) AS q";

/// Completes a record in doubt — declared so by its owner, or past its owner's deadline —
/// with the rail's answer to a lookup of its key; its owner instance, for the audit record.
const COMPLETE_FROM_THE_RAIL_SQL: &str = "\
UPDATE idempotency_record
SET state = 'done', status = $3, headers = $4::text::jsonb, body = $5, body_stored = $6,
    completed_at = now()
WHERE account_id = $1 AND idempotency_key = $2
  AND (state = 'in_doubt' OR (state = 'in_flight' AND now() > COALESCE(in_doubt_at, created_at)))
RETURNING owner_instance";

/// The audit record of a record completed from the rail's lookup, in its transaction.
const AUDIT_RESOLVE_SQL: &str = "\
INSERT INTO railguard_audit (action, account_id, reason, outcome, finished_at)
VALUES ('idempotency_resolve', $1, $2, $3::text::jsonb, now())";

/// The audit record of a forget, written in its transaction: no delete without it.
const AUDIT_FORGET_SQL: &str = "\
INSERT INTO railguard_audit (action, account_id, reason, outcome, finished_at)
VALUES ('idempotency_forget', $1, $2, $3::text::jsonb, now())";

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
    /// for it (`db::slots`).
    unanswered: Unanswered,
    /// Outcomes retried in the background until the database takes them, counted so that a
    /// graceful stop waits for them within its grace ([`Self::outcomes_retrying`]).
    retrying: Unanswered,
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
        let retrying = Unanswered::default();
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
        tokio::spawn(outcomes::run(
            pool.clone(),
            completion_sessions.clone(),
            batching.clone(),
            timeout,
            outcomes.batch_sizes.clone(),
            fallback,
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
    /// a graceful stop waits for [`Unanswered::none_left`] within its grace, so that a stop
    /// while the database is briefly away does not leave their records in flight, then in
    /// doubt.
    pub fn outcomes_retrying(&self) -> Unanswered {
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

    /// Stores the rail's response: the record is `done` from now on. Only the request that
    /// owns the record can complete it. One statement for this record alone: the background
    /// retry's. Requests' own completions are group-committed (`outcomes`).
    pub async fn complete(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), DbError> {
        let record = RecordId {
            account: account.clone(),
            key: key.to_string(),
            owner: owner.to_string(),
        };
        self.bounded(async {
            // Its session goes back to the pool before the lookup takes one: a full pool must
            // not make this wait for itself.
            let stored = outcomes::complete_one(&self.pool, &record, response).await?;
            if stored == 0 {
                outcomes::report_gone(&self.pool, &[&record]).await;
            }
            Ok(())
        })
        .await
    }

    /// Stores the rail's late answer (`idempotency::late`): the record is `done` with it, whether
    /// it was still in flight or its owner had declared it in doubt. One statement for this
    /// record alone.
    pub async fn complete_late(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), DbError> {
        let record = RecordId {
            account: account.clone(),
            key: key.to_string(),
            owner: owner.to_string(),
        };
        self.bounded(async {
            let stored = outcomes::complete_late_one(&self.pool, &record, response).await?;
            if stored == 0 {
                outcomes::report_gone(&self.pool, &[&record]).await;
            } else {
                tracing::info!(account = %record.account, key = record.key,
                    status = response.status,
                    "stored the rail's late answer: repeats of this key get it replayed");
            }
            Ok(())
        })
        .await
    }

    /// Queues the completion of `record` for the next batch ([`outcomes`]). Once queued, it
    /// is stored whether or not anyone waits for it.
    fn queue_completion(
        &self,
        record: RecordId,
        response: StoredResponse,
    ) -> Result<QueuedCompletion, CompletionError> {
        let completions = self.completions.as_ref().ok_or(CompletionError::Closed)?;
        let (reply, stored) = oneshot::channel();
        let claim = outcomes::Claim::default();
        completions
            .try_send(Completion {
                record,
                response,
                claim: claim.clone(),
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => CompletionError::Overloaded,
                mpsc::error::TrySendError::Closed(_) => CompletionError::Closed,
            })?;
        Ok(QueuedCompletion {
            stored,
            claim,
            timeout: self.timeout,
        })
    }

    /// The rail's answer could not be stored now: the client hears it anyway, and the record
    /// is completed as soon as the database takes it (a repeat meanwhile gets `in_flight`).
    fn complete_later(&self, error: &CompletionError, record: RecordId, response: StoredResponse) {
        tracing::warn!(error = %error, account = %record.account,
            "could not store the rail's response for replay yet; retrying in the background");
        self.complete_eventually(record.account, record.key, record.owner, response);
    }

    /// Says, for the owner, that its forward ended without an answer: the record is in doubt
    /// now, and may be forgotten by an operator even while this process runs.
    pub async fn declare_in_doubt(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
    ) -> Result<(), DbError> {
        self.bounded(async {
            let client = self.client().await?;
            client
                .execute(
                    "UPDATE idempotency_record SET state = 'in_doubt'
                     WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3
                       AND state = 'in_flight'",
                    &[&account.as_str(), &key, &owner],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// [`complete`](Self::complete), retried in the background until the database takes it.
    pub fn complete_eventually(
        &self,
        account: AccountId,
        key: String,
        owner: String,
        response: StoredResponse,
    ) {
        self.store_eventually(account, key, owner, Outcome::Done(response));
    }

    /// [`declare_in_doubt`](Self::declare_in_doubt), retried in the background.
    pub fn declare_in_doubt_eventually(&self, account: AccountId, key: String, owner: String) {
        self.store_eventually(account, key, owner, Outcome::InDoubt);
    }

    fn store_eventually(&self, account: AccountId, key: String, owner: String, outcome: Outcome) {
        let store = self.clone();
        let pending = &self.outcomes.pending;
        if pending.get() >= MAX_PENDING_OUTCOMES {
            self.outcomes.lost.inc();
            tracing::error!(account = %account, key, "too many idempotency outcomes wait for the database; this record stays in flight and will be in doubt");
            return;
        }
        pending.inc();
        let retrying = self.retrying.start();
        tokio::spawn(async move {
            let _retrying = retrying;
            let started = tokio::time::Instant::now();
            let mut pause = Duration::from_millis(50);
            loop {
                let stored = match &outcome {
                    Outcome::Done(response) => {
                        store.complete(&account, &key, &owner, response).await
                    }
                    Outcome::LateDone(response) => {
                        store.complete_late(&account, &key, &owner, response).await
                    }
                    Outcome::InDoubt => store.declare_in_doubt(&account, &key, &owner).await,
                    Outcome::Unsent => {
                        let record = RecordId {
                            account: account.clone(),
                            key: key.clone(),
                            owner: owner.clone(),
                        };
                        store.delete_if_unsent(&record).await.map(|n| {
                            tracing::info!(account = %account, records = n,
                                "removed the idempotency record of a request that never \
                                 reached the rail");
                        })
                    }
                };
                match stored {
                    Ok(()) => break,
                    Err(e) if started.elapsed() > OUTCOME_RETRY_FOR => {
                        store.outcomes.lost.inc();
                        tracing::error!(account = %account, key, error = %e,
                            "gave up storing an idempotency outcome; the record will be in doubt");
                        break;
                    }
                    Err(e) => {
                        if pause >= Duration::from_secs(1) {
                            tracing::warn!(account = %account, key, error = %e,
                                "idempotency outcome not stored yet; retrying");
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(5));
                    }
                }
            }
            store.outcomes.pending.dec();
        });
    }

    /// Deletes, in the background, a record whose request is known never to have reached the
    /// rail, so that a retry is forwarded rather than refused. The first attempt is one a
    /// graceful stop waits for (within the database timeout); one that fails is retried in the
    /// background until the database takes it, as completions are, but deletes only before the
    /// owner's deadline. Past it (or should the process stop first) the record is in doubt,
    /// which refuses a retry but never repeats a payment.
    fn delete_unsent(&self, record: RecordId) {
        let store = self.clone();
        let running = self.unanswered.start();
        tokio::spawn(async move {
            let deleted = store.delete_if_unsent(&record).await;
            drop(running);
            match deleted {
                Ok(n) => tracing::info!(account = %record.account, records = n,
                    "removed the idempotency record of a request that never reached the rail"),
                Err(e) => {
                    tracing::warn!(account = %record.account, error = %e,
                        "could not remove the idempotency record of an unsent request yet; \
                         retrying in the background (a retry meanwhile is told in_flight)");
                    let RecordId {
                        account,
                        key,
                        owner,
                    } = record;
                    store.store_eventually(account, key, owner, Outcome::Unsent);
                }
            }
        });
    }

    /// The delete itself, within the database timeout: only the owner's record, only while
    /// it is still in flight, and only before its owner's deadline (`in_doubt_at`). Past that a
    /// reader may already have been told the record is in doubt, which holds for good: only
    /// an operator lifts it (`idempotency-forget`), so a delete that comes too late changes
    /// nothing, and is not tried again.
    async fn delete_if_unsent(&self, record: &RecordId) -> Result<u64, DbError> {
        self.bounded(async {
            let client = self.client().await?;
            Ok(client
                .execute(
                    "DELETE FROM idempotency_record
                     WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3
                       AND state = 'in_flight' AND now() <= COALESCE(in_doubt_at, created_at)",
                    &[&record.account.as_str(), &record.key, &record.owner],
                )
                .await?)
        })
        .await
    }

    /// The operator's way out of `in_doubt`: deletes the record only if nothing railguard
    /// does can still send it, and nothing it sent can still reach the rail; writes the audit
    /// record in the same transaction. See the module docs for what this cannot see.
    ///
    /// Its forward must be over: the owner declared it in doubt, or the owner's own deadline
    /// passed. The owner must be known to have stopped: the owning process recorded a clean
    /// stop, or the operator says it has stopped (`owner_stopped`, naming the record's owner).
    /// A missing instance lock alone proves nothing — a paused process whose database session
    /// was lost (a backend crash, a terminated session, a failover) holds none, and may still
    /// send once it runs again. An owner that holds its lock is running, and is refused
    /// whatever anyone says. And the request must be past the time it could still arrive: its
    /// in-doubt deadline plus `proxy.rail_transit_ms` (the larger of this process's and the
    /// owner's, when its clean stop says it), and, for an owner that stopped cleanly, its
    /// `quiet_after` ([`Forgot::MayStillArrive`] until then).
    ///
    /// `dry_run`: decides, and changes nothing — a record that would be forgotten is
    /// [`Forgot::WouldForget`], and kept (the procedure's "is it time to ask the rail yet").
    pub async fn forget_in_doubt(
        &self,
        account: &AccountId,
        key: &str,
        owner_stopped: Option<OwnerStopped>,
        dry_run: bool,
    ) -> Result<Forgot, DbError> {
        self.forget(account, key, owner_stopped, dry_run, Asked::Operator)
            .await
    }

    /// The rail's lookup found no payment with the record's key (`resolve`): forgets the
    /// record exactly when [`forget_in_doubt`](Self::forget_in_doubt) would without an
    /// operator's word — its forward is over, its owner recorded a clean stop and holds no
    /// instance lock, and nothing it sent can still reach the rail — audited as the rail's
    /// answer. Otherwise the record stays in doubt, and the verdict says why.
    pub async fn forget_not_on_the_rail(
        &self,
        account: &AccountId,
        key: &str,
    ) -> Result<Forgot, DbError> {
        self.forget(account, key, None, false, Asked::RailLookup)
            .await
    }

    /// The rail's lookup found the payment of a record in doubt (`resolve`): the record is
    /// completed with the rail's answer, and the audit record says so, in one transaction.
    /// Whoever sent it, the rail has the payment: a retry gets this answer, never a new
    /// forward. `false` when the record is not in doubt (any more): completed meanwhile (by
    /// its owner's late answer), forgotten, or still within its owner's deadline.
    pub async fn complete_from_the_rail(
        &self,
        account: &AccountId,
        key: &str,
        response: &StoredResponse,
    ) -> Result<bool, DbError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let row = tx
                .query_opt(
                    COMPLETE_FROM_THE_RAIL_SQL,
                    &[
                        &account.as_str(),
                        &key,
                        &outcomes::status_column(response.status),
                        &outcomes::headers_column(response),
                        &response.body.as_deref(),
                        &response.body.is_some(),
                    ],
                )
                .await?;
            let Some(row) = row else {
                return Ok(false);
            };
            let owner: Option<i64> = row.get(0);
            let outcome = serde_json::json!({
                "idempotency_key": key,
                "result": "completed_from_the_rail",
                "status": response.status,
                "owner_instance": owner,
            });
            tx.execute(
                AUDIT_RESOLVE_SQL,
                &[
                    &account.as_str(),
                    &"the rail's lookup by idempotency key found the payment (rail_lookup.path)",
                    &outcome.to_string(),
                ],
            )
            .await?;
            tx.commit().await?;
            Ok(true)
        })
        .await
    }

    async fn forget(
        &self,
        account: &AccountId,
        key: &str,
        owner_stopped: Option<OwnerStopped>,
        dry_run: bool,
        asked: Asked,
    ) -> Result<Forgot, DbError> {
        let transit_ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let own_transit = transit_ms(self.rail_transit);
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let row = tx
                .query_opt(
                    "SELECT state, now() > COALESCE(in_doubt_at, created_at), owner_instance,
                            to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US\"Z\"'),
                            COALESCE(in_doubt_at, created_at)
                     FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2
                     FOR UPDATE",
                    &[&account.as_str(), &key],
                )
                .await?;
            let Some(row) = row else {
                return Ok(Forgot::NotFound);
            };
            let (state, past_deadline, owner, created): (String, bool, Option<i64>, String) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            let in_doubt_at: std::time::SystemTime = row.get(4);
            // The owner's clean stop, if it recorded one: (quiet_after, its rail_transit_ms).
            let mut clean_stop: Option<(std::time::SystemTime, Option<i64>)> = None;
            // Even a forward its owner declared in doubt may still be on its way out of the
            // owner's own connection (a large body written slowly to a slow rail): only an
            // owner that has stopped sends nothing more.
            let verdict = match (state.as_str(), owner.map(InstanceId::from_stored)) {
                ("done", _) => Forgot::Completed,
                ("in_flight", _) if !past_deadline => Forgot::StillInFlight,
                // Made before owners were recorded (migration 0004): no lock and no clean stop
                // can speak for the process that made it, so only the operator's word can.
                (_, None) if owner_stopped == Some(OwnerStopped::Unrecorded) => {
                    Forgot::Forgotten(Because::NoOwner)
                }
                (_, None) => Forgot::OwnerUnrecorded {
                    created: created.clone(),
                },
                (_, Some(owner)) => {
                    let lock_free: bool = tx
                        .query_one(OWNER_LOCK_FREE_SQL, &[&owner.get()])
                        .await?
                        .get(0);
                    if !lock_free {
                        Forgot::OwnerMayStillSend {
                            owner,
                            named: owner_stopped,
                        }
                    } else {
                        let stopped = tx
                            .query_one(OWNER_STOPPED_CLEANLY_SQL, &[&owner.get(), &own_transit])
                            .await?;
                        let quiet_after: Option<std::time::SystemTime> = stopped.get(0);
                        clean_stop = quiet_after.map(|at| (at, stopped.get(1)));
                        if clean_stop.is_some() {
                            Forgot::Forgotten(Because::OwnerStoppedCleanly(owner))
                        } else if owner_stopped == Some(OwnerStopped::Instance(owner)) {
                            Forgot::Forgotten(Because::OperatorSawOwnerStop(owner))
                        } else {
                            Forgot::OwnerNotSeenStopping {
                                owner,
                                created: created.clone(),
                                named: owner_stopped,
                            }
                        }
                    }
                }
            };
            // Stopped, or taken as stopped: what it sent may still be on its way to the rail.
            let verdict = match verdict {
                Forgot::Forgotten(because) => {
                    let transit = clean_stop
                        .and_then(|(_, owners)| owners)
                        .map_or(own_transit, |owners| owners.max(own_transit));
                    let quiet_after = clean_stop.map(|(at, _)| at);
                    let quiet = tx
                        .query_one(QUIET_SQL, &[&in_doubt_at, &transit, &quiet_after])
                        .await?;
                    if quiet.get(0) {
                        Forgot::Forgotten(because)
                    } else {
                        Forgot::MayStillArrive {
                            because,
                            after: quiet.get(1),
                            in_secs: quiet.get(2),
                            transit_ms: transit,
                        }
                    }
                }
                other => other,
            };
            let verdict = match verdict {
                Forgot::Forgotten(because) if dry_run => Forgot::WouldForget(because),
                other => other,
            };
            if let Forgot::Forgotten(because) = verdict {
                tx.execute(
                    "DELETE FROM idempotency_record WHERE account_id = $1 AND idempotency_key = $2",
                    &[&account.as_str(), &key],
                )
                .await?;
                let owner = because.owner().map(InstanceId::get);
                let outcome = serde_json::json!({
                    "idempotency_key": key,
                    "result": "forgotten",
                    "owner_instance": owner,
                    "owner_stopped": because.as_str(),
                    // What "running when the record was made" refers to (UTC).
                    "record_created": created,
                });
                tx.execute(
                    AUDIT_FORGET_SQL,
                    &[
                        &account.as_str(),
                        &because.reason(asked),
                        &outcome.to_string(),
                    ],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(verdict)
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

    fn forget_not_on_the_rail<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Forgot, DbError>> {
        Box::pin(IdempotencyStore::forget_not_on_the_rail(self, account, key))
    }
}

/// A completion queued for a batch ([`IdempotencyStore::queue_completion`]).
struct QueuedCompletion {
    stored: oneshot::Receiver<Result<(), DbError>>,
    claim: outcomes::Claim,
    timeout: Duration,
}

/// Why a completion is not stored yet, and who stores it.
enum Unstored {
    /// The caller: its batch failed, or the caller stopped waiting before a batch took it.
    Retry(CompletionError),
    /// The batch that took it, still running when the caller stopped waiting: it either
    /// commits, or hands the completion to the background retry itself.
    InBatch(CompletionError),
}

impl QueuedCompletion {
    /// Waits, within the store's timeout, for the commit that holds the completion.
    async fn wait(mut self) -> Result<(), Unstored> {
        match tokio::time::timeout(self.timeout, &mut self.stored).await {
            Ok(Ok(result)) => return result.map_err(|e| Unstored::Retry(e.into())),
            Ok(Err(_)) => return Err(Unstored::Retry(CompletionError::Closed)),
            Err(_) => {}
        }
        // From here the batch can no longer answer us: either its answer is already here, or
        // it finds us gone (and, should its statement fail, retries the completion itself).
        self.stored.close();
        match self.stored.try_recv() {
            Ok(result) => result.map_err(|e| Unstored::Retry(e.into())),
            Err(_) => {
                let timeout = CompletionError::Db(DbError::Timeout(self.timeout));
                if self.claim.for_retry() {
                    Err(Unstored::Retry(timeout))
                } else {
                    Err(Unstored::InBatch(timeout))
                }
            }
        }
    }
}

/// A completion was not stored with its batch.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CompletionError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("too many idempotency completions are waiting for the database")]
    Overloaded,
    #[error("the idempotency completion batcher has stopped")]
    Closed,
}

/// What `forget_in_doubt` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forgot {
    Forgotten(Because),
    /// Asked as a dry run: it would have been forgotten now; nothing was changed.
    WouldForget(Because),
    /// The record is complete: the rail answered; nothing to forget.
    Completed,
    /// In flight and within its owner's own deadline: its forward may still be running.
    StillInFlight,
    /// The owning railguard process holds its instance lock: it is running (it may be paused
    /// mid-send, or still writing the request to a slow rail), whatever the operator said
    /// (`named`, not heard).
    OwnerMayStillSend {
        owner: InstanceId,
        named: Option<OwnerStopped>,
    },
    /// The owning process does not hold its lock, but nothing shows it has stopped: it may have
    /// crashed, or be paused with its database session lost. `created` is when the record was
    /// made (UTC); `named` what the operator said had stopped, if not the owner.
    OwnerNotSeenStopping {
        owner: InstanceId,
        created: String,
        named: Option<OwnerStopped>,
    },
    /// The record names no owner: a binary older than migration 0004 made it (at `created`,
    /// UTC) and recorded none, so nothing in the database shows whether the process that made
    /// it has stopped, and the operator did not say so.
    OwnerUnrecorded {
        created: String,
    },
    /// The owner is known to have stopped (`because`), but the request may still be on its way
    /// to the rail until `after` (UTC, the database's clock; `in_secs` from now): the record's
    /// in-doubt deadline plus `transit_ms` (`proxy.rail_transit_ms`), and not before a clean
    /// stop's `quiet_after`. The rail is to be asked only after that.
    MayStillArrive {
        because: Because,
        after: String,
        in_secs: i64,
        transit_ms: i64,
    },
    NotFound,
}

/// What the operator says has stopped, asking to forget a record in doubt
/// (`--owner-stopped`, `owner_stopped`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerStopped {
    /// The railguard process of this instance: a record's owner, named in forget's answer and
    /// logged by that process when it started.
    Instance(InstanceId),
    /// Every railguard that was running when the record was made: for a record that names no
    /// owner (made by a binary older than migration 0004, which recorded none).
    Unrecorded,
}

impl std::str::FromStr for OwnerStopped {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if text == "unrecorded" {
            return Ok(Self::Unrecorded);
        }
        text.parse::<i64>()
            .map(|n| Self::Instance(InstanceId::from_stored(n)))
            .map_err(|_| format!("{text:?} is neither an instance number nor \"unrecorded\""))
    }
}

impl std::fmt::Display for OwnerStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Instance(instance) => write!(f, "{instance}"),
            Self::Unrecorded => f.write_str("unrecorded"),
        }
    }
}

/// Why a record could be forgotten: what shows its owner sends nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Because {
    /// The record names no owner (made before owners were recorded), and the operator said
    /// every railguard running when it was made has stopped (`--owner-stopped unrecorded`).
    NoOwner,
    /// The owner recorded a clean stop, with nothing left to send.
    OwnerStoppedCleanly(InstanceId),
    /// The operator said the owner has stopped (`--owner-stopped`).
    OperatorSawOwnerStop(InstanceId),
}

impl Because {
    pub fn owner(self) -> Option<InstanceId> {
        match self {
            Self::NoOwner => None,
            Self::OwnerStoppedCleanly(owner) | Self::OperatorSawOwnerStop(owner) => Some(owner),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoOwner => "no_owner",
            Self::OwnerStoppedCleanly(_) => "stopped_cleanly",
            Self::OperatorSawOwnerStop(_) => "on_the_operators_word",
        }
    }

    /// The audit record's reason.
    fn reason(self, asked: Asked) -> &'static str {
        match (self, asked) {
            (_, Asked::RailLookup) => {
                "the rail's lookup by idempotency key found no payment (rail_lookup.path), \
                 and the owning railguard recorded a clean stop"
            }
            (Self::OwnerStoppedCleanly(_), Asked::Operator) => {
                "checked the rail's own records (railguard idempotency-forget)"
            }
            (Self::NoOwner, Asked::Operator) => {
                "checked the rail's own records, and saw every railguard running when the \
                 record was made stop (railguard idempotency-forget --owner-stopped unrecorded)"
            }
            (Self::OperatorSawOwnerStop(_), Asked::Operator) => {
                "checked the rail's own records, and saw the owning railguard process stop \
                 (railguard idempotency-forget --owner-stopped)"
            }
        }
    }
}

/// Who asked to forget a record: what its audit record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// `railguard idempotency-forget`, after checking the rail.
    Operator,
    /// railguard itself, when the rail's lookup found no payment with the key (`resolve`).
    RailLookup,
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
