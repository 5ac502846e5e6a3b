//! First-come, first-served waiting for keys, within one railguard.
//!
//! Each key with waiters has a queue. Only the waiter at the head of the queue tries to acquire;
//! the others wait for it to leave (with a grant, or empty-handed when its `wait` ran out).
//! A waiter is woken when the key is released (by this process directly, or by another through
//! the backend's notification: LISTEN/NOTIFY or a watch), when the holder's lease should have
//! run out, and at a fallback interval in case a notification was lost.
//!
//! The total number of waiters is bounded; past the bound a new waiter is refused at once
//! rather than queued behind an unbounded backlog.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{LockError, LockKey};

pub struct WaitQueues {
    state: Mutex<State>,
    max_waiters: usize,
}

#[derive(Default)]
struct State {
    next_id: u64,
    waiting: usize,
    keys: HashMap<LockKey, VecDeque<Waiter>>,
}

/// One place in a key's queue, with its own wake-up: only the head is ever woken, so a
/// release or a departure costs one wake-up, not one per waiter.
struct Waiter {
    id: u64,
    notify: Arc<Notify>,
}

/// A waiter's place in its key's queue. Dropping it leaves the queue and wakes the next.
pub struct Place {
    queues: Arc<WaitQueues>,
    key: LockKey,
    id: u64,
    notify: Arc<Notify>,
}

impl WaitQueues {
    pub fn new(max_waiters: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            max_waiters,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the back of `key`'s queue.
    pub fn join(self: &Arc<Self>, key: &LockKey) -> Result<Place, LockError> {
        let mut state = self.lock();
        if state.waiting >= self.max_waiters {
            return Err(LockError::TooManyWaiters(state.waiting));
        }
        state.next_id += 1;
        state.waiting += 1;
        let id = state.next_id;
        let notify = Arc::new(Notify::new());
        state
            .keys
            .entry(key.clone())
            .or_default()
            .push_back(Waiter {
                id,
                notify: notify.clone(),
            });
        Ok(Place {
            queues: self.clone(),
            key: key.clone(),
            id,
            notify,
        })
    }

    /// Wakes the head of `key`'s queue (the key was released).
    pub fn wake(&self, key: &str) {
        let Ok(key) = LockKey::parse(key) else { return };
        if let Some(head) = self.lock().keys.get(&key).and_then(|q| q.front()) {
            // `notify_one` keeps a permit if the head is not waiting yet: nothing is lost.
            head.notify.notify_one();
        }
    }

    /// Wakes the head of every queue (notifications may have been missed).
    pub fn wake_all(&self) {
        for head in self.lock().keys.values().filter_map(|q| q.front()) {
            head.notify.notify_one();
        }
    }

    /// Waiters in this process, for the gauge.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }
}

impl Place {
    fn is_head(&self) -> bool {
        let state = self.queues.lock();
        state
            .keys
            .get(&self.key)
            .and_then(|q| q.front())
            .map(|w| w.id)
            == Some(self.id)
    }

    /// Waits until this place is at the head of its queue, or `deadline`. True when at the head.
    pub async fn reach_head(&self, deadline: Instant) -> bool {
        loop {
            if self.is_head() {
                return true;
            }
            if tokio::time::timeout_at(deadline, self.notify.notified())
                .await
                .is_err()
            {
                return self.is_head();
            }
        }
    }

    /// This place's wake-up: a release of the key, or the queue moving. A wake-up that comes
    /// while nobody waits is kept (as a permit) for the next `notified()`.
    pub fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut state = self.queues.lock();
        state.waiting -= 1;
        if let Some(queue) = state.keys.get_mut(&self.key) {
            let was_head = queue.front().is_some_and(|w| w.id == self.id);
            queue.retain(|w| w.id != self.id);
            match queue.front() {
                Some(next) if was_head => next.notify.notify_one(),
                Some(_) => {}
                None => {
                    state.keys.remove(&self.key);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn queue_is_first_come_first_served_and_bounded() {
        let queues = WaitQueues::new(2);
        let key = LockKey::parse("k").unwrap();
        let first = queues.join(&key).unwrap();
        let second = queues.join(&key).unwrap();
        assert!(matches!(
            queues.join(&key),
            Err(LockError::TooManyWaiters(2))
        ));
        let soon = Instant::now() + Duration::from_millis(30);
        assert!(first.reach_head(soon).await);
        assert!(!second.reach_head(soon).await);
        let waiter = tokio::spawn(async move {
            second
                .reach_head(Instant::now() + Duration::from_secs(5))
                .await
        });
        drop(first);
        assert!(waiter.await.unwrap());
        assert_eq!(queues.waiting(), 0);
    }
}
