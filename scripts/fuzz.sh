#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time; exits non-zero on a crash.
#
#   scripts/fuzz.sh [seconds-per-target]     # default 30
#
# Targets: fence_headers, lock_api_json, config_loader, idempotency_fingerprint (docs/development.md,
# "Fuzzing"). Each starts from its seed corpus in fuzz/corpus/<target>/, which it only reads:
# what the run finds goes to a work corpus under the build directory, so the clone stays clean.
# A crash leaves its input in fuzz/artifacts/<target>/; replay it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run <target> fuzz/artifacts/<target>/<file>
#
# cargo-fuzz needs nightly flags: RUSTC_BOOTSTRAP=1 lets the stable toolchain take them. It
# installs cargo-fuzz from crates.io if missing. The build goes to $CARGO_TARGET_DIR/fuzz (or
# fuzz/target), apart from the main build, whose cache it would otherwise invalidate.
# FUZZ_SANITIZER (default: address, cargo-fuzz's own default) picks the sanitizer; `none` runs
# more inputs per second (railguard's code forbids `unsafe`) but is a separate build.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
sanitizer="${FUZZ_SANITIZER:-address}"
targets=(fence_headers lock_api_json config_loader idempotency_fingerprint)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
target_dir="${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}"
target_dir="${target_dir:-$PWD/fuzz/target}"
work="$target_dir/work-corpus"

cd fuzz
echo "==> cargo fuzz build (sanitizer: $sanitizer)"
cargo fuzz build --sanitizer "$sanitizer" --target-dir "$target_dir"
for target in "${targets[@]}"; do
    echo "==> fuzz $target for ${seconds}s"
    mkdir -p "$work/$target"
    log="$work/$target.log"
    # -timeout: one input taking over 10 s is a hang, reported like a crash. libFuzzer's
    # progress lines go to the log; a failure prints its end (the panic and the input's path).
    if ! cargo fuzz run --sanitizer "$sanitizer" --target-dir "$target_dir" "$target" \
        "$work/$target" "corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1; then
        grep -m1 -A4 panicked "$log" || true
        tail -n 20 "$log"
        echo "error: fuzz target $target failed; its input is in fuzz/artifacts/$target/" >&2
        exit 1
    fi
    grep -E '^(Done|stat::number_of_executed_units|stat::average_exec_per_sec)' "$log" || true
    echo "corpus: $(find "$work/$target" -type f | wc -l) inputs (seeds: $(find "corpus/$target" -type f | wc -l))"
done
echo "==> fuzz: ${#targets[@]} targets ran ${seconds}s each without a crash"
