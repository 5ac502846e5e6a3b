//! In-memory lower bounds of accounts' high-water marks: the stale-token fast path.
//!
//! Marks only grow, so any mark this process has seen is a lower bound of the mark in
//! PostgreSQL now. A token below a known lower bound is definitely stale and is refused
//! without a database round trip. The cache is never used to *accept*: every acceptance goes
//! through the compare-and-set. An entry lost to eviction only costs a round trip.
//!
//! The cache belongs to the fencing point, not to writers: nothing reads a token from it to
//! present it anywhere (C2 §2.7), and its values never leave the process.

use moka::sync::Cache;

use crate::token::{AccountId, FencingToken};

pub(super) struct MarkCache {
    marks: Cache<AccountId, i64>,
}

impl MarkCache {
    pub(super) fn new(capacity: u64) -> Self {
        Self {
            marks: Cache::new(capacity),
        }
    }

    /// True when `token` is below a mark already known for `account`.
    pub(super) fn is_definitely_stale(&self, account: &AccountId, token: FencingToken) -> bool {
        self.marks
            .get(account)
            .is_some_and(|mark| token.get() < mark)
    }

    /// Records that the mark for `account` is at least `lower_bound`. Never lowers an entry.
    pub(super) fn raise(&self, account: &AccountId, lower_bound: i64) {
        // The common case — a holder sending another payment under the same token — finds the
        // bound already known; a read is much cheaper than the cache's atomic upsert.
        if self
            .marks
            .get(account)
            .is_some_and(|known| known >= lower_bound)
        {
            return;
        }
        self.marks.entry_by_ref(account).and_upsert_with(|current| {
            current.map_or(lower_bound, |e| (*e.value()).max(lower_bound))
        });
    }

    /// Records that the compare-and-set refused `token`: the mark is above it.
    pub(super) fn raise_past(&self, account: &AccountId, token: FencingToken) {
        self.raise(account, token.get().saturating_add(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_raises_and_only_rejects_below_the_bound() {
        let cache = MarkCache::new(10);
        let a = AccountId::parse("a", 8).unwrap();
        let t = |v| FencingToken::new(v).unwrap();
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
    }
}
