//! In-memory lower bounds of accounts' high-water marks: the stale-token fast path.
//!
//! Marks only grow, so any mark this process has seen is a lower bound of the mark in
//! PostgreSQL now. A token below a known lower bound is definitely stale and is refused
//! without a database round trip. The cache is never used to *accept*: every acceptance goes
//! through the compare-and-set. An entry lost to eviction only costs a round trip.
//!
//! The cache belongs to the fencing point, not to writers: nothing reads a token from it to
//! present it anywhere (C2 §2.7), and its values never leave the process.
//!
//! **Why a plain sharded map.** Every request looks here, and a worker stuck on a superseded
//! grant repeats its refused requests as fast as it can, so the look-up is the whole cost of
//! the stale path. A lock on one of 64 shards and one hash look-up cost a fraction of a general
//! cache's bookkeeping (profiled: `moka` was 2–3% of the proxy's CPU on the 409
//! path). Memory is bounded by `capacity` entries (rounded up to a multiple of the shards).
//!
//! **Eviction** only ever costs an account a round trip, but which account matters: the one
//! worth keeping is the stale worker's, refused again and again, while every accepted request
//! caches its own account too. A full shard makes room by a clock sweep over its accounts in
//! the order they were cached: an account the cache refused a request for since the hand last
//! passed gets a second chance, any other is dropped. So a burst of new accounts pushes out the
//! oldest ones that refused nothing first; the stale worker's account goes only when more new
//! accounts than its shard holds arrive between two of its refusals. Each cached account's id
//! is kept twice (the map and the hand).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard};

use crate::token::{AccountId, FencingToken};

const SHARDS: usize = 64;

pub(super) struct MarkCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    per_shard: usize,
}

#[derive(Default)]
struct Shard {
    marks: HashMap<AccountId, Mark>,
    /// The accounts of `marks`, each once, in the order the clock hand meets them.
    hand: VecDeque<AccountId>,
}

struct Mark {
    lower_bound: i64,
    /// A request was refused on this bound since the hand last passed.
    refused: bool,
}

impl Shard {
    /// Drops one account, giving those that refused a request since the hand last passed a
    /// second chance. False if there was none to drop.
    fn evict_one(&mut self) -> bool {
        while let Some(account) = self.hand.pop_front() {
            match self.marks.get_mut(&account) {
                Some(mark) if mark.refused => {
                    mark.refused = false;
                    self.hand.push_back(account);
                }
                Some(_) => {
                    self.marks.remove(&account);
                    return true;
                }
                None => {}
            }
        }
        false
    }
}

impl MarkCache {
    /// A cache of at most `capacity` accounts (rounded up to a multiple of the shards).
    pub(super) fn new(capacity: u64) -> Self {
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            per_shard: capacity.div_ceil(SHARDS),
        }
    }

    fn shard(&self, account: &AccountId) -> MutexGuard<'_, Shard> {
        let index = (self.hasher.hash_one(account) as usize) % SHARDS;
        // No update can leave a bound above what was seen, whatever point a panic stopped it
        // at (at worst an account is in `marks` and not in `hand`: never evicted, still
        // bounded), so poisoning is ignored.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// True when `token` is below a mark already known for `account`.
    pub(super) fn is_definitely_stale(&self, account: &AccountId, token: FencingToken) -> bool {
        let mut shard = self.shard(account);
        match shard.marks.get_mut(account) {
            Some(mark) if token.get() < mark.lower_bound => {
                mark.refused = true;
                true
            }
            _ => false,
        }
    }

    /// Records that the mark for `account` is at least `lower_bound`. Never lowers an entry.
    pub(super) fn raise(&self, account: &AccountId, lower_bound: i64) {
        let mut shard = self.shard(account);
        if let Some(known) = shard.marks.get_mut(account) {
            known.lower_bound = known.lower_bound.max(lower_bound);
            return;
        }
        while shard.marks.len() >= self.per_shard {
            if !shard.evict_one() {
                return; // no room (a capacity of nothing): the account is just not cached
            }
        }
        let mark = Mark {
            lower_bound,
            refused: false,
        };
        shard.marks.insert(account.clone(), mark);
        shard.hand.push_back(account.clone());
    }

    /// Records that the compare-and-set refused `token`: the mark is above it.
    pub(super) fn raise_past(&self, account: &AccountId, token: FencingToken) {
        self.raise(account, token.get().saturating_add(1));
    }

    /// Accounts cached now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).marks.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(name: &str) -> AccountId {
        AccountId::parse(name, 64).unwrap()
    }
    fn t(v: i64) -> FencingToken {
        FencingToken::new(v).unwrap()
    }

    #[test]
    fn only_raises_and_only_rejects_below_the_bound() {
        let cache = MarkCache::new(10);
        let a = account("a");
        assert!(!cache.is_definitely_stale(&a, t(1)));
        cache.raise(&a, 57);
        cache.raise(&a, 42);
        assert!(cache.is_definitely_stale(&a, t(56)));
        assert!(
            !cache.is_definitely_stale(&a, t(57)),
            "equal is the same grant"
        );
        cache.raise_past(&a, t(60));
        assert!(cache.is_definitely_stale(&a, t(60)));
        assert!(!cache.is_definitely_stale(&a, t(61)));
        assert!(!cache.is_definitely_stale(&account("b"), t(1)));
    }

    #[test]
    fn holds_at_most_its_capacity_and_never_a_bound_that_was_not_seen() {
        let capacity = 3 * SHARDS;
        let cache = MarkCache::new(capacity as u64);
        for i in 0..10_000i64 {
            cache.raise(&account(&format!("acct-{i}")), i + 2);
        }
        assert!(cache.len() <= capacity, "{} cached", cache.len());
        assert!(cache.len() >= capacity / 2, "{} cached", cache.len());
        // Whatever survived eviction is exactly what was seen for it.
        for i in 0..10_000i64 {
            let a = account(&format!("acct-{i}"));
            assert!(!cache.is_definitely_stale(&a, t(i + 2)));
        }
        let mut survivors = 0;
        for i in 0..10_000i64 {
            if cache.is_definitely_stale(&account(&format!("acct-{i}")), t(i + 1)) {
                survivors += 1;
            }
        }
        assert_eq!(survivors, cache.len());
    }

    /// The account cached last is not the next to go: a few new accounts after it leave it in
    /// place (a sweep that took whatever came first in a shard's map dropped it almost always).
    #[test]
    fn a_newly_cached_account_outlives_a_burst_smaller_than_the_cache() {
        let capacity = 1_000 * SHARDS;
        let cache = MarkCache::new(capacity as u64);
        for i in 0..200_000i64 {
            cache.raise(&account(&format!("old-{i}")), 2);
        }
        for probe in 0..300 {
            let probe_account = account(&format!("probe-{probe}"));
            cache.raise(&probe_account, 2);
            for i in 0..640 {
                cache.raise(&account(&format!("fresh-{probe}-{i}")), 2);
            }
            assert!(
                cache.is_definitely_stale(&probe_account, t(1)),
                "probe {probe} was evicted by 640 newer accounts in a cache of {capacity}"
            );
        }
    }

    /// A worker stuck on a superseded grant keeps its account cached through any churn of
    /// accepted accounts, as long as it keeps being refused; an account refused nothing goes.
    #[test]
    fn a_repeatedly_refused_account_survives_churn_and_an_idle_one_does_not() {
        let capacity = 10 * SHARDS;
        let cache = MarkCache::new(capacity as u64);
        let (hot, idle) = (account("stale-worker"), account("idle"));
        cache.raise(&hot, 100);
        cache.raise(&idle, 100);
        let mut idle_gone = false;
        for round in 0..50 {
            // An eighth of the cache's worth of new accounts between two of the stale
            // worker's tries.
            for i in 0..capacity / 8 {
                cache.raise(&account(&format!("accepted-{round}-{i}")), 2);
            }
            assert!(
                cache.is_definitely_stale(&hot, t(99)),
                "the stale worker's account was evicted in round {round}"
            );
            idle_gone |= !cache.shard(&idle).marks.contains_key(&idle);
        }
        assert!(idle_gone, "an account that refused nothing stays forever");
    }

    #[test]
    fn concurrent_raises_keep_the_highest() {
        let cache = std::sync::Arc::new(MarkCache::new(1_000));
        let a = account("shared");
        let threads: Vec<_> = (0..4)
            .map(|n| {
                let (cache, a) = (cache.clone(), a.clone());
                std::thread::spawn(move || {
                    for v in (0..5_000).map(|i| i * 4 + n) {
                        cache.raise(&a, v);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert!(cache.is_definitely_stale(&a, t(19_998)));
        assert!(!cache.is_definitely_stale(&a, t(19_999)));
    }
}
