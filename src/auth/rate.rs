//! The lock API's per-identity rate limit: a token bucket per identity, a second's worth deep.
//!
//! It protects the lock backend (and the token source behind it) from one misbehaving worker;
//! it is not a fairness scheduler. An identity's bucket lives as long as the process; the set
//! of identities is the credentials file's, so it is bounded.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Buckets by identity name.
pub struct RateLimiter {
    default_per_s: u32,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    /// Identities without a limit of their own get `default_per_s`.
    pub fn new(default_per_s: u32) -> Self {
        Self {
            default_per_s: default_per_s.max(1),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from `identity`'s bucket (`per_s` if it has its own limit): whether
    /// the request may go on.
    pub fn admit(&self, identity: &str, per_s: Option<u32>) -> bool {
        let rate = f64::from(per_s.unwrap_or(self.default_per_s).max(1));
        let now = Instant::now();
        let mut buckets = self.buckets.lock().expect("not poisoned");
        let bucket = buckets.entry(identity.to_string()).or_insert(Bucket {
            tokens: rate,
            at: now,
        });
        let elapsed = now.duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(rate);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_one_second_passes_then_the_rate_holds() {
        let limiter = RateLimiter::new(10);
        let passed = (0..25).filter(|_| limiter.admit("a", None)).count();
        assert_eq!(passed, 10, "one second's worth at once");
        assert!(
            limiter.admit("b", None),
            "another identity has its own bucket"
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        let passed = (0..25).filter(|_| limiter.admit("a", None)).count();
        assert_eq!(passed, 5, "half a second refills half");
        let own = (0..25).filter(|_| limiter.admit("c", Some(3))).count();
        assert_eq!(own, 3, "an identity's own limit");
    }
}
