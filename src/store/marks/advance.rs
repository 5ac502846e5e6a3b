//! The fence's compare-and-sets, a batch at a time ([`super::super::batch`] runs the batches).
//!
//! **Exactness.** Each request is one row of the statement, and a row's verdict is the verdict
//! of that request's own compare-and-set. To keep it so, a batch never holds two requests for
//! one account with *different* tokens (`ON CONFLICT DO UPDATE` may not touch a row twice),
//! nor two idempotency records with the same key; such requests wait for a later batch.
//! Requests for one account with the *same* token share a row and its verdict, which is what
//! running them one after the other would give. Rows are inserted in account order, so two
//! batches in flight lock rows in the same order and cannot deadlock. And a batch never holds
//! a row that a statement still unanswered holds (an account's mark, an idempotency record
//! being completed): such a request waits for that statement to answer, so that a statement
//! stalled with its row locks held (a stopped backend) holds up its own rows only, not every
//! batch that meets one of them.
//!
//! **Callers that gave up.** A record a request's row created is handed to the caller as a
//! [`Created`] inside its verdict. A caller whose deadline passed has dropped its reply
//! channel, so the verdict — and the record in it — is dropped undelivered, and the record is
//! forgotten: nothing forwarded that request, so a retry must not be refused. The same goes for
//! a batch that fails after a connection closed under one of its attempts: that attempt may
//! have committed, its answer lost, and the records it may have made are forgotten too.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use deadpool_postgres::Pool;
use tokio::sync::oneshot;

use super::{StoreError, Verdict};
use crate::db::{DbError, Notices};
use crate::store::batch::{Fit, HeldRow, Job, Rows};
use crate::store::handover::{Entry, Foreign, Handover};
use crate::store::instance::InstanceId;
use crate::store::records::{Created, NewRecord, RecordId, Records};
use crate::token::{AccountId, FencingToken};

/// The compare-and-set of a batch, written once for both statements below: advances every
/// account whose token is at least its mark and the fencing floor (`store::epoch`: tokens
/// granted before the store last went back), in account order, records the calling process's
/// entry among the account's forwarders (`store::handover`: `$inst` the process, `$seq` this
/// statement's sequence number, never below the one the row has for the process — a late copy
/// of an earlier statement must not hide a later forward; other processes' entries are kept),
/// and answers the accounts it advanced with the other processes' entries, if any.
macro_rules! advance_batch {
    ($inst:literal, $seq:literal) => {
        concat!(
            "\
INSERT INTO rail_high_water AS h (account_id, highest_token, forwarders, forward_seqs)
SELECT account_id, token, ARRAY[", $inst, "::bigint], ARRAY[", $seq, "::bigint]
FROM unnest($1::text[], $2::bigint[]) AS t(account_id, token)
WHERE t.token >= (SELECT floor FROM railguard_store_epoch)
ORDER BY account_id
ON CONFLICT (account_id) DO UPDATE
    SET highest_token = EXCLUDED.highest_token, updated_at = now(),
        forwarders = CASE WHEN h.forwarders <@ EXCLUDED.forwarders THEN EXCLUDED.forwarders
            ELSE EXCLUDED.forwarders || ARRAY(
                SELECT u.f FROM unnest(h.forwarders) WITH ORDINALITY AS u(f, o)
                WHERE u.f <> EXCLUDED.forwarders[1] ORDER BY u.o) END,
        forward_seqs = CASE WHEN h.forwarders <@ EXCLUDED.forwarders
            THEN ARRAY[GREATEST(EXCLUDED.forward_seqs[1], h.forward_seqs[1])]
            ELSE ARRAY[GREATEST(EXCLUDED.forward_seqs[1], (
                SELECT max(u.s) FROM unnest(h.forwarders, h.forward_seqs) AS u(f, s)
                WHERE u.f = EXCLUDED.forwarders[1]))] || ARRAY(
                SELECT u.s FROM unnest(h.forwarders, h.forward_seqs) WITH ORDINALITY AS u(f, s, o)
                WHERE u.f <> EXCLUDED.forwarders[1] ORDER BY u.o) END
    WHERE h.highest_token <= EXCLUDED.highest_token
RETURNING account_id,
    CASE WHEN cardinality(h.forwarders) > 1 THEN h.forwarders END AS others,
    CASE WHEN cardinality(h.forwarders) > 1 THEN h.forward_seqs END AS other_seqs"
        )
    };
}

/// A batch in which no request has an idempotency key: the compare-and-set alone. Measured
/// alone (`railguard-bench --suite statements`, BENCHMARKS.md), the statement
/// below with empty record arrays cost PostgreSQL's backend 11–44% more per statement (79 µs
/// more at 64 rows, 62 at one), for a part that does nothing when there is no record.
pub const ADVANCE_BATCH_SQL: &str = advance_batch!("$3", "$4");

/// A batch with idempotency records: the compare-and-set, and the records of the accepted
/// requests created in the same durable commit. Its answer names the accounts it advanced
/// (`account_id`, NULL) and the records it made (`account_id`, key).
pub const BATCH_SQL: &str = concat!(
    "WITH fenced AS (\n",
    advance_batch!("$9", "$10"),
    "\n), recorded AS (
    INSERT INTO idempotency_record AS r
        (account_id, idempotency_key, fingerprint, token, state, owner, owner_instance, in_doubt_at)
    SELECT i.account_id, i.key, i.fingerprint, i.token, 'in_flight', i.owner, $9::bigint,
           now() + i.in_doubt_after_ms * interval '1 millisecond'
    FROM unnest($3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[], $8::bigint[])
        AS i(account_id, key, fingerprint, token, owner, in_doubt_after_ms)
    WHERE i.account_id IN (SELECT account_id FROM fenced)
    ORDER BY i.account_id, i.key
    -- A record that exists is someone else's, unless it is ours: made by an earlier attempt
    -- of this same statement whose answer was lost with its connection.
    ON CONFLICT (account_id, idempotency_key) DO UPDATE SET owner = EXCLUDED.owner
        WHERE r.owner = EXCLUDED.owner
    RETURNING account_id, idempotency_key
)
SELECT account_id, NULL::text, others, other_seqs FROM fenced
UNION ALL
SELECT account_id, idempotency_key, NULL, NULL FROM recorded"
);

/// One request waiting for its verdict.
pub(crate) struct Pending {
    pub account: AccountId,
    pub token: FencingToken,
    pub record: Option<NewRecord>,
    pub reply: oneshot::Sender<Result<Verdict, StoreError>>,
}

/// The compare-and-set as a batcher's job.
pub(crate) struct Advance {
    pub pool: Pool,
    pub notices: Notices,
    pub instance: InstanceId,
    /// This process's forwards as other processes see them (`store::handover`).
    pub handover: Option<Arc<Handover>>,
    /// Where a record nobody was told about is forgotten.
    pub records: Arc<dyn Records>,
}

/// What a batch taken so far holds: each account's token and each record's key.
#[derive(Default)]
pub(crate) struct Taken {
    tokens: HashMap<AccountId, FencingToken>,
    keys: HashSet<(AccountId, String)>,
}

impl Job for Advance {
    type Item = Pending;
    type Taken = Taken;
    const NAME: &'static str = "fence";

    fn wanted(pending: &Pending) -> bool {
        !pending.reply.is_closed()
    }

    fn blocker(pending: &Pending, rows: &Rows) -> Option<HeldRow> {
        let key = pending.record.as_ref().map(|r| r.key.as_str());
        rows.fence_blocker(&pending.account, key)
    }

    fn fits(taken: &mut Taken, pending: &Pending) -> Fit {
        let other_token = taken
            .tokens
            .get(&pending.account)
            .is_some_and(|t| *t != pending.token);
        let key = pending
            .record
            .as_ref()
            .map(|r| (pending.account.clone(), r.key.clone()));
        if other_token || key.as_ref().is_some_and(|k| taken.keys.contains(k)) {
            return Fit::Later;
        }
        taken.tokens.insert(pending.account.clone(), pending.token);
        taken.keys.extend(key);
        Fit::Take
    }

    /// The statement locks its accounts' mark rows. Not the records it creates or meets: a
    /// completion must never wait behind repeats of its own key (they keep coming while the
    /// first request waits for its answer to be stored, and would starve it), so completions
    /// go first and a repeat waits for the completion instead.
    fn locks(batch: &[Pending]) -> (Vec<AccountId>, Vec<(AccountId, String)>) {
        (distinct_accounts(batch), Vec::new())
    }

    fn start(&self, batch: Vec<Pending>) -> impl Future<Output = ()> + Send + 'static {
        // Registered before the statement is sent: once it commits, other processes may find
        // this process's entry in the accounts' rows (`store::handover`).
        let (seq, entries) = match &self.handover {
            Some(handover) => {
                let (seq, entries) =
                    handover.register(batch.iter().map(|p| (&p.account, p.token.get())));
                (seq, entries.into_iter().map(Some).collect())
            }
            None => (0, batch.iter().map(|_| None).collect()),
        };
        let (pool, notices, instance, records) = (
            self.pool.clone(),
            self.notices.clone(),
            self.instance,
            self.records.clone(),
        );
        async move { execute(&pool, &notices, instance, &records, seq, batch, entries).await }
    }
}

fn distinct_accounts(batch: &[Pending]) -> Vec<AccountId> {
    let mut seen = HashSet::new();
    batch
        .iter()
        .filter(|p| seen.insert(&p.account))
        .map(|p| p.account.clone())
        .collect()
}

async fn execute(
    pool: &Pool,
    notices: &Notices,
    instance: InstanceId,
    records_store: &Arc<dyn Records>,
    seq: i64,
    batch: Vec<Pending>,
    entries: Vec<Option<Entry>>,
) {
    let mut accounts: Vec<&str> = Vec::new();
    let mut tokens: Vec<i64> = Vec::new();
    let mut seen = HashSet::new();
    let mut records = RecordColumns::default();
    for p in &batch {
        if seen.insert(p.account.as_str()) {
            accounts.push(p.account.as_str());
            tokens.push(p.token.get());
        }
        if let Some(record) = &p.record {
            records.accounts.push(p.account.as_str());
            records.keys.push(record.key.as_str());
            records.fingerprints.push(record.fingerprint.as_str());
            records.tokens.push(p.token.get());
            records.owners.push(record.owner.as_str());
            records
                .in_doubt_after_ms
                .push(i64::try_from(record.in_doubt_after.as_millis()).unwrap_or(i64::MAX));
        }
    }
    // No client-side timeout: the server cancels a statement at `statement_timeout`, and the
    // connection gives up on a silent peer at `tcp_user_timeout` (see `db::pg_config`). So a
    // statement either commits and its verdicts are handed out here, or fails with nothing
    // committed — it never commits after we stopped listening. A commit that PostgreSQL
    // reports as done but not replicated (its wait for the synchronous standby was cancelled)
    // is no verdict either (`db::notices`).
    let mut attempt = 0;
    let (rows, unreplicated) = loop {
        attempt += 1;
        let result = async {
            let client = pool.get().await.map_err(DbError::from)?;
            let watch = notices.watch(&client);
            let rows = if records.accounts.is_empty() {
                let statement = client.prepare_cached(ADVANCE_BATCH_SQL).await?;
                client
                    .query(&statement, &[&accounts, &tokens, &instance.get(), &seq])
                    .await?
            } else {
                let statement = client.prepare_cached(BATCH_SQL).await?;
                client
                    .query(
                        &statement,
                        &[
                            &accounts,
                            &tokens,
                            &records.accounts,
                            &records.keys,
                            &records.fingerprints,
                            &records.tokens,
                            &records.owners,
                            &records.in_doubt_after_ms,
                            &instance.get(),
                            &seq,
                        ],
                    )
                    .await?
            };
            let unreplicated = watch.is_some_and(|watch| watch.unreplicated() > 0);
            Ok::<_, StoreError>((rows, unreplicated))
        }
        .await;
        match result {
            // A connection closed under us (the server restarted): one retry on a fresh one.
            // Safe: advancing to the same token twice is advancing once, and a record made by
            // the first attempt is recognised by its owner id.
            Err(StoreError::Db(DbError::ConnectionClosed(_))) if attempt == 1 => continue,
            // A connection that closed under an attempt may have taken a commit's answer with
            // it: the records of the failed batch are forgotten as unsent (`fail`).
            Err(e) => {
                let maybe_committed =
                    attempt > 1 || matches!(e, StoreError::Db(DbError::ConnectionClosed(_)));
                return fail(batch, e, maybe_committed.then_some(records_store));
            }
            Ok(answer) => break answer,
        }
    };
    // Accounts advanced, each with the other processes' entries its row holds.
    let mut fenced: HashMap<String, Foreign> = HashMap::new();
    let mut recorded: HashSet<(String, String)> = HashSet::new();
    let keyed = !records.accounts.is_empty();
    for row in rows {
        let account: String = row.get(0);
        // `ADVANCE_BATCH_SQL` answers the advanced accounts alone; `BATCH_SQL` the records it
        // made too, with their key.
        let key = if keyed {
            row.get::<_, Option<String>>(1)
        } else {
            None
        };
        match key {
            None => {
                let at = usize::from(keyed);
                let others: Option<Vec<i64>> = row.get(1 + at);
                let seqs: Option<Vec<i64>> = row.get(2 + at);
                let foreign = match (others, seqs) {
                    (Some(others), Some(seqs)) => Foreign::from_row(instance.get(), &others, &seqs),
                    _ => Foreign::default(),
                };
                fenced.insert(account, foreign);
            }
            Some(key) => {
                recorded.insert((account, key));
            }
        }
    }
    if unreplicated {
        return not_replicated(batch, &recorded, records_store);
    }
    for (pending, entry) in batch.into_iter().zip(entries) {
        let verdict = match fenced.get(pending.account.as_str()) {
            Some(foreign) => {
                let record = pending.record.filter(|r| {
                    recorded.contains(&(pending.account.as_str().to_string(), r.key.clone()))
                });
                Verdict::Accepted {
                    record: record.map(|r| {
                        let id = RecordId {
                            account: pending.account.clone(),
                            key: r.key,
                            owner: r.owner,
                        };
                        Created::new(records_store.clone(), id)
                    }),
                    entry,
                    foreign: foreign.clone(),
                }
            }
            None => Verdict::Stale,
        };
        // A caller that is gone drops the verdict, and with it its record (forgotten) and its
        // forward's entry (nothing was sent).
        let _ = pending.reply.send(Ok(verdict));
    }
}

/// The idempotency records of one batch, column by column.
#[derive(Default)]
struct RecordColumns<'a> {
    accounts: Vec<&'a str>,
    keys: Vec<&'a str>,
    fingerprints: Vec<&'a str>,
    tokens: Vec<i64>,
    owners: Vec<&'a str>,
    in_doubt_after_ms: Vec<i64>,
}

/// The batch committed, but PostgreSQL could not say that the commit reached the synchronous
/// standby: a failover may lose it. No request of it is taken as accepted: each is answered as
/// the database failing (nothing forwarded; the client may retry). The records the commit
/// made are forgotten at once, before anything was forwarded, so they are
/// removed as unsent, and a retry with the same key is not refused (should the removal itself
/// be lost, the record is in doubt once its deadline passes: a retry is refused, never
/// forwarded twice). The marks it advanced stay: a mark advanced for a request that was not
/// forwarded is safe (`proxy::fence` says why), and one lost at a failover is covered by the
/// fencing floor (`store::epoch`).
fn not_replicated(
    batch: Vec<Pending>,
    recorded: &HashSet<(String, String)>,
    records_store: &Arc<dyn Records>,
) {
    tracing::error!(
        requests = batch.len(),
        records = recorded.len(),
        "a fence batch committed locally but its wait for the synchronous standby was \
         cancelled: none of its requests is forwarded (503), and the idempotency records it made \
         are removed"
    );
    for pending in batch {
        if let Some(record) = pending
            .record
            .filter(|r| recorded.contains(&(pending.account.as_str().to_string(), r.key.clone())))
        {
            let id = RecordId {
                account: pending.account.clone(),
                key: record.key,
                owner: record.owner,
            };
            drop(Created::new(records_store.clone(), id));
        }
        let _ = pending.reply.send(Err(StoreError::NotReplicated));
    }
}

/// The batch failed: each request is answered as the database failing (nothing forwarded; the
/// client may retry). With `records_store`, an attempt's connection closed under it, so the
/// attempt may have committed before its answer was lost: the records it may have made are
/// forgotten as unsent (only their owner's, only while in flight and before the owner's
/// deadline), so that the retry the refusal asks for is not met by a record of a request
/// that was never forwarded — `in_flight`, then `in_doubt` for good.
fn fail(batch: Vec<Pending>, error: StoreError, records_store: Option<&Arc<dyn Records>>) {
    tracing::warn!(error = %error, requests = batch.len(), "fence batch failed");
    for pending in batch {
        if let (Some(records_store), Some(record)) = (records_store, &pending.record) {
            let id = RecordId {
                account: pending.account.clone(),
                key: record.key.clone(),
                owner: record.owner.clone(),
            };
            records_store.forget_unsent(id);
        }
        let _ = pending.reply.send(Err(error.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::time::Duration;

    use crate::store::batch::{HeldRows, take};

    fn pending(
        account: &str,
        token: i64,
        key: Option<&str>,
    ) -> (Pending, oneshot::Receiver<Result<Verdict, StoreError>>) {
        let (reply, rx) = oneshot::channel();
        let record = key.map(|k| NewRecord {
            key: k.into(),
            fingerprint: "f".into(),
            owner: "o".into(),
            in_doubt_after: Duration::from_secs(5),
        });
        let p = Pending {
            account: AccountId::parse(account, 64).unwrap(),
            token: FencingToken::new(token).unwrap(),
            record,
            reply,
        };
        (p, rx)
    }

    #[test]
    fn a_batch_never_holds_two_tokens_for_one_account_nor_one_key_twice() {
        let mut waiting = VecDeque::new();
        let mut receivers = Vec::new();
        for (account, token, key) in [
            ("a", 5, None),
            ("b", 1, Some("k")),
            ("a", 5, None),
            ("a", 6, None),
            ("b", 1, Some("k")),
            ("c", 9, None),
        ] {
            let (p, rx) = pending(account, token, key);
            waiting.push_back(p);
            receivers.push(rx);
        }
        let (batch, blocked) = take::<Advance>(&mut waiting, 100, &Rows::default());
        assert!(blocked.is_empty());
        let picked: Vec<(String, i64)> = batch
            .iter()
            .map(|p| (p.account.to_string(), p.token.get()))
            .collect();
        assert_eq!(
            picked,
            [
                ("a".into(), 5),
                ("b".into(), 1),
                ("a".into(), 5),
                ("c".into(), 9)
            ]
        );
        let left: Vec<(String, i64)> = waiting
            .iter()
            .map(|p| (p.account.to_string(), p.token.get()))
            .collect();
        assert_eq!(
            left,
            [("a".into(), 6), ("b".into(), 1)],
            "deferred, in arrival order"
        );
    }

    #[test]
    fn a_batch_respects_its_size_and_skips_callers_that_left() {
        let mut waiting = VecDeque::new();
        let mut keep = Vec::new();
        for i in 0..10 {
            let (p, rx) = pending(&format!("acct-{i}"), 1, None);
            waiting.push_back(p);
            if i != 0 {
                keep.push(rx); // the first caller's receiver is dropped: it gave up
            }
        }
        let (batch, _) = take::<Advance>(&mut waiting, 4, &Rows::default());
        assert_eq!(batch.len(), 4);
        assert_eq!(batch[0].account.as_str(), "acct-1");
        assert_eq!(waiting.len(), 5);
    }

    fn accounts(requests: &VecDeque<Pending>) -> Vec<(String, i64)> {
        requests
            .iter()
            .map(|p| (p.account.to_string(), p.token.get()))
            .collect()
    }

    #[test]
    fn requests_for_rows_a_statement_in_flight_holds_are_held_back_in_order() {
        let mut waiting = VecDeque::new();
        let mut receivers = Vec::new();
        for (account, token, key) in [
            ("a", 5, None),
            ("b", 1, Some("k")),
            ("a", 6, None),
            ("b", 1, Some("other")),
            ("c", 2, None),
        ] {
            let (p, rx) = pending(account, token, key);
            waiting.push_back(p);
            receivers.push(rx);
        }
        // a's mark is held by a compare-and-set, b's record k by a completion.
        let held = Arc::new(HeldRows::default());
        let account = |name| AccountId::parse(name, 64).unwrap();
        let _statements = held.hold(
            &mut held.rows(),
            vec![account("a")],
            vec![(account("b"), "k".into())],
        );
        let (batch, blocked) = take::<Advance>(&mut waiting, 100, &held.rows());
        let picked: Vec<(&str, Option<&str>)> = batch
            .iter()
            .map(|p| {
                (
                    p.account.as_str(),
                    p.record.as_ref().map(|r| r.key.as_str()),
                )
            })
            .collect();
        assert_eq!(picked, [("b", Some("other")), ("c", None)]);
        let blocked: VecDeque<Pending> = blocked
            .into_iter()
            .map(|(row, pending)| {
                let account = pending.account.clone();
                let key = pending.record.as_ref().map(|r| r.key.clone());
                assert_eq!(
                    row,
                    match key {
                        Some(key) => HeldRow::Record(account, key),
                        None => HeldRow::Mark(account),
                    }
                );
                pending
            })
            .collect();
        assert_eq!(
            accounts(&blocked),
            [("a".into(), 5), ("b".into(), 1), ("a".into(), 6)]
        );
        assert!(waiting.is_empty());
    }
}
