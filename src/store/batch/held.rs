//! Rows that a batched statement still unanswered may hold locked, and the queue in which the
//! batchers' requests for those rows wait.
//!
//! A statement that stalls with row locks held (a backend stopped mid-statement) is set aside
//! so that the next batch can start ([`super::slots`]). But a batch that meets one of its locked
//! rows waits for that lock until `lock_timeout` and then fails as a whole: every request in it
//! refused for one row's sake, batch after batch while the stall lasts. So each batcher keeps
//! here what its statements in flight lock — the fence's compare-and-sets their accounts' mark
//! rows, a completion its records — and a request that needs one of those rows waits in its
//! batcher (`BatchQueue`) until the statement answers, instead of joining a batch. That is
//! what the database would make it do anyway, without holding up the rest of a batch. The
//! records a compare-and-set creates or meets (a repeat's) are not kept: completions go first,
//! since repeats of a key keep coming while its first request waits for its answer to be
//! stored, and a completion waiting behind them would be starved; a repeat waits for the
//! completion instead. Only this process's statements are known here: a stalled
//! statement of another railguard on the same database still costs batches of this one that
//! meet its rows.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, mpsc};

use crate::token::AccountId;

/// The rows held by this process's statements in flight; shared by its batchers.
#[derive(Default)]
pub struct HeldRows {
    rows: Mutex<Rows>,
    /// One per batcher: woken when a statement lets its rows go.
    released: Mutex<Vec<Arc<Notify>>>,
}

/// What the statements in flight hold.
#[derive(Default)]
pub(crate) struct Rows {
    /// Accounts whose mark row a compare-and-set holds.
    marks: HashSet<AccountId>,
    /// Idempotency records, by account and key, that a statement holds.
    records: HashMap<AccountId, HashSet<String>>,
}

/// The held row a request waits for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum HeldRow {
    Mark(AccountId),
    Record(AccountId, String),
}

impl Rows {
    /// The held row a compare-and-set for `account` (creating the record `key`) would meet,
    /// if any.
    pub(crate) fn fence_blocker(&self, account: &AccountId, key: Option<&str>) -> Option<HeldRow> {
        if self.marks.contains(account) {
            return Some(HeldRow::Mark(account.clone()));
        }
        key.filter(|key| self.holds_record(account, key))
            .map(|key| HeldRow::Record(account.clone(), key.to_string()))
    }

    /// The held row a completion of the record `key` of `account` would meet, if any.
    pub(crate) fn completion_blocker(&self, account: &AccountId, key: &str) -> Option<HeldRow> {
        self.holds_record(account, key)
            .then(|| HeldRow::Record(account.clone(), key.to_string()))
    }

    fn holds(&self, row: &HeldRow) -> bool {
        match row {
            HeldRow::Mark(account) => self.marks.contains(account),
            HeldRow::Record(account, key) => self.holds_record(account, key),
        }
    }

    fn holds_record(&self, account: &AccountId, key: &str) -> bool {
        self.records
            .get(account)
            .is_some_and(|keys| keys.contains(key))
    }
}

impl HeldRows {
    /// What the statements in flight hold now; a batcher takes its batch under it.
    pub(crate) fn rows(&self) -> MutexGuard<'_, Rows> {
        self.rows.lock().expect("never poisoned")
    }

    /// Holds `marks` and `records` until the returned value is dropped (when the statement
    /// that touches them has answered). `rows` is [`rows`](Self::rows), under which the batch
    /// was taken, so that no other batcher takes the same rows meanwhile. Each row is held by
    /// one statement at a time: a batcher never puts a held row in a new batch.
    pub(crate) fn hold(
        self: &Arc<Self>,
        rows: &mut Rows,
        marks: Vec<AccountId>,
        records: Vec<(AccountId, String)>,
    ) -> Held {
        for account in &marks {
            rows.marks.insert(account.clone());
        }
        for (account, key) in &records {
            rows.records
                .entry(account.clone())
                .or_default()
                .insert(key.clone());
        }
        Held {
            held: self.clone(),
            marks,
            records,
        }
    }

    /// What wakes one batcher when a statement lets its rows go. Each batcher has its own, so
    /// that a release one of them does not wait for is never lost to another.
    pub(crate) fn subscribe(&self) -> Arc<Notify> {
        let released = Arc::new(Notify::new());
        self.released
            .lock()
            .expect("never poisoned")
            .push(released.clone());
        released
    }
}

/// Rows held for one statement; dropping it lets them go, and wakes the batchers.
pub(crate) struct Held {
    held: Arc<HeldRows>,
    marks: Vec<AccountId>,
    records: Vec<(AccountId, String)>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.marks.is_empty() && self.records.is_empty() {
            return; // a statement that locks nothing (a last look) lets nothing go
        }
        let mut rows = self.held.rows();
        for account in &self.marks {
            rows.marks.remove(account);
        }
        for (account, key) in &self.records {
            if let Entry::Occupied(mut keys) = rows.records.entry(account.clone()) {
                keys.get_mut().remove(key);
                if keys.get().is_empty() {
                    keys.remove();
                }
            }
        }
        drop(rows);
        for released in self.held.released.lock().expect("never poisoned").iter() {
            released.notify_one();
        }
    }
}

/// A batcher's requests: those waiting for a batch, and those held back because they need a
/// row a statement in flight holds — grouped by that row, in arrival order within each, so
/// that a pass looks only at the groups whose row was let go (a busy account behind a long
/// stall may hold back thousands).
pub(crate) struct BatchQueue<T> {
    queue: mpsc::Receiver<T>,
    pub(crate) waiting: VecDeque<T>,
    held_back: HashMap<HeldRow, VecDeque<T>>,
    open: bool,
}

/// A group held back this long or longer drops its requests whose callers left whenever it
/// doubles, so that a long stall does not accumulate them.
const PRUNE_FROM: usize = 64;

impl<T> BatchQueue<T> {
    pub(crate) fn new(queue: mpsc::Receiver<T>) -> Self {
        Self {
            queue,
            waiting: VecDeque::new(),
            held_back: HashMap::new(),
            open: true,
        }
    }

    /// Waits until there is something to batch; `false` once every sender is gone and
    /// nothing is left.
    pub(crate) async fn has_work(&mut self) -> bool {
        if !self.waiting.is_empty() || !self.held_back.is_empty() {
            return true;
        }
        match self.queue.recv().await {
            Some(request) => {
                self.waiting.push_back(request);
                true
            }
            None => false,
        }
    }

    /// Takes in what has arrived meanwhile, up to `most` waiting, and puts before it the
    /// requests held back for rows no longer held (those still `wanted`): they arrived
    /// earlier.
    pub(crate) fn gather(&mut self, most: usize, rows: &Rows, wanted: impl Fn(&T) -> bool) {
        while self.waiting.len() < most {
            match self.queue.try_recv() {
                Ok(request) => self.waiting.push_back(request),
                Err(_) => break,
            }
        }
        let free: Vec<HeldRow> = self
            .held_back
            .keys()
            .filter(|row| !rows.holds(row))
            .cloned()
            .collect();
        for row in free {
            let group = self.held_back.remove(&row).unwrap_or_default();
            for request in group.into_iter().rev().filter(|r| wanted(r)) {
                self.waiting.push_front(request);
            }
        }
    }

    /// Requests that need rows held now, with the row each waits for, to wait for a later
    /// batch.
    pub(crate) fn hold_back(
        &mut self,
        requests: impl IntoIterator<Item = (HeldRow, T)>,
        wanted: impl Fn(&T) -> bool,
    ) {
        for (row, request) in requests {
            let group = self.held_back.entry(row).or_default();
            group.push_back(request);
            if group.len() >= PRUNE_FROM && group.len().is_power_of_two() {
                group.retain(&wanted);
            }
        }
    }

    /// The next batch, taken under the rows' lock: gathers what has arrived (up to `most`
    /// waiting) and what is no longer held back; `take` picks the batch and names the
    /// requests that need held rows, which wait; the rows `locked` says the batch's statement
    /// will lock are held until the returned [`Held`] is dropped. `None`: nothing could go.
    pub(crate) fn next_batch(
        &mut self,
        held: &Arc<HeldRows>,
        most: usize,
        wanted: impl Fn(&T) -> bool + Copy,
        take: impl FnOnce(&mut VecDeque<T>, &Rows) -> (Vec<T>, Vec<(HeldRow, T)>),
        locked: impl FnOnce(&[T]) -> (Vec<AccountId>, Vec<(AccountId, String)>),
    ) -> Option<(Vec<T>, Held)> {
        let mut rows = held.rows();
        self.gather(most, &rows, wanted);
        let (batch, blocked) = take(&mut self.waiting, &rows);
        self.hold_back(blocked, wanted);
        if batch.is_empty() {
            return None;
        }
        let (marks, records) = locked(&batch);
        let rows = held.hold(&mut rows, marks, records);
        Some((batch, rows))
    }

    /// Nothing could be batched: waits until a statement lets its rows go (`released`) or
    /// another request arrives. Returns at once when nothing is held back.
    pub(crate) async fn wait_for_rows(&mut self, released: &Notify) {
        if self.held_back.is_empty() {
            return;
        }
        tokio::select! {
            () = released.notified() => {}
            next = self.queue.recv(), if self.open => match next {
                Some(request) => self.waiting.push_back(request),
                None => self.open = false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(name: &str) -> AccountId {
        AccountId::parse(name, 64).unwrap()
    }

    #[test]
    fn rows_are_held_until_their_statement_answers() {
        let held = Arc::new(HeldRows::default());
        let (a, b) = (account("a"), account("b"));
        let statement = held.hold(
            &mut held.rows(),
            vec![a.clone()],
            vec![(b.clone(), "k".into())],
        );
        {
            let rows = held.rows();
            assert_eq!(rows.fence_blocker(&a, None), Some(HeldRow::Mark(a.clone())));
            assert_eq!(
                rows.fence_blocker(&a, Some("k")),
                Some(HeldRow::Mark(a.clone())),
                "the mark first"
            );
            assert_eq!(
                rows.fence_blocker(&b, Some("k")),
                Some(HeldRow::Record(b.clone(), "k".into()))
            );
            assert_eq!(rows.fence_blocker(&b, Some("other")), None);
            assert_eq!(rows.fence_blocker(&b, None), None);
            assert!(rows.completion_blocker(&b, "k").is_some());
            assert!(rows.completion_blocker(&a, "k").is_none());
        }
        drop(statement);
        let rows = held.rows();
        assert_eq!(rows.fence_blocker(&a, None), None);
        assert!(rows.completion_blocker(&b, "k").is_none());
        assert!(rows.records.is_empty(), "nothing left behind");
    }

    #[tokio::test]
    async fn requests_held_back_go_first_once_their_row_is_let_go() {
        let (tx, rx) = mpsc::channel(8);
        let mut queue = BatchQueue::new(rx);
        let held = Arc::new(HeldRows::default());
        let (a, b) = (account("a"), account("b"));
        let on_a = held.hold(&mut held.rows(), vec![a.clone()], vec![]);
        let on_b = held.hold(&mut held.rows(), vec![b.clone()], vec![]);
        for n in 1..=4 {
            tx.send(n).await.unwrap();
        }
        assert!(queue.has_work().await);
        queue.gather(100, &held.rows(), |_| true);
        let first: VecDeque<i32> = queue.waiting.drain(..).collect();
        assert_eq!(first, [1, 2, 3, 4]);
        let (mark_a, mark_b) = (HeldRow::Mark(a), HeldRow::Mark(b));
        queue.hold_back([(mark_a.clone(), 1), (mark_b, 2), (mark_a, 3)], |_| true);
        tx.send(5).await.unwrap();
        drop(on_a);
        queue.gather(100, &held.rows(), |n| *n != 3); // 3's caller left
        assert_eq!(queue.waiting, [1, 5], "a's go first; b's still wait");
        drop(on_b);
        queue.waiting.clear();
        queue.gather(100, &held.rows(), |_| true);
        assert_eq!(queue.waiting, [2]);
        assert!(queue.held_back.is_empty());
    }

    #[test]
    fn a_long_held_group_drops_requests_whose_callers_left() {
        let (_tx, rx) = mpsc::channel::<i32>(1);
        let mut queue = BatchQueue::new(rx);
        let row = HeldRow::Mark(account("a"));
        queue.hold_back((0..PRUNE_FROM as i32).map(|n| (row.clone(), n)), |n| {
            n % 2 == 0
        });
        assert_eq!(queue.held_back[&row].len(), PRUNE_FROM / 2);
    }

    #[tokio::test]
    async fn a_batcher_with_only_held_back_requests_waits_for_a_release_or_an_arrival() {
        let (tx, rx) = mpsc::channel(8);
        let mut queue = BatchQueue::new(rx);
        let held = Arc::new(HeldRows::default());
        queue.hold_back([(HeldRow::Mark(account("a")), 1)], |_| true);
        let released = held.subscribe();
        let statement = held.hold(&mut held.rows(), vec![account("a")], vec![]);
        let waited = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            queue.wait_for_rows(&released),
        )
        .await;
        assert!(waited.is_err(), "nothing released, nothing arrived");
        drop(statement);
        queue.wait_for_rows(&released).await;
        tx.send(2).await.unwrap();
        queue.wait_for_rows(&released).await;
        assert_eq!(queue.waiting, [2]);
        drop(tx);
        queue.wait_for_rows(&released).await;
        assert!(!queue.open, "the queue closed");
    }

    #[tokio::test]
    async fn a_release_wakes_every_batcher_even_one_not_yet_waiting() {
        let held = Arc::new(HeldRows::default());
        let (fence, completions) = (held.subscribe(), held.subscribe());
        let statement = held.hold(&mut held.rows(), vec![account("a")], vec![]);
        let waiting = tokio::spawn(async move { fence.notified().await });
        tokio::task::yield_now().await;
        drop(statement);
        let within = std::time::Duration::from_secs(1);
        tokio::time::timeout(within, waiting)
            .await
            .expect("the waiting batcher is woken")
            .unwrap();
        tokio::time::timeout(within, completions.notified())
            .await
            .expect("and the other finds the release when it comes to wait");
    }
}
