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
//! cache's bookkeeping (issue 13's profiles: `moka` was 2–3% of the proxy's CPU on the 409
//! path). Memory is bounded by `capacity` entries; a full shard makes room by dropping an
//! arbitrary entry, which can only cost that account a round trip. A refused account stays
//! cached as long as its worker keeps being refused: each database refusal puts it back.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard};

use crate::token::{AccountId, FencingToken};

const SHARDS: usize = 64;

pub(super) struct MarkCache {
    shards: Box<[Mutex<HashMap<AccountId, i64>>]>,
    hasher: RandomState,
    per_shard: usize,
}

impl MarkCache {
    /// A cache of at most `capacity` accounts (rounded up to a multiple of the shards).
    pub(super) fn new(capacity: u64) -> Self {
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            per_shard: capacity.div_ceil(SHARDS),
        }
    }

    fn shard(&self, account: &AccountId) -> MutexGuard<'_, HashMap<AccountId, i64>> {
        let index = (self.hasher.hash_one(account) as usize) % SHARDS;
        // An update is one integer store or one insert: a panic cannot leave an entry above
        // what was seen, so poisoning is ignored.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// True when `token` is below a mark already known for `account`.
    pub(super) fn is_definitely_stale(&self, account: &AccountId, token: FencingToken) -> bool {
        self.shard(account)
            .get(account)
            .is_some_and(|mark| token.get() < *mark)
    }

    /// Records that the mark for `account` is at least `lower_bound`. Never lowers an entry.
    pub(super) fn raise(&self, account: &AccountId, lower_bound: i64) {
        let mut shard = self.shard(account);
        if let Some(known) = shard.get_mut(account) {
            *known = (*known).max(lower_bound);
            return;
        }
        if shard.len() >= self.per_shard {
            let Some(victim) = shard.keys().next().cloned() else {
                return; // a capacity of nothing
            };
            shard.remove(&victim);
        }
        shard.insert(account.clone(), lower_bound);
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
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
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
