//! What every lock backend shares: blocking acquire with first-come, first-served waiters
//! (FR-06), limits on ttl and wait, metrics and spans.
//!
//! The backend makes single atomic attempts; this module decides when to make them. A waiter
//! at the head of its key's queue tries, and if the key is held it sleeps until the key is
//! released (a notification), the holder's lease should have run out (the backend's hint), or
//! a fallback interval passes — whichever is first — and tries again, until its `wait` is over.
//! All attempts of one acquire share one backend session ([`LockBackend::Session`]: for etcd,
//! the one lease its attempts put with), so a long wait costs the backend nothing per retry
//! beyond the attempt itself, and whatever the session holds is given back when the acquire
//! ends without a grant.

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};
use tokio::time::Instant;
use tracing::Instrument;

use super::guard::SourceGuard;
use super::wait::WaitQueues;
use super::{
    Attempt, Grant, Inspection, LeaseSecret, LockBackend, LockError, LockKey, Released, Renewed,
};
use crate::token::FencingToken;

/// Lock metrics for one backend. Never labelled by key.
pub struct LockMetrics {
    pub grants: IntCounter,
    pub renewals: IntCounter,
    pub releases: IntCounter,
    pub expiries: IntCounter,
    pub takeovers: IntCounter,
    pub lost: IntCounter,
    pub rejected_secrets: IntCounter,
    pub revoked_undelivered: IntCounter,
    pub wait_seconds: Histogram,
    pub waiters: IntGauge,
}

/// Limits on what a caller may ask for.
#[derive(Debug, Clone)]
pub struct LockLimits {
    pub min_ttl: Duration,
    pub max_ttl: Duration,
    pub max_wait: Duration,
    pub max_waiters: usize,
    /// Longest sleep between attempts while waiting, in case a release notification is lost.
    pub poll_interval: Duration,
}

impl Default for LockLimits {
    fn default() -> Self {
        Self {
            min_ttl: Duration::from_millis(10),
            max_ttl: Duration::from_secs(3600),
            max_wait: Duration::from_secs(300),
            max_waiters: 10_000,
            poll_interval: Duration::from_millis(500),
        }
    }
}

/// Pause between attempts while the backend is unavailable.
const UNAVAILABLE_RETRY: Duration = Duration::from_millis(100);

pub struct LockService<B> {
    backend: B,
    queues: Arc<WaitQueues>,
    metrics: Arc<LockMetrics>,
    limits: LockLimits,
    /// Refuses grants while the token source is not known to be above every mark.
    guard: Option<Arc<SourceGuard>>,
}

impl<B: LockBackend> LockService<B> {
    pub fn new(backend: B, metrics: Arc<LockMetrics>, limits: LockLimits) -> Self {
        Self {
            backend,
            queues: WaitQueues::new(limits.max_waiters),
            metrics,
            limits,
            guard: None,
        }
    }

    /// Grants only while `guard` says the token source is ahead of every fencing mark, and
    /// ends any grant whose token shows it is not (see [`super::guard`]).
    pub fn with_guard(mut self, guard: Arc<SourceGuard>) -> Self {
        self.guard = Some(guard);
        self
    }

    pub fn limits(&self) -> &LockLimits {
        &self.limits
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// The waiter queues, for the backend's release notifications to wake.
    pub fn queues(&self) -> Arc<WaitQueues> {
        self.queues.clone()
    }

    /// FR-01: a grant, or `Held` when the key stayed held for all of `wait`. With the grant
    /// comes how long after the call the winning attempt started — a lower bound on when the
    /// lease began, for clients that track it on their own clock.
    pub async fn acquire(
        &self,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<(Grant, Duration), LockError> {
        let span = tracing::info_span!("lock.acquire", lock.key = %key, lock.token = tracing::field::Empty,
            lock.backend = self.backend.name(), holder);
        async {
            let started = Instant::now();
            let mark_before = match &self.guard {
                Some(guard) => Some(guard.permit().map_err(LockError::SourceBehind)?),
                None => None,
            };
            let mut result = self.acquire_in_turn(key, holder, ttl, started + wait).await;
            if let (Ok((grant, _)), Some(guard), Some(mark)) = (&result, &self.guard, mark_before) {
                // The guard may have closed while this acquire waited, or this very grant
                // shows the source went back: either way the grant is ended, never handed out.
                let verdict = match guard.permit() {
                    Ok(_) => guard.admit(key.as_str(), grant.token.get(), mark).await,
                    Err(why) => Err(why),
                };
                if let Err(why) = verdict {
                    tracing::error!(
                        lock.token = grant.token.get(),
                        "ending a grant made while the token source is behind the fencing marks"
                    );
                    if let Err(e) = self
                        .backend
                        .release(key, grant.token, &grant.secret, None)
                        .await
                    {
                        tracing::error!(error = %e, lock.token = grant.token.get(),
                            "could not end the grant; it runs out with its lease, unused");
                    }
                    result = Err(LockError::SourceBehind(why));
                }
            }
            self.metrics
                .wait_seconds
                .observe(started.elapsed().as_secs_f64());
            if let Ok((grant, _)) = &result {
                tracing::Span::current().record("lock.token", grant.token.get());
                self.metrics.grants.inc();
                if grant.took_over {
                    self.metrics.takeovers.inc();
                    tracing::info!(
                        lock.token = grant.token.get(),
                        "took the key over from an expired grant"
                    );
                }
            }
            result
        }
        .instrument(span)
        .await
    }

    async fn acquire_in_turn(
        &self,
        key: &LockKey,
        holder: &str,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<(Grant, Duration), LockError> {
        let called = Instant::now();
        let place = self.queues.join(key)?;
        self.metrics.waiters.set(self.queues.waiting() as i64);
        let result = async {
            if !place.reach_head(deadline).await {
                return Err(LockError::Held);
            }
            // One session for all of this acquire's attempts (for etcd: one lease, kept alive
            // while waiting). However this block ends without a grant — wait over, error, or
            // this future dropped with its caller — dropping the session gives back what it
            // holds; a grant has already taken it over.
            let mut session = self.backend.session();
            loop {
                let mut woken = pin!(place.notify().notified());
                woken.as_mut().enable();
                let attempt_started = Instant::now();
                let attempt = self
                    .backend
                    .try_acquire(&mut session, key, holder, ttl)
                    .await;
                let retry_in = match attempt {
                    Ok(Attempt::Granted(grant)) => return Ok((grant, attempt_started - called)),
                    Ok(Attempt::Held { retry_in }) => retry_in,
                    // A waiter rides out a short backend outage (a restart, an election) for
                    // as long as its wait lasts; a caller that would not wait hears at once.
                    Err(LockError::Unavailable(why)) => {
                        if Instant::now() + UNAVAILABLE_RETRY >= deadline {
                            return Err(LockError::Unavailable(why));
                        }
                        tokio::time::sleep(UNAVAILABLE_RETRY).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let now = Instant::now();
                if now >= deadline {
                    return Err(LockError::Held);
                }
                // Wake a little after the holder's lease should have run out; the backend's clock
                // decides, so being early or late costs one attempt, nothing more.
                let nap = retry_in
                    .map(|d| d + Duration::from_millis(2))
                    .unwrap_or(self.limits.poll_interval)
                    .min(self.limits.poll_interval);
                let _ = tokio::time::timeout_at((now + nap).min(deadline), woken).await;
            }
        }
        .await;
        drop(place);
        self.metrics.waiters.set(self.queues.waiting() as i64);
        result
    }

    /// FR-03: extends the lease; the token is the caller's and never changes. Authorised by
    /// the grant's secret, never by the token (C2 §2.3).
    pub async fn renew(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Renewed, LockError> {
        let span = tracing::info_span!("lock.renew", lock.key = %key, lock.token = token.get(), lock.backend = self.backend.name());
        let result = self
            .backend
            .renew(key, token, secret, caller)
            .instrument(span)
            .await;
        match &result {
            Ok(_) => self.metrics.renewals.inc(),
            Err(LockError::Lost) => self.metrics.lost.inc(),
            Err(_) => {}
        }
        result
    }

    /// FR-04: ends the grant if it still holds the key, and wakes the key's waiters here.
    pub async fn release(
        &self,
        key: &LockKey,
        token: FencingToken,
        secret: &LeaseSecret,
        caller: Option<&str>,
    ) -> Result<Released, LockError> {
        let span = tracing::info_span!("lock.release", lock.key = %key, lock.token = token.get(), lock.backend = self.backend.name());
        let result = self
            .backend
            .release(key, token, secret, caller)
            .instrument(span)
            .await;
        match &result {
            Ok(_) => {
                self.metrics.releases.inc();
                self.queues.wake(key.as_str());
            }
            Err(LockError::Lost) => self.metrics.lost.inc(),
            Err(_) => {}
        }
        result
    }

    /// FR-07: diagnosis only; never a token.
    pub async fn inspect(&self, key: &LockKey) -> Result<Inspection, LockError> {
        self.backend.inspect(key).await
    }
}
