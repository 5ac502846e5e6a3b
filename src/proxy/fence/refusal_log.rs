//! How many refusals from the mark cache are written to the log.
//!
//! Every refusal is counted in `lock_fenced_out_total`, which is what operators page on. The
//! log line says which account and token, which is what they read next. A refusal decided by
//! the database is always logged (there is at most one per compare-and-set). A worker stuck on
//! a superseded grant then repeats its requests against the cached mark, thousands a second,
//! and a line for each costs more CPU than refusing it and floods the log. So a cache refusal
//! is logged at most once a second *per account*: the first refusal of every account is
//! always written, whatever another account's worker is doing, and the next line for an
//! account says how many of its refusals were left out since its last one.
//!
//! Memory is bounded: accounts not refused in the current second are dropped once
//! `max_accounts` are remembered; should more distinct accounts than that be refused within
//! one second, the rest are left out of the log (and still counted in the metric).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;

use tokio::time::Instant;

use crate::token::AccountId;

const SHARDS: usize = 16;

/// Per account: the second of its last line, and its refusals left out since.
type Shard = HashMap<AccountId, (u64, u64)>;

pub(super) struct RefusalLog {
    started: Instant,
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    max_per_shard: usize,
}

impl RefusalLog {
    pub(super) fn new(max_accounts: usize) -> Self {
        Self {
            started: Instant::now(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            max_per_shard: (max_accounts / SHARDS).max(1),
        }
    }

    /// Whether a cache refusal for `account` happening now may be logged: `Some(n)` with the
    /// account's refusals left out since its last line, or `None`.
    pub(super) fn admit(&self, account: &AccountId) -> Option<u64> {
        self.admit_at(account, self.started.elapsed().as_secs())
    }

    fn admit_at(&self, account: &AccountId, second: u64) -> Option<u64> {
        let index = (self.hasher.hash_one(account) as usize) % SHARDS;
        // A panic cannot leave an entry half-written (two integers), so poisoning is ignored.
        let mut shard = self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((last, left_out)) = shard.get_mut(account) {
            if *last == second {
                *left_out += 1;
                return None;
            }
            *last = second;
            return Some(std::mem::take(left_out));
        }
        if shard.len() >= self.max_per_shard {
            shard.retain(|_, (last, _)| *last == second);
            if shard.len() >= self.max_per_shard {
                return None;
            }
        }
        shard.insert(account.clone(), (second, 0));
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acct(s: &str) -> AccountId {
        AccountId::parse(s, 64).unwrap()
    }

    #[test]
    fn one_line_per_account_per_second_and_the_next_counts_what_was_left_out() {
        let log = RefusalLog::new(1000);
        let a = acct("a");
        assert_eq!(log.admit_at(&a, 0), Some(0));
        assert_eq!(log.admit_at(&a, 0), None);
        assert_eq!(log.admit_at(&a, 0), None);
        assert_eq!(log.admit_at(&a, 1), Some(2));
        assert_eq!(log.admit_at(&a, 1), None);
        assert_eq!(log.admit_at(&a, 7), Some(1));
    }

    #[test]
    fn a_flood_on_one_account_never_hides_another_accounts_first_refusal() {
        let log = RefusalLog::new(1000);
        let (a, b) = (acct("a"), acct("b"));
        assert_eq!(log.admit_at(&a, 0), Some(0));
        for _ in 0..10_000 {
            assert_eq!(log.admit_at(&a, 0), None);
        }
        assert_eq!(log.admit_at(&b, 0), Some(0));
    }

    #[test]
    fn memory_stays_bounded_and_old_accounts_make_room() {
        let log = RefusalLog::new(SHARDS); // one account per shard
        let accounts: Vec<AccountId> = (0..200).map(|i| acct(&format!("acct-{i}"))).collect();
        let logged_now = accounts
            .iter()
            .filter(|a| log.admit_at(a, 0).is_some())
            .count();
        assert!(logged_now <= SHARDS, "{logged_now}");
        let total: usize = log.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(total <= SHARDS, "{total}");
        // A second later, the old entries make room again.
        assert!(accounts.iter().any(|a| log.admit_at(a, 1).is_some()));
    }
}
