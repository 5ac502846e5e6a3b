//! The one group-commit batcher, behind every statement railguard runs for a request: the
//! fence's compare-and-sets ([`super::marks`]' `advance`), its last looks (`look`) and the
//! idempotency completions ([`super::records`]' `outcomes`).
//!
//! One durable commit costs 0.4–3 ms of fsync on these machines, so one commit per request caps
//! the proxy at a few thousand requests per second. Requests queue here instead; a batch takes
//! every request waiting when a statement place frees up (at most the job's `max_batch`), and
//! the job runs them as one statement over `unnest` arrays — one round trip, one commit. While
//! `concurrency` statements wait for their commits, the next batch fills.
//!
//! What is the same for every job lives here, once:
//!
//! - **places** ([`slots`]): at most `concurrency` statements hold a place; one that stalls
//!   moves aside after a tenth of the database timeout and is still listened to; every
//!   statement is counted in the process's work tracker ([`crate::work`]) until it has answered, so that shutdown waits for
//!   it;
//! - **rows held by a statement in flight** ([`held`]): a request that needs a row a stalled
//!   statement holds waits for that statement instead of joining (and failing) a batch;
//! - **which requests share a statement** (`Job::fits`): a job names the requests that may
//!   not share one (two tokens for one account, one record twice), and they wait for a later
//!   batch, in arrival order;
//! - **callers that left** (`Job::wanted`): their requests are dropped before anything is
//!   done for them.
//!
//! A job says what its statement is and what its answer means (`Job::start`); it knows
//! nothing of HTTP: requests come in and verdicts go out as plain values.

pub mod held;
pub mod slots;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, IntGaugeVec};
use tokio::sync::mpsc;

pub use self::held::HeldRows;
pub(crate) use self::held::{BatchQueue, HeldRow, Rows};
pub use self::slots::{StatementSlots, most_in_flight};
use crate::token::AccountId;
use crate::work::{Tracked, Work};

/// One kind of statement a batcher runs over many requests.
pub(crate) trait Job: Send + Sync + 'static {
    /// One request waiting for its statement.
    type Item: Send + 'static;
    /// What the requests taken into a batch so far hold, for [`fits`](Self::fits).
    type Taken: Default;
    /// Which batcher, as `railguard_db_statements_stalled{statement}` names it.
    const NAME: &'static str;

    /// Whether the request's caller still waits for it; one that does not is dropped.
    fn wanted(item: &Self::Item) -> bool;

    /// The row a statement in flight holds that the request would meet, if any: the request
    /// waits until that statement answers.
    fn blocker(_item: &Self::Item, _rows: &Rows) -> Option<HeldRow> {
        None
    }

    /// Whether the request may join the batch beside those `taken` (and, if it does, adds it
    /// to them), waits for a later batch, or is no longer this batcher's to run.
    fn fits(taken: &mut Self::Taken, item: &Self::Item) -> Fit;

    /// The rows the batch's statement locks — accounts' marks, idempotency records — held
    /// until it answers.
    fn locks(_batch: &[Self::Item]) -> (Vec<AccountId>, Vec<(AccountId, String)>) {
        (Vec::new(), Vec::new())
    }

    /// Starts the batch: what must happen before its statement is sent happens now, and the
    /// returned future runs the statement and answers each request.
    fn start(&self, batch: Vec<Self::Item>) -> impl Future<Output = ()> + Send + 'static;
}

/// Where a request goes when a batch is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    /// Into this batch.
    Take,
    /// Into a later batch: it may not share this one's statement.
    Later,
    /// Nowhere: someone else runs it now.
    Skip,
}

/// How statements are grouped, for every batcher alike.
#[derive(Clone)]
pub struct Batching {
    /// Most requests in one statement.
    pub max_batch: usize,
    /// Statements in flight at once; while they wait for their commit the next batch fills.
    pub concurrency: usize,
    /// Where each batcher counts its stalled statements ([`slots`]), by the label
    /// `statement`: `fence`, `completion`, `look`.
    pub stalled: IntGaugeVec,
    /// Statements not yet answered, and what their answers left to do: shutdown waits for
    /// them ([`slots`]).
    pub unanswered: Tracked,
    /// Rows the statements in flight hold, which the batchers' requests wait for ([`held`]).
    pub held: Arc<HeldRows>,
    /// Commits of the main pool's sessions reported as done but not replicated
    /// ([`crate::db::notices`]): the fence's compare-and-sets read theirs.
    pub notices: crate::db::Notices,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            max_batch: 512,
            concurrency: 1,
            stalled: crate::metrics::statements_stalled(),
            unanswered: Tracked::alone(Work::Statement),
            held: Arc::default(),
            notices: crate::db::Notices::default(),
        }
    }
}

/// Every batcher's name, as the stalled gauge labels it.
const BATCHERS: [&str; 3] = ["fence", "completion", "look"];

impl Batching {
    /// Why no statement of some batcher can start now: every place, the overrun places
    /// included, is held by a statement stalled on the database ([`slots`]).
    pub fn jammed(&self) -> Option<String> {
        let places = most_in_flight(self.concurrency);
        BATCHERS.into_iter().find_map(|statement| {
            let stalled = self.stalled.with_label_values(&[statement]).get();
            (stalled >= places as i64).then(|| {
                format!(
                    "{stalled} {statement} statements stalled on their database connections hold \
                     every place, so no other can start (railguard_db_statements_stalled)"
                )
            })
        })
    }

    /// The places of one batcher's statements (`statement`: which batcher, for the gauge).
    pub(crate) fn slots(&self, statement: &str, timeout: Duration) -> StatementSlots {
        StatementSlots::new(
            self.concurrency,
            timeout,
            self.stalled.with_label_values(&[statement]),
            self.unanswered.clone(),
        )
    }
}

/// Runs `job`'s batches until every sender of `queue` is gone: at most `max_batch` requests
/// per statement, `batching.concurrency` statements in flight, each batch's size observed in
/// `sizes`.
pub(crate) async fn run<J: Job>(
    job: J,
    batching: Batching,
    timeout: Duration,
    max_batch: usize,
    sizes: Option<Histogram>,
    queue: mpsc::Receiver<J::Item>,
) {
    let slots = batching.slots(J::NAME, timeout);
    let held = batching.held.clone();
    let released = held.subscribe();
    let max_batch = max_batch.max(1);
    let mut queue = BatchQueue::new(queue);
    while queue.has_work().await {
        let slot = slots.wait().await;
        // Counted before the callers are asked whether they still wait: one that leaves just
        // after must not leave a moment in which neither it nor its statement is counted (a
        // stop then would not wait for a statement about to be sent).
        let counting = batching.unanswered.start();
        // Everything that arrived while we waited for a place rides along; the statement's
        // rows are held until it answers.
        let Some((batch, rows)) = queue.next_batch(
            &held,
            max_batch * 4,
            J::wanted,
            |waiting, rows| take::<J>(waiting, max_batch, rows),
            J::locks,
        ) else {
            drop(slot);
            // Only requests for rows that statements in flight hold: wait for one to answer,
            // or for a request that can go.
            queue.wait_for_rows(&released).await;
            continue;
        };
        if let Some(sizes) = &sizes {
            sizes.observe(batch.len() as f64);
        }
        let statement = job.start(batch);
        // A statement that stalls stops holding up the next batch, and is still listened to.
        slots.run(slot, async move {
            statement.await;
            drop(rows);
        });
        drop(counting); // the statement is counted by its place from here on
    }
}

/// A batch, and the requests that wait for rows statements in flight hold.
pub(crate) type Taken<T> = (Vec<T>, Vec<(HeldRow, T)>);

/// Takes, in arrival order, the requests that can share one statement; leaves the rest in
/// `waiting`, and returns apart those that need a row a statement in flight holds.
pub(crate) fn take<J: Job>(
    waiting: &mut VecDeque<J::Item>,
    max: usize,
    rows: &Rows,
) -> Taken<J::Item> {
    let mut taken = J::Taken::default();
    let mut batch = Vec::new();
    let mut later = VecDeque::new();
    let mut blocked = Vec::new();
    for item in waiting.drain(..) {
        if !J::wanted(&item) {
            continue; // its caller gave up before anything was done
        }
        if let Some(row) = J::blocker(&item, rows) {
            blocked.push((row, item));
            continue;
        }
        if batch.len() >= max {
            later.push_back(item);
            continue;
        }
        match J::fits(&mut taken, &item) {
            Fit::Take => batch.push(item),
            Fit::Later => later.push_back(item),
            Fit::Skip => {}
        }
    }
    *waiting = later;
    (batch, blocked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tokio::sync::oneshot;

    /// Numbers, batched; an odd and an even number may not share a batch; each batch's
    /// statement waits until the test lets it answer.
    struct Numbers {
        batches: Arc<Mutex<Vec<Vec<u32>>>>,
        answer: Arc<tokio::sync::Semaphore>,
    }

    #[derive(Default)]
    struct Parity(Option<u32>);

    impl Job for Numbers {
        type Item = (u32, oneshot::Sender<()>);
        type Taken = Parity;
        const NAME: &'static str = "look";

        fn wanted(item: &Self::Item) -> bool {
            !item.1.is_closed()
        }

        fn fits(taken: &mut Parity, item: &Self::Item) -> Fit {
            match taken.0 {
                Some(parity) if parity != item.0 % 2 => Fit::Later,
                _ => {
                    taken.0 = Some(item.0 % 2);
                    Fit::Take
                }
            }
        }

        fn start(&self, batch: Vec<Self::Item>) -> impl Future<Output = ()> + Send + 'static {
            self.batches
                .lock()
                .unwrap()
                .push(batch.iter().map(|(n, _)| *n).collect());
            let answer = self.answer.clone();
            async move {
                answer.acquire().await.unwrap().forget();
                for (_, reply) in batch {
                    let _ = reply.send(());
                }
            }
        }
    }

    #[tokio::test]
    async fn what_arrives_while_a_statement_runs_shares_the_next_one_unless_it_may_not() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let answer = Arc::new(tokio::sync::Semaphore::new(0));
        let (queue, requests) = mpsc::channel(64);
        tokio::spawn(run(
            Numbers {
                batches: batches.clone(),
                answer: answer.clone(),
            },
            Batching::default(),
            Duration::from_secs(60),
            3,
            None,
            requests,
        ));
        let mut replies = Vec::new();
        let mut send = |n: u32| {
            let (reply, answered) = oneshot::channel();
            queue.try_send((n, reply)).unwrap();
            replies.push(answered);
        };
        send(0);
        while batches.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        // The first statement holds the one place; these wait, and then go in arrival order,
        // at most three a statement, odd and even apart.
        for n in [2, 1, 4, 6, 8, 3] {
            send(n);
        }
        answer.add_permits(4);
        for reply in replies.drain(..) {
            tokio::time::timeout(Duration::from_secs(5), reply)
                .await
                .expect("answered")
                .unwrap();
        }
        assert_eq!(
            *batches.lock().unwrap(),
            [vec![0], vec![2, 4, 6], vec![1, 3], vec![8]]
        );
    }
}
