#!/usr/bin/env bash
# Builds railguard and its fault harness (release) and runs `railguard harness "$@"`, e.g.
#   scripts/harness.sh --backend etcd --faults all --duration-s 300 --out /var/tmp/soak-etcd
#   scripts/harness.sh check /var/tmp/soak-etcd
# Installs what is missing first (the harness starts its own PostgreSQL and etcd).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh --test
cargo build --release --locked -p railguard --bin railguard -p railguard-harness --bin railguard-harness
target="${CARGO_TARGET_DIR:-target}"
exec "$target/release/railguard" harness "$@"
