//! Prometheus metrics (C4 §4.4), owned by one [`Metrics`] value per process and passed to
//! whatever records into them.
//!
//! No metric is labelled by account, key or token: those are unbounded and would turn every
//! new account into a new time series. Outcome and path labels come from fixed enums.
//!
//! Besides railguard's own: `railguard_build_info` (1, labelled with the version), and on
//! Linux the standard process metrics (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, `process_start_time_seconds`, …) read
//! from `/proc`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Why a proxied request ended the way it did: the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Forwarded,
    FencedOut,
    /// A token whose grant was made before the fencing store last went back (`store::epoch`).
    FencedBelowFloor,
    BadRequest,
    /// The token came without a valid proof that it was granted for the account's lock key.
    BadProof,
    BodyTooLarge,
    DatabaseUnavailable,
    UpstreamUnavailable,
    UpstreamTimeout,
    Timeout,
    Internal,
    /// A repeat of an idempotency key: in flight, in doubt, or reused for another request.
    IdempotentRefused,
    /// A repeat of an idempotency key answered from the stored response.
    Replayed,
    /// No or unknown credentials (401).
    Unauthenticated,
    /// An identity that may not pay on the account, or a grant issued to another (403).
    Forbidden,
}

impl Outcome {
    pub const ALL: [Outcome; 15] = [
        Outcome::Forwarded,
        Outcome::FencedOut,
        Outcome::FencedBelowFloor,
        Outcome::BadRequest,
        Outcome::BadProof,
        Outcome::BodyTooLarge,
        Outcome::DatabaseUnavailable,
        Outcome::UpstreamUnavailable,
        Outcome::UpstreamTimeout,
        Outcome::Timeout,
        Outcome::Internal,
        Outcome::IdempotentRefused,
        Outcome::Replayed,
        Outcome::Unauthenticated,
        Outcome::Forbidden,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::FencedOut => "fenced_out",
            Outcome::FencedBelowFloor => "fenced_below_floor",
            Outcome::BadRequest => "bad_request",
            Outcome::BadProof => "bad_proof",
            Outcome::BodyTooLarge => "body_too_large",
            Outcome::DatabaseUnavailable => "database_unavailable",
            Outcome::UpstreamUnavailable => "upstream_unavailable",
            Outcome::UpstreamTimeout => "upstream_timeout",
            Outcome::Timeout => "timeout",
            Outcome::Internal => "internal",
            Outcome::IdempotentRefused => "idempotent_refused",
            Outcome::Replayed => "replayed",
            Outcome::Unauthenticated => "unauthenticated",
            Outcome::Forbidden => "forbidden",
        }
    }
}

/// Where a fence decision was made: the `path` label of the fence-check histogram.
#[derive(Debug, Clone, Copy)]
pub enum FencePath {
    /// Rejected from the in-memory lower bound, without a database round trip.
    Cache = 0,
    /// Decided by the compare-and-set in PostgreSQL.
    Database = 1,
}

impl FencePath {
    fn as_str(self) -> &'static str {
        match self {
            FencePath::Cache => "cache",
            FencePath::Database => "database",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    /// Must be zero: any increase means a lease expired under a live holder. Page on it.
    pub fenced_out: IntCounter,
    /// Stale requests forwarded because fencing is switched off (C5 §5.2).
    pub would_have_fenced: IntCounter,
    pub requests: IntCounterVec,
    /// `requests`' counter of each outcome, in [`Outcome::ALL`]'s order: found once, not by
    /// its label on each request.
    by_outcome: [IntCounter; Outcome::ALL.len()],
    pub fence_check_seconds: HistogramVec,
    /// `fence_check_seconds`' histograms of the cache and of the database.
    fence_check: [Histogram; 2],
    pub upstream_seconds: Histogram,
    pub fencing_enforced: IntGauge,
    /// 0 while `fencing.order_across_processes = false` (`store::handover`).
    pub cross_process_order: IntGauge,
    /// Forwards that waited for another railguard process's forward for their account.
    pub handover_waits: IntCounter,
    /// 0 while `fencing.require_proof = false` lets tokens through without a grant proof.
    pub fencing_proof_required: IntGauge,
    /// Tokens accepted without a grant proof (`fencing.require_proof = false` only).
    pub unproven_tokens: IntCounter,
    /// Idempotency records whose outcome (the rail's response, or "in doubt") could not be
    /// stored at once and waits for the database; and those given up on.
    pub outcomes_pending: IntGauge,
    pub outcomes_lost: IntCounter,
    /// Requests per fence statement (group commit).
    pub fence_batch_size: Histogram,
    /// Idempotency-record completions per statement (group commit).
    pub completion_batch_size: Histogram,
    /// Connections and requests a listener refused or closed to protect itself.
    pub listener_refusals: IntCounterVec,
    /// Reloads of a listener's TLS files.
    pub listener_tls_reloads: IntCounterVec,
    /// Worker threads of the async runtime serving this process (`runtime.worker_threads`).
    pub runtime_worker_threads: IntGauge,
    /// Batched statements running past their hold on a statement slot (`store::batch::slots`).
    pub db_statements_stalled: IntGaugeVec,
}

/// `railguard_db_statements_stalled{statement}`, unregistered: every batcher's count of its
/// statements that no longer hold up the next batch (`store::batch::slots`).
pub fn statements_stalled() -> IntGaugeVec {
    IntGaugeVec::new(
        Opts::new(
            "railguard_db_statements_stalled",
            "Batched statements (statement: fence, completion, look) that have run longer than \
             a tenth of database.timeout_ms and no longer hold up the next batch; they are \
             still waited for. Nonzero for long: a database connection holds a statement \
             without answering.",
        ),
        &["statement"],
    )
    .expect("valid metric")
}

pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let build_info = IntGauge::with_opts(
            Opts::new(
                "railguard_build_info",
                "Always 1; the labels say which railguard this is: version (the crate's), \
                 profile (release, or debug for a build not meant for production).",
            )
            .const_label("version", env!("CARGO_PKG_VERSION"))
            .const_label(
                "profile",
                if cfg!(debug_assertions) {
                    "debug"
                } else {
                    "release"
                },
            ),
        )
        .expect("valid metric");
        build_info.set(1);
        registry
            .register(Box::new(build_info))
            .expect("metric registered once");
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("metric registered once");
        let fenced_out = IntCounter::new(
            "lock_fenced_out_total",
            "Requests refused because their fencing token was below the account's high-water \
             mark. Must stay zero: any increase means a lease expired under a live holder.",
        )
        .expect("valid metric");
        let would_have_fenced = IntCounter::new(
            "railguard_would_have_fenced_total",
            "Stale requests forwarded anyway because fencing.enforce is false.",
        )
        .expect("valid metric");
        let requests = IntCounterVec::new(
            Opts::new("railguard_requests_total", "Proxied requests by outcome."),
            &["outcome"],
        )
        .expect("valid metric");
        let fence_check_seconds = HistogramVec::new(
            HistogramOpts::new(
                "railguard_fence_check_duration_seconds",
                "Time to decide a fence check, by where it was decided (cache or database).",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["path"],
        )
        .expect("valid metric");
        let upstream_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "railguard_upstream_duration_seconds",
                "Time from sending a request to the rail to its response headers.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let fence_batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "railguard_fence_batch_size",
                "Compare-and-sets grouped into one statement and one commit.",
            )
            .buckets(vec![
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
            ]),
        )
        .expect("valid metric");
        let completion_batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "railguard_idempotency_completion_batch_size",
                "Idempotency-record completions (the rail's answers stored for replay) grouped \
                 into one statement and one commit.",
            )
            .buckets(vec![
                1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
            ]),
        )
        .expect("valid metric");
        let fencing_enforced = IntGauge::new(
            "railguard_fencing_enforced",
            "1 when the proxy refuses stale tokens, 0 when the kill switch is off.",
        )
        .expect("valid metric");
        let cross_process_order = IntGauge::new(
            "railguard_cross_process_order",
            "1 when a forward another railguard process may still have on its way to the rail \
             holds back this process's newer tokens for the account; 0 while \
             fencing.order_across_processes is false.",
        )
        .expect("valid metric");
        let handover_waits = IntCounter::new(
            "railguard_forward_handovers_total",
            "Forwards that waited, before they started, for another railguard process's forward \
             for the same account to be answered or settled, or could not finish waiting \
             (deadline, database error).",
        )
        .expect("valid metric");
        let fencing_proof_required = IntGauge::new(
            "railguard_fencing_proof_required",
            "1 when the proxy refuses tokens without a grant proof, 0 while \
             fencing.require_proof is false.",
        )
        .expect("valid metric");
        let unproven_tokens = IntCounter::new(
            "railguard_unproven_tokens_total",
            "Tokens let through without a grant proof because fencing.require_proof is false.",
        )
        .expect("valid metric");
        let outcomes_pending = IntGauge::new(
            "railguard_idempotency_outcomes_pending",
            "Idempotency records whose outcome could not be stored yet (the database was \
             unreachable) and is being retried.",
        )
        .expect("valid metric");
        let outcomes_lost = IntCounter::new(
            "railguard_idempotency_outcomes_lost_total",
            "Idempotency outcomes given up on after retrying for an hour: their records stay \
             in flight and become in doubt. Should stay zero.",
        )
        .expect("valid metric");
        let runtime_worker_threads = IntGauge::new(
            "railguard_runtime_worker_threads",
            "Worker threads of the async runtime (runtime.worker_threads; 0 there is one per \
             CPU).",
        )
        .expect("valid metric");
        let db_statements_stalled = statements_stalled();
        let listener_refusals = crate::http::Refusal::counter();
        let listener_tls_reloads = crate::tls::server::reload_counter();
        for metric in [
            Box::new(listener_refusals.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(listener_tls_reloads.clone()),
            Box::new(fencing_proof_required.clone()),
            Box::new(unproven_tokens.clone()),
            Box::new(outcomes_pending.clone()),
            Box::new(outcomes_lost.clone()),
            Box::new(fenced_out.clone()),
            Box::new(would_have_fenced.clone()),
            Box::new(requests.clone()),
            Box::new(fence_check_seconds.clone()),
            Box::new(upstream_seconds.clone()),
            Box::new(fencing_enforced.clone()),
            Box::new(cross_process_order.clone()),
            Box::new(handover_waits.clone()),
            Box::new(fence_batch_size.clone()),
            Box::new(completion_batch_size.clone()),
            Box::new(runtime_worker_threads.clone()),
            Box::new(db_statements_stalled.clone()),
        ] {
            registry.register(metric).expect("metric registered once");
        }
        // Every outcome is exported from the start, so that rates and alerts see a zero, not
        // a gap.
        let by_outcome =
            Outcome::ALL.map(|outcome| requests.with_label_values(&[outcome.as_str()]));
        for statement in ["fence", "completion", "look"] {
            db_statements_stalled.with_label_values(&[statement]);
        }
        let fence_check = [FencePath::Cache, FencePath::Database]
            .map(|path| fence_check_seconds.with_label_values(&[path.as_str()]));
        for listener in ["proxy", "admin", "lock"] {
            for reason in crate::http::Refusal::ALL {
                listener_refusals.with_label_values(&[listener, reason.as_str()]);
            }
        }
        Self {
            registry,
            fenced_out,
            would_have_fenced,
            requests,
            by_outcome,
            fence_check_seconds,
            fence_check,
            upstream_seconds,
            fencing_enforced,
            cross_process_order,
            handover_waits,
            fencing_proof_required,
            unproven_tokens,
            outcomes_pending,
            outcomes_lost,
            fence_batch_size,
            completion_batch_size,
            listener_refusals,
            listener_tls_reloads,
            runtime_worker_threads,
            db_statements_stalled,
        }
    }

    pub fn record_outcome(&self, outcome: Outcome) {
        // `Outcome::ALL` lists the outcomes in their declared order (a test checks it); one
        // left out of it would still be counted, by its label.
        match self.by_outcome.get(outcome as usize) {
            Some(counter) => counter.inc(),
            None => self.requests.with_label_values(&[outcome.as_str()]).inc(),
        }
        if outcome == Outcome::FencedOut {
            self.fenced_out.inc();
        }
    }

    pub fn observe_fence(&self, path: FencePath, seconds: f64) {
        self.fence_check[path as usize].observe(seconds);
    }

    /// The registry every metric of this process is in (other modules register their own).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding");
        String::from_utf8(out).expect("prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_info_names_this_version_and_is_one() {
        let text = Metrics::new().render();
        let line = text
            .lines()
            .find(|l| l.starts_with("railguard_build_info{"))
            .unwrap_or_else(|| panic!("no railguard_build_info in:\n{text}"));
        assert!(
            line.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
            "{line}"
        );
        assert!(line.ends_with("} 1"), "{line}");
    }

    // Each outcome and each fence path is counted under its own label.
    #[test]
    fn each_outcome_and_fence_path_counts_under_its_own_label() {
        let metrics = Metrics::new();
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.record_outcome(outcome);
            }
        }
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            let counted = metrics
                .requests
                .with_label_values(&[outcome.as_str()])
                .get();
            assert_eq!(counted, n as u64 + 1, "{outcome:?}");
        }
        assert_eq!(metrics.fenced_out.get(), 2);
        metrics.observe_fence(FencePath::Database, 0.5);
        metrics.observe_fence(FencePath::Database, 0.5);
        metrics.observe_fence(FencePath::Cache, 0.5);
        for (path, count) in [("database", 2), ("cache", 1)] {
            let histogram = metrics.fence_check_seconds.with_label_values(&[path]);
            assert_eq!(histogram.get_sample_count(), count, "{path}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_process_metrics_describe_this_process() {
        let text = Metrics::new().render();
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
        };
        assert!(value("process_resident_memory_bytes") > 0.0);
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_cpu_seconds_total") >= 0.0);
        let started = value("process_start_time_seconds");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            started > now - 24.0 * 3600.0 && started <= now + 1.0,
            "{started} {now}"
        );
    }
}
