#!/usr/bin/env bash
# Runs railguard on the embedded default: installs what is missing to build and run it, then
# `railguard serve --config config/railguard.toml` (arguments replace the config path:
# scripts/run.sh --config other.toml). It starts its own PostgreSQL in /var/tmp/railguard/pg
# and proxies to the rail at 127.0.0.1:9090 (`cargo run --release -- rail-sim` is one).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
if (($#)); then args=("$@"); else args=(--config config/railguard.toml); fi
exec cargo run --release --locked --bin railguard -- serve "${args[@]}"
