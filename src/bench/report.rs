//! Turns the repetitions of each phase into the markdown that goes into BENCHMARKS.md.
//!
//! Every figure is a median over repetitions, and every ratio divides two medians taken in the
//! same run, so that the numbers compare this build with its own baseline on the same machine
//! at the same time. Repetitions that saw anything unexpected are flagged in the table and
//! explained under it.

use std::fmt::Write as _;

use super::cpu::CpuUse;
use super::{BenchOptions, Phase};
use crate::config::Config;

/// One repetition of one phase.
#[derive(Debug, Clone, Default)]
pub struct Sample {
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
    pub fn failed(why: String) -> Self {
        Self {
            unexpected: 1,
            problems: vec![why],
            ..Self::default()
        }
    }
}

/// Where and when the run happened.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    pub date: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub memory: String,
    pub postgres: String,
}

/// Everything one `railguard bench` measured.
#[derive(Debug)]
pub struct Report {
    pub environment: Environment,
    pub options: BenchOptions,
    /// What the proxies ran with (listeners and database aside).
    pub proxy_config: Config,
    pub stale_accounts: u64,
    pub samples: Vec<(Phase, Vec<Sample>)>,
    /// VmHWM of this process at the end of the run.
    pub peak_rss_kib: Option<u64>,
}

/// The median of the values; the mean of the middle two for an even count.
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
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
fn thousands(value: f64) -> String {
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

    pub fn to_markdown(&self) -> String {
        let env = &self.environment;
        let o = &self.options;
        let mut md = String::new();
        let _ = writeln!(md, "### railguard bench, {}\n", env.date);
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
        let _ = writeln!(
            md,
            "- Settings: {} s × {} repetitions per phase, interleaved round-robin, {} s warm-up before each; \
             {} HTTP connections, each one request at a time; {} accounts (uniform); \
             `pgbench -n -M prepared -j 2` with -c {}",
            o.duration.as_secs(),
            o.repeats,
            o.warmup.as_secs(),
            o.connections,
            o.accounts,
            o.connections,
        );
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
        let _ = writeln!(
            md,
            "- Accepted phases send token {} on accounts `acct-1..{}`: equal tokens are accepted, so every request \
             is a real compare-and-set committed durably (grouped by the proxy, one per transaction by pgbench); \
             the stale phase sends token 1 on {} accounts raised to {} beforehand",
            super::TOKEN,
            o.accounts,
            self.stale_accounts,
            super::STALE_MARK,
        );
        if let Some(kib) = self.peak_rss_kib {
            let _ = writeln!(
                md,
                "- Peak RSS of the bench process (both proxies, rail simulator and load generator together): {:.0} MiB",
                kib as f64 / 1024.0
            );
        }
        md.push('\n');

        let direct = self.summary(Phase::Direct).map(|s| s.rate);
        let pgbench = self.summary(Phase::Pgbench).map(|s| s.rate);
        md.push_str(
            "| phase | req/s (median) | min–max | p50 ms | p99 ms | × direct | × pgbench | unexpected |\n",
        );
        md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for (phase, samples) in &self.samples {
            let s = summarize(samples);
            let proxied = matches!(
                phase,
                Phase::ProxyUnfenced | Phase::ProxyFenced | Phase::StaleRejected
            );
            let commits = matches!(phase, Phase::ProxyUnfenced | Phase::ProxyFenced);
            let vs_direct = if proxied {
                ratio(s.rate, direct)
            } else {
                "—".into()
            };
            let vs_pgbench = if commits {
                ratio(s.rate, pgbench)
            } else {
                "—".into()
            };
            let unexpected = if s.unexpected == 0 {
                "0".to_string()
            } else {
                format!("**⚠ {}**", s.unexpected)
            };
            let _ = writeln!(
                md,
                "| {} | {} | {}–{} | {} | {} | {} | {} | {} |",
                phase.label(o),
                thousands(s.rate),
                thousands(s.min),
                thousands(s.max),
                ms(s.p50_ms),
                ms(s.p99_ms),
                vs_direct,
                vs_pgbench,
                unexpected,
            );
        }

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

        md.push_str("\nEach repetition, req/s (tx/s for pgbench), in the order they ran:\n\n");
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

        md.push_str(
            "\nWhere the CPU went during the measured runs (medians; CPU time per request or transaction, \
             from /proc; the railguard process holds the load generator, both proxies and the rail \
             simulator):\n\n",
        );
        md.push_str(
            "| phase | machine busy | other processes | railguard process µs | PostgreSQL µs | pgbench µs |\n",
        );
        md.push_str("|---|---:|---:|---:|---:|---:|\n");
        for (phase, samples) in &self.samples {
            let pgbench = matches!(phase, Phase::Pgbench);
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
            let _ = writeln!(
                md,
                "| {} | {busy:.0}% | {others:.0}% | {own} | {:.0} | {client} |",
                phase.label(o),
                per_op(|c| c.postgres_secs),
            );
        }
        md
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
