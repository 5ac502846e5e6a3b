//! Turns the repetitions of each phase into the markdown that goes into BENCHMARKS.md.
//!
//! Every figure is a median over repetitions, and every ratio divides two medians taken in the
//! same run, so that the numbers compare this build with its own baseline on the same machine
//! at the same time. Repetitions that saw anything unexpected are flagged in the table and
//! explained under it.

use std::fmt::Write as _;

use crate::bench::{BenchOptions, Phase, Suite};
use crate::cpu::CpuUse;
use crate::rss::RssResult;
use railguard::config::Config;

/// One repetition of one phase.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    /// Expected answers (or committed transactions) per second.
    pub rate: f64,
    pub p50_us: u32,
    pub p99_us: u32,
    /// Requests or transactions measured.
    pub count: u64,
    /// Unexpected answers, transport errors, failed transactions.
    pub unexpected: u64,
    /// What was unexpected, in words.
    pub problems: Vec<String>,
    /// CPU used during the measured run.
    pub cpu: CpuUse,
}

impl Sample {
    /// A repetition that could not be measured at all.
    pub(crate) fn failed(why: String) -> Self {
        Self {
            unexpected: 1,
            problems: vec![why],
            ..Self::default()
        }
    }
}

/// Where and when the run happened.
#[derive(Debug, Clone, Default)]
pub(crate) struct Environment {
    pub date: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub memory: String,
    pub postgres: String,
    pub etcd: String,
}

/// Everything one `railguard-bench` measured.
#[derive(Debug)]
pub(crate) struct Report {
    pub environment: Environment,
    pub options: BenchOptions,
    /// What the proxies ran with (listeners and database aside).
    pub proxy_config: Config,
    pub stale_accounts: u64,
    pub samples: Vec<(Phase, Vec<Sample>)>,
    /// VmHWM of this process at the end of the run.
    pub peak_rss_kib: Option<u64>,
    /// The separate `railguard serve` process with many connections open (proxy suite).
    pub rss: Option<Result<RssResult, String>>,
}

/// PostgreSQL settings given with `--pg-setting`, as a report prints them; `None` when none.
pub(crate) fn pg_settings_text(settings: &[(String, String)]) -> Option<String> {
    (!settings.is_empty()).then(|| {
        settings
            .iter()
            .map(|(n, v)| format!("`{n}={v}`"))
            .collect::<Vec<_>>()
            .join(", ")
    })
}

/// The median of the values; the mean of the middle two for an even count.
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.into_iter().collect();
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// Share of the machine's CPU time used by other processes above which a repetition is marked.
const NOISY: f64 = 0.10;

/// Medians of one phase.
struct Summary {
    rate: f64,
    min: f64,
    max: f64,
    p50_ms: f64,
    p99_ms: f64,
    unexpected: u64,
}

fn summarize(samples: &[Sample]) -> Summary {
    let rates = || samples.iter().map(|s| s.rate);
    Summary {
        rate: median(rates()),
        min: rates().fold(f64::INFINITY, f64::min),
        max: rates().fold(0.0, f64::max),
        p50_ms: median(samples.iter().map(|s| f64::from(s.p50_us) / 1000.0)),
        p99_ms: median(samples.iter().map(|s| f64::from(s.p99_us) / 1000.0)),
        unexpected: samples.iter().map(|s| s.unexpected).sum(),
    }
}

/// `12345.6` → `12,346`.
pub(crate) fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else if value >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn ratio(numerator: f64, denominator: Option<f64>) -> String {
    match denominator {
        Some(d) if d > 0.0 => format!("{:.2}×", numerator / d),
        _ => "—".into(),
    }
}

impl Report {
    fn summary(&self, phase: Phase) -> Option<Summary> {
        self.samples
            .iter()
            .find(|(p, _)| *p == phase)
            .map(|(_, s)| summarize(s))
    }

    pub(crate) fn to_markdown(&self) -> String {
        let mut md = String::new();
        self.header(&mut md);
        if self.options.runs(Suite::Proxy) {
            self.proxy_table(&mut md);
        }
        if self.options.runs(Suite::Locks) {
            md.push_str("\n#### Lock API on PostgreSQL against pgbench running the same SQL\n\n");
            self.cycle_table(
                &mut md,
                Phase::LockApiPostgres,
                Phase::PgbenchLocks,
                "× pgbench",
            );
        }
        if self.options.runs(Suite::Etcd) {
            md.push_str("\n#### Lock API on etcd against etcd's own Lock/Unlock RPC\n\n");
            self.cycle_table(
                &mut md,
                Phase::LockApiEtcd,
                Phase::EtcdNativeLocks,
                "× etcd Lock/Unlock",
            );
        }
        if let Some(rss) = &self.rss {
            self.rss_table(&mut md, rss);
        }
        if self.options.runs(Suite::Proxy) {
            self.targets(&mut md);
        }
        self.flagged(&mut md);
        self.repetitions(&mut md);
        self.cpu_table(&mut md);
        md
    }

    fn header(&self, md: &mut String) {
        let env = &self.environment;
        let o = &self.options;
        let _ = writeln!(md, "### railguard-bench, {}\n", env.date);
        let _ = writeln!(
            md,
            "- Machine: {} CPUs ({}), {} RAM, Linux {}",
            env.cpus, env.cpu_model, env.memory, env.kernel
        );
        let _ = writeln!(
            md,
            "- PostgreSQL: {}, durable (fsync on, synchronous_commit on), throwaway cluster under /var/tmp",
            env.postgres
        );
        if o.runs(Suite::Etcd) {
            let _ = writeln!(
                md,
                "- etcd: {}, one member, throwaway data dir under /var/tmp (fsync on: etcd 3.4 cannot turn it off)",
                env.etcd
            );
        }
        let suites: Vec<&str> = Suite::ALL
            .iter()
            .filter(|s| o.runs(**s))
            .map(|s| match s {
                Suite::Proxy => "proxy",
                Suite::Locks => "locks",
                Suite::Etcd => "etcd",
            })
            .collect();
        let _ = writeln!(
            md,
            "- Settings: suites {}; {} s × {} repetitions per phase, all phases interleaved round-robin, \
             {} s warm-up before each",
            suites.join(", "),
            o.duration.as_secs(),
            o.repeats,
            o.warmup.as_secs(),
        );
        if o.runs(Suite::Proxy) {
            let _ = writeln!(
                md,
                "- Proxy phases: {} HTTP connections, each one request at a time; {} accounts (uniform) unless the row says otherwise; \
                 `pgbench -n -M prepared -j 2` with -c {}",
                o.connections,
                thousands(o.accounts as f64),
                o.connections,
            );
        }
        if o.runs(Suite::Locks) || o.runs(Suite::Etcd) {
            let _ = writeln!(
                md,
                "- Lock phases: {} clients, each cycling on its own key (`bench-lock-<client>`): acquire \
                 (`ttl_ms` {}, `wait_ms` 0) then release of the returned token; one cycle = both",
                o.lock_clients,
                crate::locks::LEASE_MS,
            );
        }
        let c = &self.proxy_config;
        let _ = writeln!(
            md,
            "- Proxies: database.pool_size = {}, fencing.batch_max = {}, \
             fencing.batch_concurrency = {} (group commit), fencing.cache_capacity = {}; no idempotency keys sent",
            c.database.pool_size,
            c.fencing.batch_max,
            c.fencing.batch_concurrency,
            c.fencing.cache_capacity,
        );
        if o.runs(Suite::Proxy) {
            let _ = writeln!(
                md,
                "- Accepted phases send token {} on accounts `acct-1..N`: equal tokens are accepted, so every request \
                 is a real compare-and-set committed durably (grouped by the proxy, one per transaction by pgbench); \
                 the stale phase sends token 1 on {} accounts raised to {} beforehand",
                crate::bench::TOKEN,
                self.stale_accounts,
                crate::bench::STALE_MARK,
            );
        }
        if let Some(kib) = self.peak_rss_kib {
            let _ = writeln!(
                md,
                "- Peak RSS of the bench process (proxies, rail simulator and load generator together): {:.0} MiB",
                kib as f64 / 1024.0
            );
        }
    }

    fn proxy_table(&self, md: &mut String) {
        let o = &self.options;
        let direct = self.summary(Phase::Direct);
        let pgbench = self.summary(Phase::Pgbench).map(|s| s.rate);
        let _ = writeln!(md, "\n#### Fenced proxy, {} connections\n", o.connections);
        md.push_str(
            "| phase | req/s (median) | min–max | p50 ms | p99 ms | added p50 ms | added p99 ms | × direct | × pgbench | unexpected |\n",
        );
        md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (phase, samples) in self.suite_samples(Suite::Proxy) {
            let s = summarize(samples);
            let proxied = !matches!(phase, Phase::Direct | Phase::Pgbench);
            let commits = matches!(
                phase,
                Phase::ProxyUnfenced | Phase::ProxyFenced | Phase::ProxyFencedOn(_)
            );
            let (vs_direct, added_p50, added_p99) = match (&direct, proxied) {
                (Some(d), true) => (
                    ratio(s.rate, Some(d.rate)),
                    ms(s.p50_ms - d.p50_ms),
                    ms(s.p99_ms - d.p99_ms),
                ),
                _ => ("—".into(), "—".into(), "—".into()),
            };
            let vs_pgbench = if commits {
                ratio(s.rate, pgbench)
            } else {
                "—".into()
            };
            let _ = writeln!(
                md,
                "| {} | {} | {}–{} | {} | {} | {added_p50} | {added_p99} | {vs_direct} | {vs_pgbench} | {} |",
                phase.label(o),
                thousands(s.rate),
                thousands(s.min),
                thousands(s.max),
                ms(s.p50_ms),
                ms(s.p99_ms),
                unexpected(s.unexpected),
            );
        }
        md.push_str(
            "\nadded p50/p99: the row's median p50/p99 minus the direct row's, at the same number of connections \
             (closed loops, so most of it is queueing behind the slower path).\n",
        );
    }

    /// A two-row table of acquire + release cycles against their baseline.
    fn cycle_table(&self, md: &mut String, ours: Phase, baseline: Phase, against: &str) {
        let o = &self.options;
        let base = self.summary(baseline).map(|s| s.rate);
        let _ = writeln!(
            md,
            "| phase | cycles/s (median) | min–max | p50 ms | p99 ms | {against} | unexpected |"
        );
        md.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for phase in [ours, baseline] {
            let Some(s) = self.summary(phase) else {
                continue;
            };
            let vs = if phase == ours {
                ratio(s.rate, base)
            } else {
                "—".into()
            };
            let _ = writeln!(
                md,
                "| {} | {} | {}–{} | {} | {} | {vs} | {} |",
                phase.label(o),
                thousands(s.rate),
                thousands(s.min),
                thousands(s.max),
                ms(s.p50_ms),
                ms(s.p99_ms),
                unexpected(s.unexpected),
            );
        }
    }

    fn rss_table(&self, md: &mut String, rss: &Result<RssResult, String>) {
        let _ = writeln!(
            md,
            "\n#### Proxy memory with {} open client connections (separate `railguard serve` process)\n",
            thousands(self.options.rss_connections as f64)
        );
        match rss {
            Ok(r) => {
                let mib = |kib: u64| {
                    format!(
                        "{:.1} MiB ({:.1} MB)",
                        kib as f64 / 1024.0,
                        kib as f64 * 1.024 / 1000.0
                    )
                };
                md.push_str("| measurement | value |\n|---|---:|\n");
                let _ = writeln!(
                    md,
                    "| VmRSS once ready, no client connection | {} |",
                    mib(r.idle_kib)
                );
                let _ = writeln!(
                    md,
                    "| VmRSS with {} keep-alive connections open, one fenced payment sent on each ({} answered 201) | {} |",
                    thousands(r.connections as f64),
                    thousands(r.accepted as f64),
                    mib(r.open_kib)
                );
                let _ = writeln!(
                    md,
                    "| VmHWM (peak resident) at that moment | {} |",
                    mib(r.peak_kib)
                );
                let _ = writeln!(
                    md,
                    "| open file descriptors of the process at that moment | {} |",
                    thousands(r.open_fds as f64)
                );
                for problem in &r.problems {
                    let _ = writeln!(md, "\n**⚠** {problem}");
                }
            }
            Err(why) => {
                let _ = writeln!(md, "**Not measured:** {why}");
            }
        }
    }

    fn targets(&self, md: &mut String) {
        let o = &self.options;
        md.push_str("\n#### Targets\n\n| target | measured | met? | why, when missed |\n|---|---:|---|---|\n");
        let rate = |p| self.summary(p).map(|s| s.rate);
        let met = |ok: bool| if ok { "met" } else { "**missed**" };
        if let (Some(fenced), Some(pgbench)) = (rate(Phase::ProxyFenced), rate(Phase::Pgbench)) {
            let r = fenced / pgbench.max(1e-9);
            let why = if r >= 1.0 {
                String::new()
            } else {
                let cpu = |p: Phase| {
                    let samples = self
                        .samples
                        .iter()
                        .find(|(q, _)| *q == p)
                        .map(|(_, s)| s.as_slice())
                        .unwrap_or(&[]);
                    let per = |f: fn(&CpuUse) -> f64| {
                        median(
                            samples
                                .iter()
                                .map(|s| f(&s.cpu) * 1e6 / s.count.max(1) as f64),
                        )
                    };
                    (
                        per(|c| c.own_secs),
                        per(|c| c.postgres_secs),
                        median(samples.iter().map(|s| s.cpu.machine_busy * 100.0)),
                    )
                };
                let (own, pg, busy) = cpu(Phase::ProxyFenced);
                let (direct_own, _, _) = cpu(Phase::Direct);
                format!(
                    "CPU: the {} shared cores were {busy:.0}% busy; per forwarded request the railguard process \
                     used {own:.0} µs (direct to the simulator: {direct_own:.0} µs) and PostgreSQL {pg:.0} µs",
                    self.environment.cpus
                )
            };
            let _ = writeln!(
                md,
                "| fenced forwards ≥ 1.0× pgbench at {} clients ({} accounts) | {r:.2}× | {} | {why} |",
                o.connections,
                thousands(o.accounts as f64),
                met(r >= 1.0)
            );
        }
        if let (Some(stale), Some(off)) = (rate(Phase::StaleRejected), rate(Phase::ProxyUnfenced)) {
            let r = stale / off.max(1e-9);
            let _ = writeln!(
                md,
                "| stale rejections ≥ 0.9× fencing off | {r:.2}× | {} | {} |",
                met(r >= 0.9),
                if r >= 0.9 { "" } else { "see the CPU table" }
            );
        }
        if let Some(rss) = &self.rss {
            match rss {
                Ok(r) => {
                    let bytes = r.open_kib * 1024;
                    let complete = r.accepted == r.connections;
                    let ok = bytes < crate::rss::TARGET_BYTES && complete;
                    let why = if !complete {
                        format!(
                            "only {} of {} connections were accepted",
                            r.accepted, r.connections
                        )
                    } else if !ok {
                        "resident memory above the target".into()
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        md,
                        "| proxy RSS < 100 MB at {} open connections | {:.1} MB | {} | {why} |",
                        thousands(r.connections as f64),
                        bytes as f64 / 1e6,
                        met(ok)
                    );
                }
                Err(why) => {
                    let _ = writeln!(
                        md,
                        "| proxy RSS < 100 MB at {} open connections | — | **not measured** | {why} |",
                        o.rss_connections
                    );
                }
            }
        }
    }

    fn flagged(&self, md: &mut String) {
        let o = &self.options;
        let flagged: Vec<String> = self
            .samples
            .iter()
            .flat_map(|(phase, samples)| {
                samples.iter().enumerate().flat_map(move |(rep, s)| {
                    s.problems
                        .iter()
                        .map(move |p| format!("- {}, repetition {}: {p}", phase.label(o), rep + 1))
                })
            })
            .collect();
        if !flagged.is_empty() {
            md.push_str("\n**Flagged** (these repetitions saw something other than the expected answer):\n\n");
            for line in flagged {
                md.push_str(&line);
                md.push('\n');
            }
        }
    }

    fn repetitions(&self, md: &mut String) {
        let o = &self.options;
        md.push_str("\nEach repetition, req/s (cycles/s for lock phases, tx/s for pgbench), in the order they ran:\n\n");
        let reps = self.samples.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
        md.push_str("| phase |");
        for rep in 1..=reps {
            let _ = write!(md, " {rep} |");
        }
        md.push_str("\n|---|");
        md.push_str(&"---:|".repeat(reps));
        md.push('\n');
        for (phase, samples) in &self.samples {
            let _ = write!(md, "| {} |", phase.label(o));
            for s in samples {
                let mark = if s.cpu.others > NOISY { " †" } else { "" };
                let _ = write!(md, " {}{mark} |", thousands(s.rate));
            }
            md.push('\n');
        }
        let noisy = self
            .samples
            .iter()
            .flat_map(|(_, s)| s)
            .any(|s| s.cpu.others > NOISY);
        if noisy {
            let _ = writeln!(
                md,
                "\n† Other processes on the machine used more than {:.0}% of its CPU time during this repetition.",
                NOISY * 100.0
            );
        }
    }

    fn cpu_table(&self, md: &mut String) {
        let o = &self.options;
        md.push_str(
            "\nWhere the CPU went during the measured runs (medians; CPU time per request, cycle or transaction, \
             from /proc; the railguard process holds the load generator, the in-process proxies and lock \
             services, and the rail simulator):\n\n",
        );
        md.push_str(
            "| phase | machine busy | other processes | railguard process µs | PostgreSQL µs | etcd µs | pgbench µs |\n",
        );
        md.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for (phase, samples) in &self.samples {
            let pgbench = matches!(phase, Phase::Pgbench | Phase::PgbenchLocks);
            let etcd = phase.suite() == Suite::Etcd;
            let per_op = |secs: fn(&CpuUse) -> f64| {
                median(
                    samples
                        .iter()
                        .map(|s| secs(&s.cpu) * 1e6 / s.count.max(1) as f64),
                )
            };
            let busy = median(samples.iter().map(|s| s.cpu.machine_busy * 100.0));
            let others = median(samples.iter().map(|s| s.cpu.others * 100.0));
            let own = if pgbench {
                "—".into()
            } else {
                format!("{:.0}", per_op(|c| c.own_secs))
            };
            let client = if pgbench {
                format!("{:.0}", per_op(|c| c.reaped_children_secs))
            } else {
                "—".into()
            };
            let etcd = if etcd {
                format!("{:.0}", per_op(|c| c.etcd_secs))
            } else {
                "—".into()
            };
            let _ = writeln!(
                md,
                "| {} | {busy:.0}% | {others:.0}% | {own} | {:.0} | {etcd} | {client} |",
                phase.label(o),
                per_op(|c| c.postgres_secs),
            );
        }
    }

    fn suite_samples(&self, suite: Suite) -> impl Iterator<Item = (Phase, &[Sample])> {
        self.samples
            .iter()
            .filter(move |(p, _)| p.suite() == suite)
            .map(|(p, s)| (*p, s.as_slice()))
    }
}

fn unexpected(n: u64) -> String {
    if n == 0 {
        "0".to_string()
    } else {
        format!("**⚠ {n}**")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median([]), 0.0);
    }

    #[test]
    fn formats() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.6), "1,000");
        assert_eq!(thousands(12.0), "12");
        assert_eq!(ms(0.8123), "0.81");
        assert_eq!(ms(19.04), "19.0");
        assert_eq!(ratio(1.0, Some(4.0)), "0.25×");
        assert_eq!(ratio(1.0, Some(0.0)), "—");
    }
}
