//! One tracker of a process's outstanding work, which a graceful stop waits for within its one
//! deadline (`server::shutdown`).
//!
//! Three kinds of work can outlive the request that started them, and each must be over before
//! the process may say it sends nothing more:
//!
//! - [`Work::Forward`]: a fenced request from before its compare-and-set until its forward
//!   ends, and a forward past its deadline or left by its client that still waits for the
//!   rail's answer (`proxy::forward`'s `LateForwards`);
//! - [`Work::Statement`]: a batched statement not yet answered, and what its answer left to do
//!   (`store::batch::slots`);
//! - [`Work::Outcome`]: an idempotency outcome retried in the background until the database
//!   takes it (`store::records`).
//!
//! Each piece of work is counted from [`WorkTracker::start`] until the returned [`Working`] is
//! dropped; [`WorkTracker::none_left`] resolves once nothing of any kind is out.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// A kind of outstanding work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    Forward,
    Statement,
    Outcome,
}

impl Work {
    const ALL: [Work; 3] = [Work::Forward, Work::Statement, Work::Outcome];

    fn index(self) -> usize {
        match self {
            Work::Forward => 0,
            Work::Statement => 1,
            Work::Outcome => 2,
        }
    }
}

/// The process's outstanding work; clones count together.
#[derive(Clone, Default)]
pub struct WorkTracker(Arc<Counts>);

#[derive(Default)]
struct Counts {
    by_kind: [AtomicUsize; 3],
    /// Woken whenever a kind's count drops to zero.
    emptied: Notify,
}

/// One piece of outstanding work, counted until dropped.
pub struct Working {
    tracker: WorkTracker,
    kind: Work,
}

impl WorkTracker {
    /// Counts one piece of `kind` until the returned value is dropped.
    pub fn start(&self, kind: Work) -> Working {
        self.0.by_kind[kind.index()].fetch_add(1, Ordering::AcqRel);
        Working {
            tracker: self.clone(),
            kind,
        }
    }

    /// How many pieces of `kind` are out.
    pub fn count(&self, kind: Work) -> usize {
        self.0.by_kind[kind.index()].load(Ordering::Acquire)
    }

    /// How many pieces of every kind are out.
    pub fn total(&self) -> usize {
        Work::ALL.into_iter().map(|kind| self.count(kind)).sum()
    }

    /// A handle that counts `kind` only, for the part of the process that does that work.
    pub fn of(&self, kind: Work) -> Tracked {
        Tracked {
            tracker: self.clone(),
            kind,
        }
    }

    /// Resolves once nothing of any kind is out.
    pub async fn none_left(&self) {
        self.until(|tracker| tracker.total() == 0).await;
    }

    async fn until(&self, done: impl Fn(&Self) -> bool) {
        loop {
            let emptied = self.0.emptied.notified();
            let mut emptied = std::pin::pin!(emptied);
            emptied.as_mut().enable();
            if done(self) {
                return;
            }
            emptied.await;
        }
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        let counts = &self.tracker.0;
        if counts.by_kind[self.kind.index()].fetch_sub(1, Ordering::AcqRel) == 1 {
            counts.emptied.notify_waiters();
        }
    }
}

/// One kind of the process's work, for the part that does it. `Default`: a tracker of its own
/// (a store or forward built alone, in tests).
#[derive(Clone)]
pub struct Tracked {
    tracker: WorkTracker,
    kind: Work,
}

impl Tracked {
    /// A tracker of its own, counting `kind`.
    pub fn alone(kind: Work) -> Self {
        WorkTracker::default().of(kind)
    }

    /// Counts one piece of this kind until the returned value is dropped.
    pub fn start(&self) -> Working {
        self.tracker.start(self.kind)
    }

    /// How many pieces of this kind are out.
    pub fn count(&self) -> usize {
        self.tracker.count(self.kind)
    }

    /// The same process's tracker, for another kind of work.
    pub fn tracker(&self) -> &WorkTracker {
        &self.tracker
    }

    /// Resolves once nothing of this kind is out.
    pub async fn none_left(&self) {
        let kind = self.kind;
        self.tracker.until(|tracker| tracker.count(kind) == 0).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn none_left_waits_for_every_kind_and_counts_each_apart() {
        let tracker = WorkTracker::default();
        let forward = tracker.start(Work::Forward);
        let statement = tracker.of(Work::Statement).start();
        let outcome = tracker.start(Work::Outcome);
        assert_eq!(
            (
                tracker.count(Work::Forward),
                tracker.count(Work::Statement),
                tracker.total()
            ),
            (1, 1, 3)
        );
        let waiting = tokio::spawn({
            let tracker = tracker.clone();
            async move { tracker.none_left().await }
        });
        let statements_done = tokio::spawn({
            let statements = tracker.of(Work::Statement);
            async move { statements.none_left().await }
        });
        drop(statement);
        tokio::time::timeout(Duration::from_millis(1), statements_done)
            .await
            .expect("no statement is out")
            .unwrap();
        drop(forward);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "an outcome is still out");
        drop(outcome);
        tokio::time::timeout(Duration::from_millis(1), waiting)
            .await
            .expect("none left")
            .unwrap();
        assert_eq!(tracker.total(), 0);
    }
}
