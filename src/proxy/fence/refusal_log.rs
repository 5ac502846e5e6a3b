//! How many refusals of stale tokens are written to the log.
//!
//! Every refusal is counted in `lock_fenced_out_total`, which is what operators page on. The
//! log line says which account and token, which is what they read next. A worker stuck on a
//! superseded grant can send thousands of requests a second, though, and a line for each one
//! costs more CPU than refusing it (the 409 path does no database work) and floods the log.
//! So at most `per_second` lines are written in each second; the next line written says how
//! many were left out since the last one.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

/// Lines per second, and the count of refusals not logged.
pub(super) struct RefusalLog {
    per_second: u64,
    started: Instant,
    /// The current second since `started` (high 40 bits) and the lines written in it (low 24).
    window: AtomicU64,
    /// Refusals not logged since the last line.
    left_out: AtomicU64,
}

const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

impl RefusalLog {
    pub(super) fn new(per_second: u64) -> Self {
        Self {
            per_second: per_second.min(COUNT_MASK),
            started: Instant::now(),
            window: AtomicU64::new(0),
            left_out: AtomicU64::new(0),
        }
    }

    /// Whether a refusal happening now may be logged: `Some(n)` with the refusals left out
    /// since the last line, or `None` (and it is counted as left out).
    pub(super) fn admit(&self) -> Option<u64> {
        self.admit_at(self.started.elapsed().as_secs())
    }

    fn admit_at(&self, second: u64) -> Option<u64> {
        let mut current = self.window.load(Ordering::Relaxed);
        loop {
            let (window, count) = (current >> COUNT_BITS, current & COUNT_MASK);
            let next = if window == second {
                if count >= self.per_second {
                    self.left_out.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                current + 1
            } else {
                (second << COUNT_BITS) | 1
            };
            match self.window.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.left_out.swap(0, Ordering::Relaxed)),
                Err(seen) => current = seen,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_at_most_the_budget_per_second_and_says_what_it_left_out() {
        let log = RefusalLog::new(2);
        assert_eq!(log.admit_at(0), Some(0));
        assert_eq!(log.admit_at(0), Some(0));
        assert_eq!(log.admit_at(0), None);
        assert_eq!(log.admit_at(0), None);
        assert_eq!(
            log.admit_at(1),
            Some(2),
            "the next line counts the two left out"
        );
        assert_eq!(log.admit_at(1), Some(0));
        assert_eq!(log.admit_at(1), None);
        assert_eq!(log.admit_at(5), Some(1));
    }

    #[test]
    fn the_first_refusal_is_always_logged() {
        let log = RefusalLog::new(1);
        assert_eq!(log.admit(), Some(0));
    }
}
