//! The lock API's per-identity bound on requests in flight.
//!
//! The rate limit ([`super::rate`]) bounds how often an identity asks, not how many of its
//! requests are open at once, and an acquire with `wait_ms` stays open for up to
//! `lock.max_wait_ms`. Without this bound one worker, well within its rate, could fill the
//! listener's `max_in_flight` with waits and leave every other worker's renew a 503 until
//! its lease ran out: a fleet-wide outage from one credential. With it, an identity's excess
//! requests get 429 and the rest of the listener stays free for others.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Requests in flight by identity name. Entries go when their count returns to zero, so the
/// map holds only identities with open requests.
#[derive(Debug)]
pub struct InFlightByIdentity {
    max: usize,
    open: Mutex<HashMap<String, usize>>,
}

/// One request counted in; counted out when dropped.
#[derive(Debug)]
pub struct InFlightGuard {
    limiter: Arc<InFlightByIdentity>,
    identity: String,
}

impl InFlightByIdentity {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            open: Mutex::new(HashMap::new()),
        })
    }

    /// The most requests one identity may have open.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Counts one request of `identity` in, or `None` when it already has `max` open.
    pub fn enter(self: &Arc<Self>, identity: &str) -> Option<InFlightGuard> {
        let mut open = self.open.lock().expect("not poisoned");
        let count = open.entry(identity.to_string()).or_insert(0);
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(InFlightGuard {
            limiter: self.clone(),
            identity: identity.to_string(),
        })
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut open = self.limiter.open.lock().expect("not poisoned");
        if let Some(count) = open.get_mut(&self.identity) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.identity);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_gets_at_most_max_and_its_slots_come_back() {
        let limiter = InFlightByIdentity::new(2);
        let a1 = limiter.enter("a").unwrap();
        let _a2 = limiter.enter("a").unwrap();
        assert!(
            limiter.enter("a").is_none(),
            "a third request of a is refused"
        );
        let _b = limiter.enter("b").expect("b has slots of its own");
        drop(a1);
        assert!(
            limiter.enter("a").is_some(),
            "a finished request gives its slot back"
        );
        drop(_b);
        assert!(!limiter.open.lock().unwrap().contains_key("b"));
    }
}
