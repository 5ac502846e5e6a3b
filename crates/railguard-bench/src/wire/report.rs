//! The `wire` suite's markdown: medians per phase, ratios to nginx and to pgbench from the same
//! run, railguard's fenced forward against the bare hyper proxy (its floor), the targets
//! (docs/performance.md) with whether this run met them, and the fenced forward with the
//! cross-process order off and through a baseline binary, when run.

use std::fmt::Write as _;

use super::{Phase, Route, Sample, WireOptions, per_request_us, profiler};
use crate::report::median;
use railguard::config::Config;

#[derive(Debug)]
pub(crate) struct WireReport {
    pub options: WireOptions,
    pub date: String,
    pub postgres: String,
    pub stale_accounts: u64,
    pub proxy_config: Config,
    pub samples: Vec<(Phase, Vec<Sample>)>,
    /// CPUs of the machine every process of the run shared.
    pub cpus: usize,
    /// How PostgreSQL read railguard's tables over the whole run, read once every railguard
    /// process had stopped (a backend reports its counts when it exits).
    pub table_scans: Vec<TableScans>,
    /// The statements that took PostgreSQL the most time, when the cluster ran with
    /// `--pg-setting shared_preload_libraries=pg_stat_statements`; empty otherwise.
    pub top_statements: Vec<StatementCost>,
}

/// One statement's cost over the run, from `pg_stat_statements`.
#[derive(Debug, Clone, Default)]
pub(crate) struct StatementCost {
    /// The statement's first line, whitespace collapsed.
    pub query: String,
    pub calls: i64,
    pub rows: i64,
    pub total_ms: f64,
    /// Times it was planned, and the planning's total time (with
    /// `pg_stat_statements.track_planning = on`; 0 otherwise).
    pub plans: i64,
    pub plan_ms: f64,
    pub wal_bytes: f64,
    pub wal_full_page_images: i64,
}

/// One table's scans over the run, from `pg_stat_user_tables`.
#[derive(Debug, Clone, Default)]
pub(crate) struct TableScans {
    pub table: String,
    pub seq_scans: i64,
    pub seq_rows_read: i64,
    pub index_scans: i64,
}

/// Medians of one phase.
#[derive(Debug, Clone, Copy, Default)]
struct Medians {
    rate: f64,
    p50_us: f64,
    p99_us: f64,
    proxy_us: f64,
    switches: f64,
    /// Of the switches, the involuntary ones, and the voluntary ones (each a median of its
    /// own, so the two need not add up to `switches`).
    involuntary: f64,
    voluntary: f64,
    upstream_us: f64,
    /// wrk's CPU per request; `None` when no repetition could measure it (profiled runs).
    load_us: Option<f64>,
    postgres_us: f64,
    postgres_backend_us: f64,
    busy: f64,
    batch_rows: f64,
    flagged: usize,
}

fn medians(samples: &[Sample]) -> Medians {
    let m = |f: &dyn Fn(&Sample) -> f64| median(samples.iter().map(f));
    Medians {
        rate: m(&|s| s.rate),
        p50_us: m(&|s| s.p50_us),
        p99_us: m(&|s| s.p99_us),
        proxy_us: m(&|s| per_request_us(s.proxy_cpu, s.requests)),
        switches: m(&|s| s.proxy_switches as f64 / s.requests.max(1) as f64),
        involuntary: m(&|s| s.proxy_involuntary as f64 / s.requests.max(1) as f64),
        voluntary: m(&|s| {
            s.proxy_switches.saturating_sub(s.proxy_involuntary) as f64 / s.requests.max(1) as f64
        }),
        upstream_us: m(&|s| per_request_us(s.upstream_cpu, s.requests)),
        load_us: {
            let measured: Vec<f64> = samples
                .iter()
                .filter_map(|s| s.load_cpu.map(|cpu| per_request_us(cpu, s.requests)))
                .collect();
            (!measured.is_empty()).then(|| median(measured))
        },
        postgres_us: m(&|s| per_request_us(s.postgres_cpu, s.requests)),
        postgres_backend_us: m(&|s| per_request_us(s.postgres_backend_cpu, s.requests)),
        busy: m(&|s| s.machine_busy),
        batch_rows: m(&|s| s.batch_rows),
        flagged: samples.iter().filter(|s| !s.problems.is_empty()).count(),
    }
}

impl WireReport {
    fn find(&self, route: Route, keys: bool, stale: bool, connections: usize) -> Option<Medians> {
        self.samples
            .iter()
            .find(|(p, _)| {
                p.route == route
                    && p.stale == stale
                    && p.connections == connections
                    && (route == Route::Pgbench || p.keys == keys)
            })
            .map(|(_, s)| medians(s))
    }

    /// The lowest and highest ratio of the default's CPU per request to `variant`'s over the
    /// repetitions (each repetition's two phases ran in it, a phase or two apart), flagged
    /// repetitions left out.
    fn paired(&self, variant: Phase, connections: usize) -> Option<(f64, f64)> {
        let ratios = self.per_repetition(Route::Fenced, variant, connections);
        let low = ratios.iter().copied().reduce(f64::min)?;
        let high = ratios.iter().copied().reduce(f64::max)?;
        Some((low, high))
    }

    /// `route`'s CPU per request over `other`'s (with `other`'s requests), one ratio per
    /// repetition, flagged repetitions left out.
    fn per_repetition(&self, route: Route, other: Phase, connections: usize) -> Vec<f64> {
        let samples = |route| {
            self.samples
                .iter()
                .find(|(p, _)| {
                    p.route == route
                        && p.keys == other.keys
                        && p.stale == other.stale
                        && p.connections == connections
                })
                .map(|(_, s)| s)
        };
        let (Some(first), Some(second)) = (samples(route), samples(other.route)) else {
            return Vec::new();
        };
        first
            .iter()
            .zip(second)
            .filter(|(d, v)| d.problems.is_empty() && v.problems.is_empty())
            .map(|(d, v)| {
                (
                    per_request_us(d.proxy_cpu, d.requests),
                    per_request_us(v.proxy_cpu, v.requests),
                )
            })
            .filter(|&(d, v)| d > 0.0 && v > 0.0)
            .map(|(d, v)| d / v)
            .collect()
    }

    pub(crate) fn to_markdown(&self) -> String {
        let o = &self.options;
        let mut out = String::new();
        let _ = writeln!(out, "### railguard-bench --suite wire, {}\n", self.date);
        let _ = writeln!(
            out,
            "- PostgreSQL: {}, durable (fsync on, synchronous_commit on), throwaway cluster under /var/tmp; settings: {}",
            self.postgres,
            crate::report::pg_settings_text(&o.pg_settings)
                .unwrap_or_else(|| "the defaults".to_string())
        );
        let _ = writeln!(
            out,
            "- Upstream: {}; nginx {} as the plain proxy, one worker per CPU; load from wrk \
             (2 threads), {} connections, {} s × {} repetitions per phase interleaved \
             round-robin (every other repetition in reverse order), {} s warm-up before each",
            match o.upstream {
                super::UpstreamKind::Static => "nginx answering 201 itself (one worker)",
                super::UpstreamKind::RailSim => "`railguard rail-sim`",
            },
            nginx_version(),
            o.connections,
            o.duration.as_secs(),
            o.repeats,
            o.warmup.as_secs()
        );
        let f = &self.proxy_config.fencing;
        let _ = writeln!(
            out,
            "- railguard serve: default configuration{} (log level `{}`, to a file), \
             database.pool_size = {}, fencing.batch_max = {}, fencing.batch_concurrency = {}; \
             every request is a `POST /payments` with token, account ({} accounts, uniform) and \
             grant proof; \"with keys\" adds an `Idempotency-Key` unique in the run; the stale \
             phase sends token 1 on {} accounts raised beforehand",
            if o.overrides.is_empty() {
                String::new()
            } else {
                format!(
                    ", with the environment's overrides `{}`",
                    o.overrides.join("`, `")
                )
            },
            self.proxy_config.log.level,
            self.proxy_config.database.pool_size,
            f.batch_max,
            f.batch_concurrency,
            o.accounts,
            self.stale_accounts
        );
        let mut variants = Vec::new();
        if o.order_off {
            variants
                .push("the same build with `fencing.order_across_processes = false`".to_string());
        }
        if o.per_core {
            variants.push(format!(
                "{} processes of the same build on one database of their own, each with \
                 `runtime.worker_threads = 1` and a pool of {} sessions, sharing one proxy \
                 address (`proxy.reuse_port`; their CPU and context switches summed)",
                self.cpus,
                (self.proxy_config.database.pool_size / self.cpus).max(2)
            ));
        }
        if let Some(baseline) = &o.baseline {
            variants.push(format!(
                "railguard {} (`{}`) at its defaults",
                baseline.label,
                baseline.binary.display()
            ));
        }
        let _ = writeln!(
            out,
            "- Each railguard process on a database of its own in the cluster (none meets another \
             process's entries in the mark rows); the fenced phases also run through {}",
            if variants.is_empty() {
                "no other build or variant".to_string()
            } else {
                variants.join(" and ")
            }
        );
        let _ = writeln!(
            out,
            "- The bare hyper proxy: `bare-proxy` (a binary of railguard-bench), a hyper 1 server on a \
             multi-thread tokio runtime (one thread per CPU) that reads each body whole and \
             forwards through hyper-util's pooled HTTP/1.1 client, in front of the same upstream, \
             with the same requests as the fenced phases\n\
             - The floors of a fenced forward: the same binary with `--fence-database` (a \
             database of its own, migrated as railguard's), which checks the grant proof, \
             runs railguard's compare-and-set (and a keyed request's record) grouped on one \
             session, forwards, and stores a keyed answer with railguard's completion before \
             answering; with `--last-look` it also takes railguard's last look, grouped on a \
             session of its own. Nothing else railguard does\n\
             - CPU and context switches per request: from `/proc` of each process (nginx: master \
             and workers), divided by the requests wrk counted; PostgreSQL: the postmaster and \
             all its backends; wrk: its own time, read once it has exited"
        );
        let scans: Vec<String> = self
            .table_scans
            .iter()
            .map(|t| {
                format!(
                    "`{}` {} sequential scans reading {} rows, {} index scans",
                    t.table, t.seq_scans, t.seq_rows_read, t.index_scans
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "- PostgreSQL's reads of railguard's tables over the whole run (pg_stat_user_tables): \
             {}\n",
            if scans.is_empty() {
                "not read".to_string()
            } else {
                scans.join("; ")
            }
        );

        let nginx = self.find(Route::Nginx, true, false, o.connections);
        let direct = self.find(Route::Direct, true, false, o.connections);
        let _ = writeln!(
            out,
            "| phase ({} connections) | req/s | × nginx | × direct | p50 ms | p99 ms | proxy CPU µs/req | × nginx | proxy ctx sw/req | PostgreSQL CPU µs/req, all | of which its sessions | rows per CAS statement | upstream CPU µs/req | wrk CPU µs/req | machine busy | flagged |",
            o.connections
        );
        let _ = writeln!(
            out,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (phase, samples) in self
            .samples
            .iter()
            .filter(|(p, _)| p.connections == o.connections)
        {
            let m = medians(samples);
            let ratio = |a: f64, b: Option<f64>| match b {
                Some(b) if b > 0.0 && a > 0.0 => format!("{:.2}×", a / b),
                _ => "—".into(),
            };
            let has_proxy = matches!(
                phase.route,
                Route::Nginx
                    | Route::Bare
                    | Route::BareFenced
                    | Route::BareLooked
                    | Route::RailguardOff
                    | Route::Fenced
                    | Route::Unordered
                    | Route::Baseline
                    | Route::PerCore
            );
            let _ = writeln!(
                out,
                "| {} | {:.0} | {} | {} | {:.2} | {:.2} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {:.0}% | {} |",
                phase.label(),
                m.rate,
                ratio(m.rate, nginx.map(|n| n.rate)),
                ratio(m.rate, direct.map(|d| d.rate)),
                m.p50_us / 1000.0,
                m.p99_us / 1000.0,
                if has_proxy {
                    format!("{:.1}", m.proxy_us)
                } else {
                    "—".into()
                },
                if has_proxy {
                    ratio(m.proxy_us, nginx.map(|n| n.proxy_us))
                } else {
                    "—".into()
                },
                if has_proxy {
                    format!("{:.2}", m.switches)
                } else {
                    "—".into()
                },
                m.postgres_us,
                if has_proxy {
                    format!("{:.1}", m.postgres_backend_us)
                } else {
                    "—".into()
                },
                if m.batch_rows > 0.0 {
                    format!("{:.1}", m.batch_rows)
                } else {
                    "—".into()
                },
                if phase.route == Route::Pgbench {
                    "—".into()
                } else {
                    format!("{:.1}", m.upstream_us)
                },
                m.load_us.map_or("—".into(), |us| format!("{us:.1}")),
                m.busy * 100.0,
                m.flagged,
            );
        }
        let latency: Vec<_> = self
            .samples
            .iter()
            .filter(|(p, _)| p.connections == 1)
            .collect();
        if !latency.is_empty() {
            let _ = writeln!(
                out,
                "\nAt one connection ({} s per repetition):\n\n| phase (1 connection) | req/s | p50 ms | p99 ms | flagged |\n|---|---:|---:|---:|---:|",
                o.latency_duration.as_secs()
            );
            for (phase, samples) in latency {
                let m = medians(samples);
                let _ = writeln!(
                    out,
                    "| {} | {:.0} | {:.3} | {:.3} | {} |",
                    phase.label(),
                    m.rate,
                    m.p50_us / 1000.0,
                    m.p99_us / 1000.0,
                    m.flagged
                );
            }
        }
        self.against_bare(&mut out);
        self.switches_split(&mut out);
        self.syscalls(&mut out);
        self.variants(&mut out);
        self.targets(&mut out);
        self.budgets(&mut out);
        self.repetitions(&mut out);
        out
    }

    /// railguard's fenced forward against the bare hyper proxy with the same requests: what
    /// railguard costs above a proxy that only forwards, beside the same against nginx; with
    /// `--baseline-bin`, the baseline binary's fenced phases too.
    fn against_bare(&self, out: &mut String) {
        let c = self.options.connections;
        let nginx_us = self
            .find(Route::Nginx, true, false, c)
            .map_or(0.0, |n| n.proxy_us);
        let baseline = self
            .samples
            .iter()
            .find(|(p, _)| p.route == Route::Baseline)
            .map(|(p, _)| format!("railguard {}", p.baseline.unwrap_or("baseline")));
        // (what, route, keys): this build's fenced phases, then the baseline's.
        let mut rows = vec![
            (FLOORS[0].1.to_string(), Route::BareFenced, false),
            (FLOORS[1].1.to_string(), Route::BareLooked, false),
            ("railguard".to_string(), Route::Fenced, false),
            (FLOORS[0].1.to_string(), Route::BareFenced, true),
            (FLOORS[1].1.to_string(), Route::BareLooked, true),
            ("railguard".to_string(), Route::Fenced, true),
        ];
        if let Some(label) = &baseline {
            rows.push((label.clone(), Route::Baseline, false));
            rows.push((label.clone(), Route::Baseline, true));
        }
        if self.find(Route::Bare, false, false, c).is_none()
            && self.find(Route::Bare, true, false, c).is_none()
        {
            return;
        }
        let ratio = |a: f64, b: f64| {
            if a > 0.0 && b > 0.0 {
                format!("{:.2}×", a / b)
            } else {
                "—".into()
            }
        };
        let _ = writeln!(
            out,
            "\nrailguard against the bare hyper proxy, medians of this run ({c} connections; each \
             row against the bare proxy's phase with the same requests, and against nginx's \
             phase, with keys):\n\n\
             | phase | CPU µs/req: railguard | bare proxy | railguard ÷ bare | railguard ÷ nginx | bare ÷ nginx | ctx sw/req: railguard | bare proxy | railguard ÷ bare | PostgreSQL CPU µs/req | CPU µs/req: this build ÷ baseline |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (what, route, keys) in &rows {
            let (Some(m), Some(bare)) = (
                self.find(*route, *keys, false, c),
                self.find(Route::Bare, *keys, false, c),
            ) else {
                continue;
            };
            let against_baseline = match (route, self.find(Route::Fenced, *keys, false, c)) {
                (Route::Baseline, Some(new)) => ratio(new.proxy_us, m.proxy_us),
                _ => "—".into(),
            };
            let _ = writeln!(
                out,
                "| {what}, fenced, {} | {:.1} | {:.1} | {} | {} | {} | {:.2} | {:.2} | {} | {:.1} | {against_baseline} |",
                if *keys { "with keys" } else { "no keys" },
                m.proxy_us,
                bare.proxy_us,
                ratio(m.proxy_us, bare.proxy_us),
                ratio(m.proxy_us, nginx_us),
                ratio(bare.proxy_us, nginx_us),
                m.switches,
                bare.switches,
                ratio(m.switches, bare.switches),
                m.postgres_us,
            );
        }
        for (floor, what) in FLOORS {
            for keys in [false, true] {
                if let (Some(floor), Some(fenced)) = (
                    self.find(floor, keys, false, c),
                    self.find(Route::Fenced, keys, false, c),
                ) {
                    let _ = writeln!(
                        out,
                        "| railguard, fenced, {} ÷ {what} | | | {} | | | | | {} | {} | |",
                        if keys { "with keys" } else { "no keys" },
                        ratio(fenced.proxy_us, floor.proxy_us),
                        ratio(fenced.switches, floor.switches),
                        ratio(fenced.postgres_us, floor.postgres_us),
                    );
                }
            }
        }
        let mut builds = vec![("railguard".to_string(), Route::Fenced)];
        builds.extend(FLOORS.map(|(route, what)| (what.to_string(), route)));
        builds.extend(baseline.map(|label| (label, Route::Baseline)));
        for (what, route) in builds {
            let (Some(unkeyed), Some(keyed)) = (
                self.find(route, false, false, c),
                self.find(route, true, false, c),
            ) else {
                continue;
            };
            let _ = writeln!(
                out,
                "| {what}, fenced: PostgreSQL CPU µs/req with keys ÷ no keys | | | | | | | | | {} | |",
                ratio(keyed.postgres_us, unkeyed.postgres_us)
            );
        }
        self.floors_per_repetition(out);
    }

    /// Each proxy phase's context switches per request split in two: voluntary (a thread
    /// had nothing left to run and slept: a hand-off between tasks or threads, a wait for the
    /// database or the upstream) and involuntary (a thread that could have gone on was taken
    /// off its core). Only the first is a hop of the proxy's own; the second is the machine's
    /// scheduler sharing its cores with the load, the upstream and PostgreSQL.
    fn switches_split(&self, out: &mut String) {
        let c = self.options.connections;
        let mut routes = vec![("nginx", Route::Nginx), ("the bare proxy", Route::Bare)];
        routes.extend(FLOORS.map(|(route, what)| (what, route)));
        routes.push(("railguard", Route::Fenced));
        let rows: Vec<(&str, bool, Medians)> = routes
            .into_iter()
            .flat_map(|(what, route)| {
                [false, true]
                    .into_iter()
                    .filter_map(move |keys| Some((what, keys, self.find(route, keys, false, c)?)))
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let ratio = |a: f64, b: Option<f64>| match b {
            Some(b) if a > 0.0 && b > 0.0 => format!("{:.2}×", a / b),
            _ => "—".into(),
        };
        let _ = writeln!(
            out,
            "\nContext switches per request, split ({c} connections, medians): voluntary (a \
             thread of the proxy had nothing left to run and slept: a hand-off, a wait for the \
             database or the upstream) and involuntary (a thread that could have gone on was \
             taken off its core; where the proxy shares its cores, often by a peer its own write had \
             just woken), each the \
             median of its own. Ratios are to the bare proxy's phase with the same requests.\n\n\
             | phase | voluntary | ÷ bare | involuntary | ÷ bare | all | ÷ bare |\n\
             |---|---:|---:|---:|---:|---:|---:|"
        );
        for (what, keys, m) in &rows {
            let bare = self.find(Route::Bare, *keys, false, c);
            let _ = writeln!(
                out,
                "| {what}, {} | {:.3} | {} | {:.3} | {} | {:.3} | {} |",
                if *keys { "with keys" } else { "no keys" },
                m.voluntary,
                ratio(m.voluntary, bare.map(|b| b.voluntary)),
                m.involuntary,
                ratio(m.involuntary, bare.map(|b| b.involuntary)),
                m.switches,
                ratio(m.switches, bare.map(|b| b.switches)),
            );
        }
    }

    /// System calls per request of each proxy phase (`--count-syscalls`), medians of the
    /// repetitions.
    fn syscalls(&self, out: &mut String) {
        let rows: Vec<String> = self
            .samples
            .iter()
            .filter(|(p, _)| p.connections == self.options.connections)
            .filter_map(|(phase, samples)| {
                let counted: Vec<(profiler::Syscalls, f64)> = samples
                    .iter()
                    .filter_map(|s| s.syscalls.map(|c| (c, s.requests.max(1) as f64)))
                    .collect();
                if counted.is_empty() {
                    return None;
                }
                let per = |f: fn(&profiler::Syscalls) -> f64| {
                    median(counted.iter().map(|(c, requests)| f(c) / requests))
                };
                Some(format!(
                    "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    phase.label(),
                    per(|c| c.all),
                    per(|c| c.writes),
                    per(|c| c.reads),
                    per(|c| c.epoll_wait),
                    per(|c| c.futex),
                ))
            })
            .collect();
        if rows.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\nSystem calls of the proxy process per request (`perf stat` on the syscall \
             tracepoints, medians of the repetitions; writes are `writev`, `write` and `sendto`, \
             reads `recvfrom` and `read`):\n\n\
             | phase | all | writes | reads | epoll_wait | futex |\n|---|---:|---:|---:|---:|---:|"
        );
        for row in rows {
            let _ = writeln!(out, "{row}");
        }
    }

    /// The floors' ratios to the bare proxy and railguard's to the floors, per repetition: the
    /// phases of a ratio ran a phase or two apart in each, so the spread is the machine's drift.
    fn floors_per_repetition(&self, out: &mut String) {
        let c = self.options.connections;
        let mut lines = Vec::new();
        for keys in [false, true] {
            let bare = Phase {
                route: Route::Bare,
                baseline: None,
                keys,
                stale: false,
                connections: c,
            };
            let mut pairs: Vec<(String, Route, Phase)> = FLOORS
                .iter()
                .map(|&(route, what)| (format!("{what} ÷ the bare proxy"), route, bare))
                .collect();
            pairs.extend(FLOORS.iter().map(|&(route, what)| {
                (
                    format!("railguard ÷ {what}"),
                    Route::Fenced,
                    Phase { route, ..bare },
                )
            }));
            for (what, route, other) in pairs {
                let mut ratios = self.per_repetition(route, other, c);
                if ratios.is_empty() {
                    continue;
                }
                ratios.sort_by(f64::total_cmp);
                let listed: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
                lines.push(format!(
                    "| {what}, {} | {} |",
                    if keys { "with keys" } else { "no keys" },
                    listed.join(", ")
                ));
            }
        }
        if lines.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\nCPU per request, ratio per repetition (lowest to highest; each repetition's two \
             phases ran a phase or two apart):\n\n| ratio | per repetition |\n|---|---|"
        );
        for line in lines {
            let _ = writeln!(out, "{line}");
        }
    }

    /// The fenced forward with the cross-process order off, and through the baseline binary,
    /// each against the default build's in the same run: the ratio of their medians.
    fn variants(&self, out: &mut String) {
        let c = self.options.connections;
        let variants: Vec<Phase> = self
            .samples
            .iter()
            .map(|(p, _)| *p)
            .filter(|p| {
                matches!(p.route, Route::Unordered | Route::Baseline | Route::PerCore)
                    && p.connections == c
            })
            .collect();
        if variants.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\nThe fenced forward against its variants, medians of this run ({c} connections; \
             ratio = default ÷ variant: above 1 the default costs more):\n\n\
             | requests | variant | railguard CPU µs/req: default | variant | ratio | ratio per repetition: lowest–highest | ctx sw/req: default | variant | PostgreSQL CPU µs/req: default | variant | ratio | req/s: default | variant | ratio |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for variant in variants {
            let (Some(default), Some(v)) = (
                self.find(Route::Fenced, variant.keys, variant.stale, c),
                self.find(variant.route, variant.keys, variant.stale, c),
            ) else {
                continue;
            };
            let ratio = |a: f64, b: f64| {
                if a > 0.0 && b > 0.0 {
                    format!("{:.3}", a / b)
                } else {
                    "—".into()
                }
            };
            let spread = match self.paired(variant, c) {
                Some((low, high)) => format!("{low:.3}–{high:.3}"),
                None => "—".into(),
            };
            let name = match variant.route {
                Route::Unordered => "`fencing.order_across_processes = false`".to_string(),
                Route::PerCore => format!(
                    "{} processes × 1 runtime thread, `proxy.reuse_port`",
                    self.cpus
                ),
                _ => format!("railguard {}", variant.baseline.unwrap_or("baseline")),
            };
            let _ = writeln!(
                out,
                "| {} | {name} | {:.1} | {:.1} | {} | {spread} | {:.2} | {:.2} | {:.1} | {:.1} | {} | {:.0} | {:.0} | {} |",
                match (variant.stale, variant.keys) {
                    (true, _) => "stale token → 409",
                    (false, true) => "with keys",
                    (false, false) => "no keys",
                },
                default.proxy_us,
                v.proxy_us,
                ratio(default.proxy_us, v.proxy_us),
                default.switches,
                v.switches,
                default.postgres_us,
                v.postgres_us,
                ratio(default.postgres_us, v.postgres_us),
                default.rate,
                v.rate,
                ratio(default.rate, v.rate),
            );
        }
    }

    /// The targets (docs/performance.md) against this run.
    fn targets(&self, out: &mut String) {
        let c = self.options.connections;
        let (Some(nginx), Some(direct)) = (
            self.find(Route::Nginx, true, false, c),
            self.find(Route::Direct, true, false, c),
        ) else {
            return;
        };
        let keyed = self.find(Route::Fenced, true, false, c).unwrap_or_default();
        let unkeyed = self
            .find(Route::Fenced, false, false, c)
            .unwrap_or_default();
        let off = self
            .find(Route::RailguardOff, false, false, c)
            .unwrap_or_default();
        let stale = self.find(Route::Fenced, false, true, c).unwrap_or_default();
        let met = |ok: bool| if ok { "met" } else { "**not met**" };
        let _ = writeln!(
            out,
            "\nThe targets (docs/performance.md), from this run:\n\n| target | measured | |\n|---|---|---|"
        );
        let r = keyed.rate / nginx.rate.max(1e-9);
        let _ = writeln!(
            out,
            "| fenced with keys ≥ 0.6× nginx | {r:.2}× | {} |",
            met(r >= 0.6)
        );
        let r = off.rate / nginx.rate.max(1e-9);
        let _ = writeln!(
            out,
            "| fencing off ≥ 0.8× nginx | {r:.2}× | {} |",
            met(r >= 0.8)
        );
        for (what, m) in [("fenced, with keys", keyed), ("fenced, no keys", unkeyed)] {
            let r = m.proxy_us / nginx.proxy_us.max(1e-9);
            let _ = writeln!(
                out,
                "| CPU per request ≤ 1.5× nginx's ({what}) | {:.1} µs vs {:.1} µs: {r:.2}× | {} |",
                m.proxy_us,
                nginx.proxy_us,
                met(r <= 1.5)
            );
            let _ = writeln!(
                out,
                "| context switches per request ≤ nginx's ({what}) | {:.2} vs {:.2} | {} |",
                m.switches,
                nginx.switches,
                met(m.switches <= nginx.switches)
            );
        }
        for (what, m) in [("with keys", keyed), ("no keys", unkeyed)] {
            let _ = writeln!(
                out,
                "| PostgreSQL CPU per fenced request ≤ 20 µs ({what}) | {:.1} µs in all, {:.1} µs in its sessions | {} |",
                m.postgres_us,
                m.postgres_backend_us,
                met(m.postgres_us <= 20.0)
            );
        }
        let r = stale.rate / direct.rate.max(1e-9);
        let _ = writeln!(
            out,
            "| stale rejections ≥ 0.9× direct | {r:.2}× | {} |",
            met(r >= 0.9)
        );
        if let (Some(d1), Some(k1), Some(pg1)) = (
            self.find(Route::Direct, true, false, 1),
            self.find(Route::Fenced, true, false, 1),
            self.find(Route::Pgbench, false, false, 1),
        ) {
            let added = (k1.p50_us - d1.p50_us) / 1000.0;
            let bound = pg1.p50_us / 1000.0 + 0.1;
            let _ = writeln!(
                out,
                "| added p50 at 1 connection ≤ one durable commit + 0.1 ms (with keys) | {added:.3} ms vs {bound:.3} ms | {} |",
                met(added <= bound)
            );
            // Over the cheapest forward the same libraries make: what railguard's own work adds.
            for (keys, what) in [(false, "no keys"), (true, "with keys")] {
                if let (Some(bare), Some(fenced)) = (
                    self.find(Route::Bare, keys, false, 1),
                    self.find(Route::Fenced, keys, false, 1),
                ) {
                    let added = (fenced.p50_us - bare.p50_us) / 1000.0;
                    let _ = writeln!(
                        out,
                        "| added p50 at 1 connection over the bare hyper proxy ≤ one durable commit + 0.1 ms ({what}) | {added:.3} ms vs {bound:.3} ms | {} |",
                        met(added <= bound)
                    );
                }
            }
        }
    }

    /// What the machine leaves railguard and PostgreSQL per request at the throughput targets:
    /// every process of the run shares the same CPUs, so a target rate fixes the CPU there is
    /// per request, and wrk and the upstream take their part of it first.
    fn budgets(&self, out: &mut String) {
        let c = self.options.connections;
        let Some(nginx) = self.find(Route::Nginx, true, false, c) else {
            return;
        };
        let targets = [
            (
                "fenced with keys ≥ 0.6× nginx",
                0.6,
                self.find(Route::Fenced, true, false, c),
            ),
            (
                "fencing off ≥ 0.8× nginx",
                0.8,
                self.find(Route::RailguardOff, false, false, c),
            ),
        ];
        let mut rows = Vec::new();
        for (what, share, phase) in targets {
            let Some(phase) = phase else { continue };
            let (Some(load), Some(nginx_load)) = (phase.load_us, nginx.load_us) else {
                continue;
            };
            let taken = (load + phase.upstream_us).min(nginx_load + nginx.upstream_us);
            let b = Budget::at(self.cpus, share * nginx.rate, taken);
            rows.push(format!(
                "| {what} | {:.0} | {:.1} | {taken:.1} | {:.1} | {:.1} | {:.1} |",
                b.rate, b.machine_us, b.left_us, phase.proxy_us, phase.postgres_us
            ));
        }
        if rows.is_empty() {
            // wrk's own CPU is read from this process's reaped children, which a profiler or
            // a syscall count running beside it would mix in.
            let _ = writeln!(
                out,
                "\nWhat the machine leaves at the throughput targets: not computed, wrk's own CPU \
                 was not measured in this run (a profiler or `perf stat` ran beside it)."
            );
            return;
        }
        let _ = writeln!(
            out,
            "\nWhat the machine leaves railguard and PostgreSQL at the throughput targets: at a \
             target rate the {} CPUs give every process of the run together {} × 10⁶ ÷ rate µs \
             per request; wrk and the upstream take theirs first (the lower of what they cost \
             per request in the phase itself and in the nginx phase, which ran faster). What is \
             left bounds what railguard and PostgreSQL may spend together, from above.\n\n\
             | target | req/s needed | machine CPU µs/req | wrk + upstream µs/req | left for railguard + PostgreSQL µs/req | this run: railguard µs/req | this run: PostgreSQL µs/req |\n\
             |---|---:|---:|---:|---:|---:|---:|",
            self.cpus, self.cpus
        );
        for row in rows {
            let _ = writeln!(out, "{row}");
        }
    }

    fn repetitions(&self, out: &mut String) {
        if !self.top_statements.is_empty() {
            let _ = writeln!(
                out,
                "\nPostgreSQL's statements by total execution time over the whole run \
                 (pg_stat_statements):\n\n\
                 | statement | calls | rows per call | µs per call | µs per row | plans per call | µs planning per call | WAL bytes per row | full-page images per row |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for st in &self.top_statements {
                let calls = st.calls.max(1) as f64;
                let rows = st.rows.max(1) as f64;
                let _ = writeln!(
                    out,
                    "| `{}` | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.0} | {:.3} |",
                    st.query.replace('|', "\\|"),
                    st.calls,
                    st.rows as f64 / calls,
                    st.total_ms * 1000.0 / calls,
                    st.total_ms * 1000.0 / rows,
                    st.plans as f64 / calls,
                    st.plan_ms * 1000.0 / calls,
                    st.wal_bytes / rows,
                    st.wal_full_page_images as f64 / rows
                );
            }
        }
        let _ = writeln!(
            out,
            "\nEvery repetition (req/s; the proxy's CPU µs per request where there is one), and \
             what was flagged:\n"
        );
        for (phase, samples) in &self.samples {
            let rates: Vec<String> = samples.iter().map(|s| format!("{:.0}", s.rate)).collect();
            let cpu: Vec<String> = samples
                .iter()
                .filter(|s| s.proxy_cpu > 0.0)
                .map(|s| format!("{:.1}", per_request_us(s.proxy_cpu, s.requests)))
                .collect();
            let _ = writeln!(
                out,
                "- {} (c={}): {}{}",
                phase.label(),
                phase.connections,
                rates.join(", "),
                if cpu.is_empty() {
                    String::new()
                } else {
                    format!("; proxy CPU µs/req {}", cpu.join(", "))
                }
            );
            for (i, s) in samples.iter().enumerate() {
                for problem in &s.problems {
                    let _ = writeln!(out, "  - repetition {}: {problem}", i + 1);
                }
            }
        }
    }
}

/// The CPU a machine has per request at a rate, and what is left of it once the processes that
/// are not under test (load generator, upstream) have taken `taken_us` per request.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Budget {
    rate: f64,
    machine_us: f64,
    left_us: f64,
}

impl Budget {
    fn at(cpus: usize, rate: f64, taken_us: f64) -> Self {
        let machine_us = cpus as f64 * 1e6 / rate.max(1e-9);
        Self {
            rate,
            machine_us,
            left_us: machine_us - taken_us,
        }
    }
}

fn nginx_version() -> String {
    std::process::Command::new("/usr/sbin/nginx")
        .arg("-v")
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stderr)
                .trim()
                .trim_start_matches("nginx version: nginx/")
                .to_string()
        })
        .unwrap_or_else(|| "?".into())
}

/// The floors of a fenced forward (`bare-proxy --fence-database`, without and with the last
/// look), as the report names them.
const FLOORS: [(Route, &str); 2] = [
    (
        Route::BareFenced,
        "the bare proxy with railguard's statements",
    ),
    (
        Route::BareLooked,
        "the bare proxy with railguard's statements and last look",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Repetitions of `cpus` CPU seconds over 1,000 requests each: µs per request = 1,000 × cpu.
    fn run(cpus: &[f64]) -> Vec<Sample> {
        cpus.iter()
            .map(|&cpu| Sample {
                requests: 1_000,
                proxy_cpu: cpu,
                ..Sample::default()
            })
            .collect()
    }

    /// This build's phase on `route` without keys, at 64 connections.
    fn unkeyed(route: Route) -> Phase {
        Phase {
            route,
            baseline: None,
            keys: false,
            stale: false,
            connections: 64,
        }
    }

    /// A report of `samples` on 2 CPUs (with a baseline build when `baseline`).
    fn report(baseline: bool, samples: Vec<(Phase, Vec<Sample>)>) -> WireReport {
        WireReport {
            options: crate::wire::tests::options(baseline),
            date: String::new(),
            postgres: String::new(),
            stale_accounts: 0,
            proxy_config: Config::default(),
            samples,
            cpus: 2,
            table_scans: Vec::new(),
            top_statements: Vec::new(),
        }
    }

    #[test]
    fn a_budget_is_the_machines_cpu_per_request_less_what_others_take() {
        // 2 CPUs at 40,000 req/s: 50 µs per request for everything; wrk and the upstream at
        // 21 µs leave 29.
        let b = Budget::at(2, 40_000.0, 21.0);
        assert!((b.machine_us - 50.0).abs() < 1e-9, "{b:?}");
        assert!((b.left_us - 29.0).abs() < 1e-9, "{b:?}");
        // Twice the rate halves what each request may cost.
        let faster = Budget::at(2, 80_000.0, 21.0);
        assert!((faster.machine_us - 25.0).abs() < 1e-9, "{faster:?}");
        assert!(faster.left_us < 5.0, "{faster:?}");
    }

    #[test]
    fn a_variants_spread_pairs_the_repetitions_that_ran_side_by_side() {
        let phase = |route| Phase {
            route,
            baseline: Some("earlier"),
            keys: true,
            stale: false,
            connections: 64,
        };
        let report = report(
            true,
            vec![
                (phase(Route::Fenced), {
                    // A fourth repetition, flagged: left out.
                    let mut samples = run(&[0.080, 0.100, 0.060, 0.300]);
                    samples[3].problems.push("socket errors".into());
                    samples
                }),
                (phase(Route::Baseline), run(&[0.100, 0.100, 0.040, 0.100])),
            ],
        );
        // Per repetition 0.8, 1.0 and 1.5; across unpaired medians it would be 0.8 / 1.0.
        let (low, high) = report.paired(phase(Route::Baseline), 64).unwrap();
        assert!(
            (low - 0.8).abs() < 1e-9 && (high - 1.5).abs() < 1e-9,
            "{low} {high}"
        );
        let mut unkeyed = phase(Route::Baseline);
        unkeyed.keys = false;
        assert_eq!(report.paired(unkeyed, 64), None, "no such phase ran");
        let table = report.to_markdown();
        assert!(table.contains("0.800–1.500"), "{table}");
    }

    #[test]
    fn the_floors_are_compared_with_the_bare_proxy_and_railguard_with_them_per_repetition() {
        let phase = unkeyed;
        let report = report(
            false,
            vec![
                // Repetitions that cross: the bare proxy's first is its slowest, the
                // floors' and railguard's first their fastest.
                (phase(Route::Bare), run(&[0.020, 0.010])),
                (phase(Route::BareFenced), run(&[0.012, 0.030])),
                (phase(Route::BareLooked), run(&[0.016, 0.032])),
                (phase(Route::Fenced), run(&[0.040, 0.048])),
            ],
        );
        let table = report.to_markdown();
        // Each ratio from the repetition its two phases ran in, lowest first: 12/20 and 30/10
        // (not the medians' 21/15, nor the sorted lists' 12/10 and 30/20).
        for line in [
            "| the bare proxy with railguard's statements ÷ the bare proxy, no keys | 0.60, 3.00 |",
            "| the bare proxy with railguard's statements and last look ÷ the bare proxy, no keys | 0.80, 3.20 |",
            "| railguard ÷ the bare proxy with railguard's statements and last look, no keys | 1.50, 2.50 |",
        ] {
            assert!(table.contains(line), "{line} not in\n{table}");
        }
        assert!(
            !table.contains("with keys |"),
            "no keyed phase ran, so no keyed ratio: {table}"
        );
    }

    #[test]
    fn context_switches_are_split_into_voluntary_and_involuntary_against_the_bare_proxy() {
        let phase = unkeyed;
        // Repetitions of (switches, involuntary) per 1,000 requests.
        let run = |reps: &[(u64, u64)]| {
            reps.iter()
                .map(|&(switches, involuntary)| Sample {
                    requests: 1_000,
                    proxy_switches: switches,
                    proxy_involuntary: involuntary,
                    ..Sample::default()
                })
                .collect::<Vec<_>>()
        };
        let report = report(
            false,
            vec![
                (phase(Route::Bare), run(&[(400, 300)])),
                // Medians: 0.900 in all, 0.650 involuntary; voluntary 0.100, 0.500 and 0.050,
                // whose median (0.100) is not the difference of the other two (0.250).
                (
                    phase(Route::Fenced),
                    run(&[(900, 800), (1_000, 500), (700, 650)]),
                ),
            ],
        );
        let table = report.to_markdown();
        for line in [
            "| the bare proxy, no keys | 0.100 | 1.00× | 0.300 | 1.00× | 0.400 | 1.00× |",
            "| railguard, no keys | 0.100 | 1.00× | 0.650 | 2.17× | 0.900 | 2.25× |",
        ] {
            assert!(table.contains(line), "{line} not in\n{table}");
        }
    }

    #[test]
    fn settings_from_the_environment_are_named_beside_the_default_configuration() {
        let mut plain = report(false, Vec::new());
        assert!(
            plain
                .to_markdown()
                .contains("- railguard serve: default configuration (log level"),
            "{}",
            plain.to_markdown()
        );
        plain.options.overrides = vec!["RAILGUARD__RUNTIME__WORKER_THREADS=1".into()];
        let table = plain.to_markdown();
        assert!(
            table.contains(
                "- railguard serve: default configuration, with the environment's overrides \
                 `RAILGUARD__RUNTIME__WORKER_THREADS=1` (log level"
            ),
            "{table}"
        );
    }
}
