#!/usr/bin/env bash
# Runs railguard on the embedded default: installs what is missing to build and run it, then
# `railguard serve --config config/railguard.toml` (arguments replace the config path:
# scripts/run.sh --config other.toml). It starts its own PostgreSQL in /var/tmp/railguard/pg
# and proxies to the rail at 127.0.0.1:9090 (`cargo run --release -- rail-sim` is one).
#
# scripts/run.sh demo [--backend etcd]: `railguard demo` instead — T-042 played and checked in
# one process, on its own PostgreSQL in a temp dir (etcd: the `etcd` on PATH), then it exits.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
if [ "${1:-}" = "demo" ]; then
    shift
    exec cargo run --release --locked --bin railguard -- demo "$@"
fi
if (($#)); then args=("$@"); else args=(--config config/railguard.toml); fi
exec cargo run --release --locked --bin railguard -- serve "${args[@]}"
