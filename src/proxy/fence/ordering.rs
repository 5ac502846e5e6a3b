//! Per-account forwarding order inside one proxy process.
//!
//! The compare-and-set in PostgreSQL decides *whether* a token may pass; it does not decide
//! *when* the passing request reaches the rail. Between a request's commit and the moment the
//! rail receives it there is a window in which a request for a higher token, committed later,
//! could overtake it. This module closes that window for one proxy:
//!
//! **Guarantee.** For one account, within one proxy process:
//! 1. once a forward for token `t` has *started*, no forward for a lower token starts
//!    afterwards (the lower request gets 409 even if its own compare-and-set had succeeded);
//! 2. a forward for a higher token does not start until every in-flight forward for a lower
//!    token has *ended* — the rail's response headers arrived, or the forward failed or was
//!    abandoned (502, 504, client gone);
//! 3. requests with the *same* token (one grant sending several payments) go concurrently.
//!
//! So the rail *receives* tokens in non-decreasing order as long as lower forwards end with
//! the rail's answer. After a 504 or a dropped connection the lower request may still be in
//! the network or queued at the rail when the higher one is sent, and the rail may see them
//! in either order; only (1) holds then. Both were accepted tokens, and idempotency keys are
//! what make such a retry-after-timeout safe.
//!
//! How: a request takes a [`Ticket`] *before* its compare-and-set and calls
//! [`Ticket::admit`] after it succeeded. The ticket keeps the account's slot alive, so a
//! request whose compare-and-set committed before a higher one's always finds the higher
//! token recorded there and is refused (it is stale now: the mark has passed it). A request
//! that entered after the slot was dropped started its compare-and-set after every earlier
//! admission had committed, so PostgreSQL itself refuses it if it is lower. Slots exist only
//! while requests for the account are in flight: memory is bounded by concurrency, not by the
//! number of accounts.
//!
//! Across several proxy processes the compare-and-set still refuses every token below the
//! mark, and the arrival at the rail of two *accepted* requests from two processes is ordered
//! through the mark row instead of memory (`store::handover`): a forward another process may
//! still have on its way holds this one back until it can no longer arrive.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::token::{AccountId, FencingToken};

const SHARDS: usize = 64;

/// The per-account admission gates of one proxy.
pub(super) struct ForwardOrder {
    shards: Box<[Mutex<HashMap<AccountId, Slot>>]>,
    hasher: RandomState,
}

struct Slot {
    /// Tickets alive for this account (waiting, admitted or about to be refused).
    tickets: usize,
    /// Highest token admitted or asking for admission; every lower token is stale.
    highest: i64,
    /// The token whose forwards are in flight, and how many there are.
    epoch: i64,
    in_flight: usize,
    notify: Arc<Notify>,
}

/// A request's place in its account's order. Dropping it ends the forward (or the wait).
pub(super) struct Ticket {
    order: Arc<ForwardOrder>,
    /// The account's shard, found once when the ticket is taken.
    shard: usize,
    account: AccountId,
    notify: Arc<Notify>,
    admitted: bool,
}

/// A higher token was admitted for the account after this request's compare-and-set: it is
/// stale now and must not be forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Superseded;

impl ForwardOrder {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
        })
    }

    fn shard_of(&self, account: &AccountId) -> usize {
        (self.hasher.hash_one(account) as usize) % SHARDS
    }

    fn shard(&self, index: usize) -> MutexGuard<'_, HashMap<AccountId, Slot>> {
        // A panic while holding a shard cannot leave a slot half-updated in a way that admits
        // a lower token (every update is a few integer assignments), so poisoning is ignored.
        self.shards[index].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a ticket for `account`. Call before the compare-and-set.
    pub(super) fn enter(self: &Arc<Self>, account: &AccountId) -> Ticket {
        let index = self.shard_of(account);
        let mut shard = self.shard(index);
        let slot = shard.entry(account.clone()).or_insert_with(|| Slot {
            tickets: 0,
            highest: 0,
            epoch: 0,
            in_flight: 0,
            notify: Arc::new(Notify::new()),
        });
        slot.tickets += 1;
        let notify = slot.notify.clone();
        Ticket {
            order: self.clone(),
            shard: index,
            account: account.clone(),
            notify,
            admitted: false,
        }
    }

    /// Accounts with a live ticket (for tests: slots must not leak).
    #[cfg(test)]
    pub(super) fn live_accounts(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}

impl Ticket {
    /// Waits for this request's turn to be forwarded with `token`, whose compare-and-set has
    /// committed. Refuses when a higher token got there first.
    pub(super) async fn admit(&mut self, token: FencingToken) -> Result<(), Superseded> {
        assert!(!self.admitted, "a ticket is admitted once");
        let token = token.get();
        let notify = self.notify.clone();
        loop {
            let mut woken = pin!(notify.notified());
            {
                let mut shard = self.order.shard(self.shard);
                let slot = shard
                    .get_mut(&self.account)
                    .expect("a live ticket keeps its slot");
                if token > slot.highest {
                    slot.highest = token;
                    // Lower tokens waiting for their turn are stale now; let them find out.
                    slot.notify.notify_waiters();
                }
                if token < slot.highest {
                    return Err(Superseded);
                }
                if token == slot.epoch || slot.in_flight == 0 {
                    slot.epoch = token;
                    slot.in_flight += 1;
                    self.admitted = true;
                    return Ok(());
                }
                // Forwards for a lower token are still on their way to the rail. Register for
                // the wake-up before the lock is released so that none is missed.
                woken.as_mut().enable();
            }
            woken.await;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut shard = self.order.shard(self.shard);
        let Some(slot) = shard.get_mut(&self.account) else {
            return;
        };
        slot.tickets -= 1;
        if self.admitted {
            slot.in_flight -= 1;
            if slot.in_flight == 0 {
                slot.notify.notify_waiters();
            }
        }
        if slot.tickets == 0 {
            shard.remove(&self.account);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn acct(s: &str) -> AccountId {
        AccountId::parse(s, 64).unwrap()
    }
    fn tok(v: i64) -> FencingToken {
        FencingToken::new(v).unwrap()
    }

    #[tokio::test]
    async fn same_token_forwards_run_together() {
        let order = ForwardOrder::new();
        let mut a = order.enter(&acct("a"));
        let mut b = order.enter(&acct("a"));
        a.admit(tok(5)).await.unwrap();
        b.admit(tok(5)).await.unwrap();
        drop((a, b));
        assert_eq!(order.live_accounts(), 0);
    }

    #[tokio::test]
    async fn lower_token_after_higher_admission_is_superseded() {
        let order = ForwardOrder::new();
        let mut low = order.enter(&acct("a"));
        let mut high = order.enter(&acct("a"));
        high.admit(tok(57)).await.unwrap();
        assert_eq!(low.admit(tok(42)).await, Err(Superseded));
        drop((low, high));
        assert_eq!(order.live_accounts(), 0);
    }

    #[tokio::test]
    async fn higher_token_waits_for_lower_forwards_to_finish() {
        let order = ForwardOrder::new();
        let mut low = order.enter(&acct("a"));
        low.admit(tok(42)).await.unwrap();
        let mut high = order.enter(&acct("a"));
        let waiter = tokio::spawn(async move {
            high.admit(tok(57)).await.unwrap();
            high
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "57 must wait while 42 is in flight");
        drop(low);
        let high = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        drop(high);
        assert_eq!(order.live_accounts(), 0);
    }

    #[tokio::test]
    async fn waiting_lower_token_is_refused_when_a_higher_one_arrives() {
        let order = ForwardOrder::new();
        let mut first = order.enter(&acct("a"));
        first.admit(tok(10)).await.unwrap();
        let mut mid = order.enter(&acct("a"));
        let mid_wait = tokio::spawn(async move { mid.admit(tok(20)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut top = order.enter(&acct("a"));
        let top_wait = tokio::spawn(async move {
            top.admit(tok(30)).await.unwrap();
            top
        });
        let mid_result = tokio::time::timeout(Duration::from_secs(5), mid_wait)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            mid_result,
            Err(Superseded),
            "20 is stale once 30 has committed"
        );
        drop(first);
        let top = tokio::time::timeout(Duration::from_secs(5), top_wait)
            .await
            .unwrap()
            .unwrap();
        drop(top);
        assert_eq!(order.live_accounts(), 0);
    }

    #[tokio::test]
    async fn accounts_are_independent() {
        let order = ForwardOrder::new();
        let mut a = order.enter(&acct("a"));
        a.admit(tok(100)).await.unwrap();
        let mut b = order.enter(&acct("b"));
        b.admit(tok(1)).await.unwrap();
        assert_eq!(order.live_accounts(), 2);
    }

    #[tokio::test]
    async fn random_interleavings_admit_in_non_decreasing_order() {
        let order = ForwardOrder::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..200u64 {
            let order = order.clone();
            let log = log.clone();
            let token = 1 + (RandomState::new().hash_one(i) % 20) as i64;
            tasks.push(tokio::spawn(async move {
                let mut ticket = order.enter(&acct("hot"));
                tokio::task::yield_now().await;
                if ticket.admit(tok(token)).await.is_ok() {
                    log.lock().unwrap().push(token);
                    tokio::task::yield_now().await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let log = log.lock().unwrap();
        assert!(!log.is_empty());
        assert!(log.windows(2).all(|w| w[0] <= w[1]), "{log:?}");
        assert_eq!(order.live_accounts(), 0);
    }
}
