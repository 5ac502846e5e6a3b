//! Group commit for fence compare-and-sets.
//!
//! One durable commit costs 0.4–3 ms of fsync on these machines, so one commit per request caps
//! the proxy at a few thousand requests per second. Requests queue here instead; a batch takes
//! every request waiting when a statement slot frees up (at most `max_batch`), and runs them as
//! one statement over `unnest` arrays — one round trip, one commit. While `concurrency`
//! statements wait for their commits, the next batch fills; a statement that stalls stops
//! holding its place after a tenth of the database timeout, and is still listened to
//! ([`crate::db::slots`]).
//!
//! **Exactness.** Each request is one row of the statement, and a row's verdict is the verdict
//! of that request's own compare-and-set. To keep it so, a batch never holds two requests for
//! one account with *different* tokens (`ON CONFLICT DO UPDATE` may not touch a row twice),
//! nor two idempotency records with the same key; such requests wait for a later batch.
//! Requests for one account with the *same* token share a row and its verdict, which is what
//! running them one after the other would give. Rows are inserted in account order, so two
//! batches in flight lock rows in the same order and cannot deadlock. And a batch never holds
//! an account that a statement still unanswered holds: such a request waits for that
//! statement to answer ([`HeldAccounts`]), so that a statement stalled with its row locks held
//! (a stopped backend) holds up its own accounts only, not every batch that meets one of them.
//!
//! **Callers that gave up.** A record a request's row created is handed to the caller as a
//! [`RecordGuard`] inside its verdict. A caller whose deadline passed has dropped its reply
//! channel, so the verdict — and the guard in it — is dropped undelivered, and the guard
//! deletes the record: nothing forwarded that request, so a retry must not be refused.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use deadpool_postgres::Pool;
use prometheus::Histogram;
use tokio::sync::{Notify, mpsc, oneshot};

use super::store::{StoreError, Verdict};
use crate::db::DbError;
use crate::db::slots::StatementSlots;
use crate::proxy::idempotency::{InstanceId, NewRecord, RecordGuard, RecordId, Records};
use crate::token::{AccountId, FencingToken};

const BATCH_SQL: &str = "\
WITH fenced AS (
    INSERT INTO rail_high_water AS h (account_id, highest_token)
    SELECT account_id, token FROM unnest($1::text[], $2::bigint[]) AS t(account_id, token)
    ORDER BY account_id
    ON CONFLICT (account_id) DO UPDATE
        SET highest_token = EXCLUDED.highest_token, updated_at = now()
        WHERE h.highest_token <= EXCLUDED.highest_token
    RETURNING account_id
), recorded AS (
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
SELECT account_id, NULL::text FROM fenced
UNION ALL
SELECT account_id, idempotency_key FROM recorded";

/// One request waiting for its verdict.
pub(super) struct Pending {
    pub account: AccountId,
    pub token: FencingToken,
    pub record: Option<NewRecord>,
    pub reply: oneshot::Sender<Result<Verdict, StoreError>>,
}

/// The batcher: runs until every sender is gone.
pub(super) async fn run(
    pool: Pool,
    slots: StatementSlots,
    max_batch: usize,
    sizes: Histogram,
    instance: InstanceId,
    records: Arc<dyn Records>,
    mut queue: mpsc::Receiver<Pending>,
) {
    let held = Arc::new(HeldAccounts::default());
    let mut waiting: VecDeque<Pending> = VecDeque::new();
    // Requests for accounts that a statement still unanswered holds, in arrival order.
    let mut held_back: VecDeque<Pending> = VecDeque::new();
    let mut open = true;
    loop {
        if waiting.is_empty() && held_back.is_empty() {
            match queue.recv().await {
                Some(pending) => waiting.push_back(pending),
                None => return,
            }
        }
        let slot = slots.wait().await;
        // Everything that arrived while we waited for a slot rides along.
        while waiting.len() < max_batch * 4 {
            match queue.try_recv() {
                Ok(pending) => waiting.push_back(pending),
                Err(_) => break,
            }
        }
        // Those held back go first once their accounts are free: they arrived earlier.
        held_back.retain(|p| !p.reply.is_closed());
        while let Some(pending) = held_back.pop_back() {
            waiting.push_front(pending);
        }
        let batch = {
            let holds = held.accounts.lock().expect("never poisoned");
            let (batch, blocked) = take_batch(&mut waiting, max_batch, &holds);
            held_back = blocked;
            batch
        };
        if batch.is_empty() {
            drop(slot);
            if held_back.is_empty() {
                continue;
            }
            // Only requests for held accounts: wait until a statement answers, or for one
            // that can go.
            tokio::select! {
                () = held.released.notified() => {}
                next = queue.recv(), if open => match next {
                    Some(pending) => waiting.push_back(pending),
                    None => open = false,
                },
            }
            continue;
        }
        sizes.observe(batch.len() as f64);
        let accounts = held.hold(&batch);
        let (pool, records, held) = (pool.clone(), records.clone(), held.clone());
        // A statement that stalls stops holding up the next batch, and is still listened to.
        slots.run(slot, async move {
            execute(&pool, instance, &records, batch).await;
            held.release(&accounts);
        });
    }
}

/// Accounts whose rows a statement still unanswered may hold locked. A request for one of them
/// waits for that statement rather than joining the next batch: there it would wait for the
/// row lock anyway, holding the locks of every other row of its batch meanwhile — and behind a
/// statement stalled with its locks held (a stopped backend), the whole batch would fail at
/// `lock_timeout`, every request in it refused for one account's sake.
#[derive(Default)]
struct HeldAccounts {
    accounts: Mutex<HashSet<AccountId>>,
    released: Notify,
}

impl HeldAccounts {
    /// Holds the accounts of `batch` (distinct within it); returns them, for [`Self::release`].
    fn hold(&self, batch: &[Pending]) -> Vec<AccountId> {
        let mut accounts = self.accounts.lock().expect("never poisoned");
        batch
            .iter()
            .filter(|p| accounts.insert(p.account.clone()))
            .map(|p| p.account.clone())
            .collect()
    }

    fn release(&self, held: &[AccountId]) {
        let mut accounts = self.accounts.lock().expect("never poisoned");
        for account in held {
            accounts.remove(account);
        }
        drop(accounts);
        self.released.notify_one();
    }
}

/// Takes, in arrival order, the requests that can share one statement; leaves the rest in
/// `waiting`, and returns apart those for accounts a statement in flight holds.
fn take_batch(
    waiting: &mut VecDeque<Pending>,
    max: usize,
    held: &HashSet<AccountId>,
) -> (Vec<Pending>, VecDeque<Pending>) {
    let mut batch = Vec::new();
    let mut tokens: HashMap<AccountId, FencingToken> = HashMap::new();
    let mut keys: HashSet<(AccountId, String)> = HashSet::new();
    let mut later = VecDeque::new();
    let mut blocked = VecDeque::new();
    for pending in waiting.drain(..) {
        if pending.reply.is_closed() {
            continue; // its caller gave up before anything was done
        }
        if held.contains(&pending.account) {
            blocked.push_back(pending);
            continue;
        }
        let clash = batch.len() >= max
            || tokens
                .get(&pending.account)
                .is_some_and(|t| *t != pending.token)
            || pending
                .record
                .as_ref()
                .is_some_and(|r| keys.contains(&(pending.account.clone(), r.key.clone())));
        if clash {
            later.push_back(pending);
            continue;
        }
        tokens.insert(pending.account.clone(), pending.token);
        if let Some(record) = &pending.record {
            keys.insert((pending.account.clone(), record.key.clone()));
        }
        batch.push(pending);
    }
    *waiting = later;
    (batch, blocked)
}

async fn execute(
    pool: &Pool,
    instance: InstanceId,
    records_store: &Arc<dyn Records>,
    batch: Vec<Pending>,
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
    // committed — it never commits after we stopped listening.
    let mut attempt = 0;
    let rows = loop {
        attempt += 1;
        let result = async {
            let client = pool.get().await.map_err(DbError::from)?;
            let statement = client.prepare_cached(BATCH_SQL).await?;
            let rows = client
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
                    ],
                )
                .await?;
            Ok::<_, StoreError>(rows)
        }
        .await;
        match result {
            // A connection closed under us (the server restarted): one retry on a fresh one.
            // Safe: advancing to the same token twice is advancing once, and a record made by
            // the first attempt is recognised by its owner id.
            Err(StoreError::Db(DbError::ConnectionClosed(_))) if attempt == 1 => continue,
            Err(e) => return fail(batch, e),
            Ok(rows) => break rows,
        }
    };
    let mut fenced: HashSet<String> = HashSet::new();
    let mut recorded: HashSet<(String, String)> = HashSet::new();
    for row in rows {
        let account: String = row.get(0);
        match row.get::<_, Option<String>>(1) {
            None => {
                fenced.insert(account);
            }
            Some(key) => {
                recorded.insert((account, key));
            }
        }
    }
    for pending in batch {
        let verdict = if fenced.contains(pending.account.as_str()) {
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
                    RecordGuard::new(records_store.clone(), id, r.maybe_sent)
                }),
            }
        } else {
            Verdict::Stale
        };
        // A caller that is gone drops the verdict, and with it the guard of its record.
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

fn fail(batch: Vec<Pending>, error: StoreError) {
    tracing::warn!(error = %error, requests = batch.len(), "fence batch failed");
    for pending in batch {
        let _ = pending.reply.send(Err(error.clone()));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

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
            maybe_sent: Default::default(),
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
        let (batch, blocked) = take_batch(&mut waiting, 100, &HashSet::new());
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
        let (batch, _) = take_batch(&mut waiting, 4, &HashSet::new());
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
    fn requests_for_an_account_a_statement_in_flight_holds_are_held_back_in_order() {
        let mut waiting = VecDeque::new();
        let mut receivers = Vec::new();
        for (account, token) in [("a", 5), ("b", 1), ("a", 6), ("c", 2)] {
            let (p, rx) = pending(account, token, None);
            waiting.push_back(p);
            receivers.push(rx);
        }
        let held = HashSet::from([AccountId::parse("a", 64).unwrap()]);
        let (batch, blocked) = take_batch(&mut waiting, 100, &held);
        let picked: Vec<&str> = batch.iter().map(|p| p.account.as_str()).collect();
        assert_eq!(picked, ["b", "c"]);
        assert_eq!(accounts(&blocked), [("a".into(), 5), ("a".into(), 6)]);
        assert!(waiting.is_empty());
    }

    #[test]
    fn an_account_is_held_until_its_statement_answers() {
        let held = HeldAccounts::default();
        let (first, _rx1) = pending("a", 5, None);
        let (again, _rx2) = pending("a", 5, None);
        let (other, _rx3) = pending("b", 1, None);
        let accounts = held.hold(&[first, again, other]);
        assert_eq!(accounts.len(), 2, "each account once");
        assert!(held.accounts.lock().unwrap().contains(&accounts[0]));
        held.release(&accounts);
        assert!(held.accounts.lock().unwrap().is_empty());
    }
}
