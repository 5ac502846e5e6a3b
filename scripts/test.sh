#!/usr/bin/env bash
# Installs whatever the tests need and is missing, then runs every check and test.
#
#   scripts/test.sh            # from anywhere inside a clone
#
# Needs: a Rust toolchain (rustup), and root or sudo for apt-get when a package is missing.
# Installs what is missing (scripts/deps.sh --test): postgresql, etcd-server, prometheus
# (promtool), protobuf-compiler and libprotobuf-dev, and cargo-fuzz from crates.io.
# Last, every fuzz target runs for FUZZ_SECONDS (default 15) each (scripts/fuzz.sh); its build
# goes to $CARGO_TARGET_DIR/fuzz. FUZZ_SECONDS=0 skips it.
# The tests start their own PostgreSQL, etcd and Prometheus instances on free loopback ports
# in temp dirs; they never touch a server already running on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh --test

echo "==> promtool: alert rules and their unit tests"
promtool check rules config/prometheus/railguard.rules.yml
promtool test rules config/prometheus/railguard.rules.test.yml

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --locked --no-fail-fast
else
    cargo test --workspace --locked --no-fail-fast --all-targets
fi
echo "==> doc tests"
cargo test --workspace --locked --doc
echo "==> docs (broken links are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --locked --no-deps --quiet
if [ "${FUZZ_SECONDS:-15}" != 0 ]; then
    echo "==> fuzz targets, ${FUZZ_SECONDS:-15}s each"
    scripts/fuzz.sh "${FUZZ_SECONDS:-15}"
fi
