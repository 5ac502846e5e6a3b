//! The lock service's metrics, registered by the lock module itself in the process's registry
//! (so that `crate::metrics` need not know what a lock is). One `backend` label, fixed per
//! process; never a key or a token.

use std::sync::Arc;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::service::LockMetrics;
use crate::metrics::LATENCY_BUCKETS;

impl LockMetrics {
    /// The lock service's metrics for `backend`, registered in `registry`.
    pub fn register(registry: &Registry, backend: &'static str) -> Arc<LockMetrics> {
        let counter = |name: &str, help: &str| {
            let vec =
                IntCounterVec::new(Opts::new(name, help), &["backend"]).expect("valid metric");
            registry
                .register(Box::new(vec.clone()))
                .expect("metric registered once");
            vec.with_label_values(&[backend])
        };
        let grants = counter("lock_grants_total", "Grants made (including takeovers).");
        let renewals = counter("lock_renewals_total", "Leases renewed.");
        let releases = counter("lock_releases_total", "Grants ended by release.");
        let expiries = counter(
            "lock_expiries_total",
            "Grants whose lease ran out, counted when noticed: at a takeover, or when the \
             holder's late renew or release arrives.",
        );
        let takeovers = counter(
            "lock_takeovers_total",
            "Grants that took a key from an expired, unreleased grant.",
        );
        let lost = counter(
            "lock_lost_total",
            "Renewals and releases refused because the grant no longer held the key.",
        );
        let rejected_secrets = counter(
            "lock_rejected_secrets_total",
            "Renewals and releases that named the key's current grant with a lease secret that \
             is not that grant's: a worker probing for another grant, or a bug. They are \
             answered exactly like a grant that ended.",
        );
        let revoked_undelivered = counter(
            "lock_undelivered_grants_revoked_total",
            "Grants made by an acquire whose answer never reached the caller (a timeout, an \
             error, a caller gone) and that were revoked so that they do not hold the key.",
        );
        let wait = HistogramVec::new(
            HistogramOpts::new(
                "lock_acquire_wait_duration_seconds",
                "Time from acquire request to grant or give-up.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["backend"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(wait.clone()))
            .expect("metric registered once");
        let waiters = IntGaugeVec::new(
            Opts::new(
                "lock_waiters",
                "Acquirers waiting for a key in this process.",
            ),
            &["backend"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(waiters.clone()))
            .expect("metric registered once");
        Arc::new(LockMetrics {
            grants,
            renewals,
            releases,
            expiries,
            takeovers,
            lost,
            rejected_secrets,
            revoked_undelivered,
            wait_seconds: wait.with_label_values(&[backend]),
            waiters: waiters.with_label_values(&[backend]),
        })
    }
}
