//! Group commit for idempotency-record completions.
//!
//! Every forwarded request with an `Idempotency-Key` ends by storing the rail's answer in its
//! record, and its client hears that answer only once it is stored (committed and visible; the
//! commit does not wait for its WAL flush, see [`COMPLETE_SQL`]). One `UPDATE` with its own
//! transaction, commit and pool checkout per request is a large part of PostgreSQL's work per
//! request, so completions go to the same batcher as the fence's compare-and-sets
//! ([`crate::store::batch`]): a batch takes every completion waiting when a statement place
//! frees up (at most `max_batch`), and stores them with one statement over `unnest` arrays —
//! one round trip, one commit. Each caller still waits for the commit that holds its row.
//!
//! **Exactness.** Each completion is one row of the statement, with the single-row
//! completion's conditions: only the record's owner completes it, and only while it is in
//! flight. A batch never holds one record twice (the second would match nothing); such a
//! completion waits for a later batch. Rows are updated in key order, as the fence's batch
//! locks the records it meets, so that the two do not deadlock on records in practice; that
//! order is the only plan the statement can have (see [`COMPLETE_SQL`]). Were the two ever to
//! meet in another order, a deadlock is still detected and cancels one of the two statements: a completion batch's
//! completions are then retried in the background; a fence batch's requests are refused
//! (503) with nothing forwarded.
//!
//! **Gone records.** A row the statement did not complete is looked up again: completed by its
//! own owner already (an earlier attempt whose answer was lost with its connection, or a
//! background retry that overtook this one) is success; still in flight for its owner (changed
//! by another transaction while the statement waited, which the statement passes over) it is
//! completed by its key, one row; otherwise the record is gone — an operator forgot it, or
//! retention removed it — and that is logged, as the single-row completion does. Nothing here
//! creates a record, so a forgotten one is never resurrected.
//!
//! **Callers that stop waiting.** A completion is queued when its request's guard hands it
//! over, and from then on exactly one party answers for it ([`Claim`]): the batch that takes
//! it, or — if its caller's wait passed the store's timeout first — the caller's background
//! retry, and a batch skips it. A caller whose request was dropped (its client hung up) while
//! waiting leaves its completion queued: the batch still stores it. A batch that fails tells
//! its callers, who retry in the background; for a caller no longer listening, the batch
//! hands its completion to that retry itself. So a completion is never dropped: at worst it is
//! stored late (and a repeat meanwhile hears `in_flight`).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use deadpool_postgres::Pool;
use tokio::sync::oneshot;

use super::{RecordId, StoredResponse};
use crate::db::DbError;
use crate::store::batch::{Fit, HeldRow, Job, Rows};

use crate::store::completions::COMPLETE_SQL;

/// The state of each of these records that its owner still holds.
pub(super) const STATES_BY_OWNER_SQL: &str = "\
SELECT r.account_id, r.idempotency_key, r.state
FROM idempotency_record r
    JOIN unnest($1::text[], $2::text[], $3::text[]) AS u(account_id, key, owner)
    ON r.account_id = u.account_id AND r.idempotency_key = u.key AND r.owner = u.owner";

/// One record's completion, found by its key: the background retry's, and a batch's for a
/// record its statement passed over.
pub(super) const COMPLETE_ONE_SQL: &str = "\
UPDATE idempotency_record
SET state = 'done', status = $4, headers = $5::text::jsonb, body = $6, body_stored = $7,
    completed_at = now()
WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3 AND state = 'in_flight'";

/// A late answer's completion ([`super::late`]): as [`COMPLETE_ONE_SQL`], and also of a record
/// its owner declared in doubt when its forward ended without the answer that came since. Only
/// the owner's record (a record forgotten and made again by a retry has another owner), never
/// one already done.
pub(super) const COMPLETE_LATE_SQL: &str = "\
UPDATE idempotency_record
SET state = 'done', status = $4, headers = $5::text::jsonb, body = $6, body_stored = $7,
    completed_at = now()
WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3
  AND state IN ('in_flight', 'in_doubt')";

/// Completions that may wait for a statement; past it, a completion goes to the background
/// retry at once.
pub(super) const QUEUE_LIMIT: usize = 16_384;

/// One completion waiting for its commit.
pub(crate) struct Completion {
    pub record: RecordId,
    pub response: StoredResponse,
    pub claim: Claim,
    pub reply: oneshot::Sender<Result<(), DbError>>,
}

/// Who stores a queued completion: the batch that takes it, or the caller's background retry
/// once the caller gave up waiting — whichever claims it first.
#[derive(Debug, Clone, Default)]
pub(crate) struct Claim(Arc<AtomicU8>);

const QUEUED: u8 = 0;
const BATCHED: u8 = 1;
const RETRIED: u8 = 2;

impl Claim {
    /// The batch takes the completion, unless its caller's retry already has.
    fn for_batch(&self) -> bool {
        self.take(BATCHED)
    }

    /// The caller's retry takes the completion, unless a batch already has (which then answers
    /// for it, falling back to the retry itself if its statement fails).
    pub(super) fn for_retry(&self) -> bool {
        self.take(RETRIED)
    }

    fn take(&self, by: u8) -> bool {
        self.0
            .compare_exchange(QUEUED, by, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn is_retried(&self) -> bool {
        self.0.load(Ordering::Acquire) == RETRIED
    }
}

/// Where a batch hands a completion whose statement failed and whose caller no longer waits:
/// the background retry.
pub(crate) type Fallback = Arc<dyn Fn(RecordId, StoredResponse) + Send + Sync>;

/// The completions as a batcher's job: its statements run on `sessions`
/// (`db::build_completion_pool`); the look-up of records a batch did not complete, on `pool`.
pub(crate) struct Complete {
    pub pool: Pool,
    pub sessions: Pool,
    pub fallback: Fallback,
}

impl Job for Complete {
    type Item = Completion;
    /// The records taken so far.
    type Taken = HashSet<(String, String)>;
    const NAME: &'static str = "completion";

    /// Not one its caller stopped waiting for and retries in the background.
    fn wanted(completion: &Completion) -> bool {
        !completion.claim.is_retried()
    }

    /// Unclaimed while it waits: a caller that stops waiting retries it itself.
    fn blocker(completion: &Completion, rows: &Rows) -> Option<HeldRow> {
        rows.completion_blocker(&completion.record.account, &completion.record.key)
    }

    /// One record once per batch, and claimed by the batch that takes it.
    fn fits(records: &mut Self::Taken, completion: &Completion) -> Fit {
        let key = record_key(&completion.record);
        if records.contains(&key) {
            return Fit::Later;
        }
        if !completion.claim.for_batch() {
            return Fit::Skip; // claimed by its caller's retry just now
        }
        records.insert(key);
        Fit::Take
    }

    /// The statement locks its records.
    fn locks(
        batch: &[Completion],
    ) -> (
        Vec<crate::token::AccountId>,
        Vec<(crate::token::AccountId, String)>,
    ) {
        let records = batch
            .iter()
            .map(|c| (c.record.account.clone(), c.record.key.clone()))
            .collect();
        (Vec::new(), records)
    }

    fn start(&self, batch: Vec<Completion>) -> impl Future<Output = ()> + Send + 'static {
        let (pool, sessions, fallback) = (
            self.pool.clone(),
            self.sessions.clone(),
            self.fallback.clone(),
        );
        async move { execute(&pool, &sessions, &fallback, batch).await }
    }
}

/// A batch, column by column.
#[derive(Default)]
struct Columns<'a> {
    accounts: Vec<&'a str>,
    keys: Vec<&'a str>,
    owners: Vec<&'a str>,
    statuses: Vec<i16>,
    headers: Vec<String>,
    bodies: Vec<Option<&'a [u8]>>,
    body_stored: Vec<bool>,
}

impl<'a> Columns<'a> {
    fn of(batch: &'a [Completion]) -> Self {
        let mut columns = Columns::default();
        for c in batch {
            columns.accounts.push(c.record.account.as_str());
            columns.keys.push(&c.record.key);
            columns.owners.push(&c.record.owner);
            columns.statuses.push(status_column(c.response.status));
            columns.headers.push(headers_column(&c.response));
            columns.bodies.push(c.response.body.as_deref());
            columns.body_stored.push(c.response.body.is_some());
        }
        columns
    }
}

/// `status` as the `smallint` column holds it.
pub(super) fn status_column(status: u16) -> i16 {
    status as i16
}

/// `headers` as the JSON text the `jsonb` column is cast from.
pub(super) fn headers_column(response: &StoredResponse) -> String {
    serde_json::to_string(&response.headers).expect("headers serialize")
}

async fn execute(pool: &Pool, sessions: &Pool, fallback: &Fallback, batch: Vec<Completion>) {
    let columns = Columns::of(&batch);
    // No client-side timeout, as in the fence's batch: the server cancels a statement at
    // `statement_timeout` and the connection gives up on a silent peer (`db::pg_config`).
    let mut attempt = 0;
    let completed = loop {
        attempt += 1;
        match complete_batch(sessions, &columns).await {
            // A connection closed under us (the server restarted): one retry on a fresh one.
            // Safe: a row the first attempt completed is found completed by its owner.
            Err(DbError::ConnectionClosed(_)) if attempt == 1 => continue,
            Err(e) => {
                tracing::warn!(error = %e, completions = batch.len(),
                    "idempotency completion batch failed");
                for c in batch {
                    // A caller still waiting retries in the background itself.
                    if c.reply.send(Err(e.clone())).is_err() {
                        fallback(c.record, c.response);
                    }
                }
                return;
            }
            Ok(completed) => break completed,
        }
    };
    let missing: Vec<&Completion> = batch
        .iter()
        .filter(|c| !completed.contains(&record_key(&c.record)))
        .collect();
    let unsettled = if missing.is_empty() {
        HashMap::new()
    } else {
        settle(pool, &missing).await
    };
    for c in batch {
        let failed = if unsettled.is_empty() {
            None
        } else {
            unsettled.get(&record_key(&c.record))
        };
        match failed {
            None => {
                let _ = c.reply.send(Ok(()));
            }
            // Not known to be stored: a caller still waiting retries in the background itself.
            Some(e) => {
                if c.reply.send(Err(e.clone())).is_err() {
                    fallback(c.record, c.response);
                }
            }
        }
    }
}

fn record_key(record: &RecordId) -> (String, String) {
    (record.account.as_str().to_string(), record.key.clone())
}

/// Completions the batch's statement did not store. A record its owner completed already (an
/// earlier attempt whose answer was lost with its connection, a background retry that
/// overtook this one) is done; one another transaction changed while the statement ran, and
/// left in flight for its owner, was passed over (the statement goes by the record's position
/// as its snapshot saw it, see [`COMPLETE_SQL`]) and is completed here by its key; any other
/// is gone, or in doubt, and logged. Returns the records whose state could not be learned or
/// whose completion by key failed: not known to be stored, they are retried.
async fn settle(pool: &Pool, missing: &[&Completion]) -> HashMap<(String, String), DbError> {
    let records: Vec<&RecordId> = missing.iter().map(|c| &c.record).collect();
    let states = match states_by_owner(pool, &records).await {
        Ok(states) => states,
        Err(e) => return records.iter().map(|r| (record_key(r), e.clone())).collect(),
    };
    let mut unsettled = HashMap::new();
    for c in missing {
        let record = &c.record;
        match states.get(&record_key(record)).map(String::as_str) {
            Some("done") => {}
            Some("in_flight") => match complete_one(pool, record, &c.response).await {
                Ok(1) => {}
                Ok(_) => report_gone(pool, &[record]).await,
                Err(e) => {
                    unsettled.insert(record_key(record), e);
                }
            },
            Some("in_doubt") => log_in_doubt(record),
            _ => log_gone(record),
        }
    }
    unsettled
}

/// Completes one record by its key ([`COMPLETE_ONE_SQL`]); how many rows it changed.
pub(super) async fn complete_one(
    pool: &Pool,
    record: &RecordId,
    response: &StoredResponse,
) -> Result<u64, DbError> {
    complete_by_key(pool, COMPLETE_ONE_SQL, record, response).await
}

/// Completes one record with a late answer ([`COMPLETE_LATE_SQL`]); how many rows it changed.
pub(super) async fn complete_late_one(
    pool: &Pool,
    record: &RecordId,
    response: &StoredResponse,
) -> Result<u64, DbError> {
    complete_by_key(pool, COMPLETE_LATE_SQL, record, response).await
}

async fn complete_by_key(
    pool: &Pool,
    sql: &str,
    record: &RecordId,
    response: &StoredResponse,
) -> Result<u64, DbError> {
    let client = pool.get().await?;
    let statement = client.prepare_cached(sql).await?;
    Ok(client
        .execute(
            &statement,
            &[
                &record.account.as_str(),
                &record.key,
                &record.owner,
                &status_column(response.status),
                &headers_column(response),
                &response.body.as_deref(),
                &response.body.is_some(),
            ],
        )
        .await?)
}

/// Runs the batch's statement; the (account, key) of every record it completed.
async fn complete_batch(
    sessions: &Pool,
    columns: &Columns<'_>,
) -> Result<HashSet<(String, String)>, DbError> {
    let client = sessions.get().await?;
    let statement = client.prepare_cached(COMPLETE_SQL).await?;
    let rows = client
        .query(
            &statement,
            &[
                &columns.accounts,
                &columns.keys,
                &columns.owners,
                &columns.statuses,
                &columns.headers,
                &columns.bodies,
                &columns.body_stored,
            ],
        )
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect())
}

/// Logs each of `records` (which a completion did not change) that is gone rather than
/// completed by its owner already.
pub(super) async fn report_gone(pool: &Pool, records: &[&RecordId]) {
    let states = match states_by_owner(pool, records).await {
        Ok(states) => states,
        Err(e) => return unknown_whether_gone(records, &e),
    };
    for record in records {
        let key = (record.account.as_str().to_string(), record.key.clone());
        if states.get(&key).map(String::as_str) != Some("done") {
            log_gone(record);
        }
    }
}

/// Not known to be gone: say that, rather than that a retry is a new payment.
fn unknown_whether_gone(records: &[&RecordId], error: &DbError) {
    for record in records {
        tracing::warn!(account = %record.account, key = record.key, error = %error,
            "an idempotency completion changed no row, and whether the record is gone or \
             was completed already (by an earlier attempt) could not be checked");
    }
}

/// The state of each of `records` that its owner still holds, by (account, key).
async fn states_by_owner(
    pool: &Pool,
    records: &[&RecordId],
) -> Result<HashMap<(String, String), String>, DbError> {
    let accounts: Vec<&str> = records.iter().map(|r| r.account.as_str()).collect();
    let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    let owners: Vec<&str> = records.iter().map(|r| r.owner.as_str()).collect();
    let client = pool.get().await?;
    let statement = client.prepare_cached(STATES_BY_OWNER_SQL).await?;
    let rows = client
        .query(&statement, &[&accounts, &keys, &owners])
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| ((row.get(0), row.get(1)), row.get(2)))
        .collect())
}

/// Declared in doubt before its answer was stored: a retry is refused, and the answer is not
/// replayed.
fn log_in_doubt(record: &RecordId) {
    tracing::warn!(account = %record.account, key = record.key,
        "the rail answered a request whose idempotency record was declared in doubt before the \
         answer could be stored: a retry of this key is refused (409 in_doubt), and the answer \
         is not replayable");
}

pub(super) fn log_gone(record: &RecordId) {
    tracing::error!(account = %record.account, key = record.key,
        "the rail answered a request whose idempotency record is gone (forgotten by an \
         operator, or removed by retention): a retry of this key is a new payment");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    use crate::store::batch::{HeldRows, take};
    use crate::token::AccountId;

    fn completion(
        account: &str,
        key: &str,
    ) -> (Completion, oneshot::Receiver<Result<(), DbError>>) {
        let (reply, rx) = oneshot::channel();
        let c = Completion {
            record: RecordId {
                account: AccountId::parse(account, 64).unwrap(),
                key: key.into(),
                owner: format!("owner-{account}-{key}"),
            },
            response: StoredResponse {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: Some(bytes::Bytes::from_static(b"{}")),
            },
            claim: Claim::default(),
            reply,
        };
        (c, rx)
    }

    fn names(completions: &VecDeque<Completion>) -> Vec<(String, String)> {
        completions
            .iter()
            .map(|c| (c.record.account.to_string(), c.record.key.clone()))
            .collect()
    }

    #[test]
    fn a_completion_of_a_record_a_statement_in_flight_holds_waits_unclaimed() {
        let held = Arc::new(HeldRows::default());
        let _other = held.hold(
            &mut held.rows(),
            vec![],
            vec![(AccountId::parse("a", 64).unwrap(), "k".into())],
        );
        let mut waiting = VecDeque::new();
        let mut receivers = Vec::new();
        for (account, key) in [("a", "k"), ("a", "other"), ("b", "k")] {
            let (c, rx) = completion(account, key);
            waiting.push_back(c);
            receivers.push(rx);
        }
        let (batch, blocked) = take::<Complete>(&mut waiting, 100, &held.rows());
        assert_eq!(
            names(&batch.into()),
            [("a".into(), "other".into()), ("b".into(), "k".into())]
        );
        let blocked: VecDeque<Completion> = blocked.into_iter().map(|(_, c)| c).collect();
        assert_eq!(names(&blocked), [("a".into(), "k".into())]);
        assert!(
            blocked[0].claim.for_retry(),
            "not claimed by a batch: its caller's retry may take it"
        );
    }

    #[test]
    fn a_batch_never_holds_one_record_twice() {
        let mut waiting = VecDeque::new();
        let mut receivers = Vec::new();
        for (account, key) in [
            ("a", "k1"),
            ("a", "k2"),
            ("a", "k1"),
            ("b", "k1"),
            ("b", "k1"),
        ] {
            let (c, rx) = completion(account, key);
            waiting.push_back(c);
            receivers.push(rx);
        }
        let batch: VecDeque<_> = take::<Complete>(&mut waiting, 100, &Rows::default())
            .0
            .into();
        assert_eq!(
            names(&batch),
            [
                ("a".to_string(), "k1".to_string()),
                ("a".into(), "k2".into()),
                ("b".into(), "k1".into())
            ]
        );
        assert_eq!(
            names(&waiting),
            [
                ("a".to_string(), "k1".to_string()),
                ("b".into(), "k1".into())
            ],
            "deferred, in arrival order"
        );
        let next: VecDeque<_> = take::<Complete>(&mut waiting, 100, &Rows::default())
            .0
            .into();
        assert_eq!(next.len(), 2);
        assert!(waiting.is_empty());
    }

    #[test]
    fn a_batch_respects_its_size_and_claims_what_it_takes() {
        let mut waiting = VecDeque::new();
        let mut receivers = Vec::new();
        for i in 0..10 {
            let (c, rx) = completion("a", &format!("k{i}"));
            waiting.push_back(c);
            receivers.push(rx);
        }
        let batch = take::<Complete>(&mut waiting, 4, &Rows::default()).0;
        assert_eq!(batch.len(), 4);
        assert!(
            batch.iter().all(|c| !c.claim.for_retry()),
            "the batch has them"
        );
        assert!(waiting.iter().all(|c| c.claim.clone().for_retry()));
        assert!(
            take::<Complete>(&mut waiting, 4, &Rows::default())
                .0
                .is_empty(),
            "all claimed by retries"
        );
        assert!(waiting.is_empty());
    }

    #[test]
    fn a_batch_skips_completions_handed_to_the_retry_but_not_those_of_dropped_callers() {
        let mut waiting = VecDeque::new();
        let (retried, _rx1) = completion("a", "k1");
        assert!(
            retried.claim.for_retry(),
            "its caller stopped waiting first"
        );
        let (dropped, rx2) = completion("a", "k2");
        drop(rx2); // its request was dropped while waiting: nobody else will store it
        let (waiting_caller, _rx3) = completion("a", "k3");
        waiting.extend([retried, dropped, waiting_caller]);
        let batch: VecDeque<_> = take::<Complete>(&mut waiting, 100, &Rows::default())
            .0
            .into();
        assert_eq!(
            names(&batch),
            [
                ("a".to_string(), "k2".to_string()),
                ("a".into(), "k3".into())
            ]
        );
    }

    #[test]
    fn columns_keep_the_rows_aligned_and_mark_bodies_not_kept() {
        let (with_body, _rx1) = completion("a", "k1");
        let (mut without, _rx2) = completion("b", "k2");
        without.response.status = 500;
        without.response.body = None;
        let batch = [with_body, without];
        let columns = Columns::of(&batch);
        assert_eq!(columns.accounts, ["a", "b"]);
        assert_eq!(columns.keys, ["k1", "k2"]);
        assert_eq!(columns.owners, ["owner-a-k1", "owner-b-k2"]);
        assert_eq!(columns.statuses, [201, 500]);
        assert_eq!(columns.bodies, [Some(&b"{}"[..]), None]);
        assert_eq!(columns.body_stored, [true, false]);
        assert_eq!(
            columns.headers[0],
            r#"[["content-type","application/json"]]"#
        );
    }
}
