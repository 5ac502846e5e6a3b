#!/usr/bin/env bash
# CPU profiles of the proxy processes under wrk load, grouped by where the time goes.
#
#   scripts/profile.sh                 # the wire suite once, 8 s per phase (64 connections, then one), profiles into /var/tmp/railguard-profile
#   scripts/profile.sh --group DIR     # only group the *.perf.data already in DIR
#   scripts/profile.sh --allocations   # allocations per request by call site (valgrind's DHAT), into /var/tmp/railguard-allocations
#
# Runs `railguard-bench --suite wire --profile-dir DIR` (perf record -e cpu-clock --call-graph
# dwarf on the proxy process of each proxy phase: nginx, the bare hyper proxy and railguard),
# then prints, per profile, the share of samples in each group of symbols (docs/performance.md
# explains them).
# Needs perf (apt-get install linux-perf) and what scripts/bench.sh needs. Profiling slows the
# proxies: the rates printed by a profiling run are not comparable with a plain run's.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=/var/tmp/railguard-profile
if [ "${1:-}" = "--allocations" ]; then
    exec scripts/allocations.sh
fi
if [ "${1:-}" = "--group" ]; then
    dir="${2:?usage: scripts/profile.sh --group DIR}"
else
    command -v perf >/dev/null || { echo "error: perf not found (apt-get install linux-perf)" >&2; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir"
    scripts/bench.sh --suite wire --duration-secs 8 --repeats 1 --latency-secs 8 \
        --profile-dir "$dir" > "$dir/wire.md"
fi

for data in "$dir"/*.perf.data; do
    echo "== $(basename "$data" .perf.data)"
    perf report -i "$data" --no-children --sort dso,sym --stdio -g none 2>/dev/null |
        python3 -c '
import re, sys
groups = [
    ("kernel: scheduling and wake-ups", r"\[k\] .*(finish_task_switch|schedule|futex|try_to_wake_up|_raw_spin_unlock_irq|select_task_rq|enqueue|dequeue|update_curr|psi_|switch_mm|__switch_to|ttwu)"),
    ("kernel: epoll", r"\[k\] .*(ep_|epoll)"),
    ("kernel: TCP/IP and sockets", r"\[k\] .*(tcp|inet|ip_|skb|net_|sock|dev_|__netif|loopback|napi|bbr|softirq|__sys_(recv|send))"),
    ("kernel: other (syscall entry, VFS, timers)", r"\[k\] "),
    ("malloc/free", r"(malloc|_int_free|cfree|unlink_chunk|realloc|calloc|_int_realloc|tcache|\bmi_|_mi_)"),
    ("memmove/memcpy/memcmp", r"__mem(move|cpy|cmp|set)"),
    ("tracing", r"tracing"),
    ("mark cache", r"moka|crossbeam|mark_cache"),
    ("PostgreSQL client", r"tokio_postgres|postgres_protocol|deadpool|postgres_types"),
    ("hyper and http", r"hyper|httparse|http::|h2::|http_body"),
    ("tokio runtime and timers", r"tokio::"),
    ("railguard", r"railguard"),
    ("nginx", r"ngx_|nginx"),
]
totals = {}
for line in sys.stdin:
    m = re.match(r"\s*([0-9.]+)%\s+(\S+)\s+(.*)", line)
    if not m:
        continue
    pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
    name = "other user space (" + dso + ")"
    for label, pattern in groups:
        if re.search(pattern, sym):
            name = label
            break
    totals[name] = totals.get(name, 0.0) + pct
for name, pct in sorted(totals.items(), key=lambda kv: -kv[1]):
    if pct >= 0.5:
        print(f"  {pct:5.1f}%  {name}")
'
done
