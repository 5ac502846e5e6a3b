#!/usr/bin/env bash
# Builds railguard and its benchmark (crates/railguard-bench) in release mode and runs the benchmark, which prints a markdown table
# (the one in BENCHMARKS.md) on stdout; progress goes to stderr. Arguments are passed through:
#
#   scripts/bench.sh                                   # defaults: 5 s x 3 repetitions, 64 connections
#   scripts/bench.sh --duration-secs 3 --repeats 3     # quicker
#   scripts/bench.sh --suite locks                     # one suite: proxy, locks, etcd (default all)
#   scripts/bench.sh --suite wire                      # railguard against nginx, each its own process, under wrk
#   scripts/bench.sh --suite statements                # what each of railguard's statements costs PostgreSQL alone
#   scripts/bench.sh --help                            # every option
#
# Installs what is missing: what the build needs and the PostgreSQL server binaries
# (scripts/deps.sh), for the etcd suite etcd-server, for the wire suite nginx-light and wrk; when
# run as root the
# throwaway cluster runs as the `postgres` user. Everything listens on 127.0.0.1 only.
set -euo pipefail

cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/railguard-target}"

# What the build needs (protoc for etcd-client) and the PostgreSQL server binaries.
scripts/deps.sh
# What the suites asked for need: the wire suite nginx and wrk, the etcd suite (and the default,
# every suite) an etcd binary.
missing=()
case " $* " in
*" --suite wire "* | *" --suite=wire "*)
    [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
    command -v wrk >/dev/null || missing+=(wrk)
    ;;
*" --suite proxy "* | *" --suite=proxy "* | *" --suite locks "* | *" --suite=locks "* | \
    *" --suite statements "* | *" --suite=statements "*) ;;
*) command -v etcd >/dev/null || missing+=(etcd-server) ;;
esac
if ((${#missing[@]})); then
    echo "==> installing: ${missing[*]}" >&2
    if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

cargo build --release --quiet --locked -p railguard --bin railguard -p railguard-bench --bin railguard-bench \
    --bin bare-proxy

commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! git diff --quiet HEAD -- 2>/dev/null; then
    commit="$commit (with uncommitted changes)"
fi

# The RSS measurement holds 1,000 client connections open to a separate `railguard serve`;
# this process holds their other ends and the rail simulator's, so both need the descriptors.
# (The crate forbids unsafe code, so it cannot raise the limit itself.)
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt 8192 ]; then
    ulimit -n 8192
fi

"$CARGO_TARGET_DIR/release/railguard-bench" "$@"
echo
echo "Commit: $commit. Regenerate with: \`scripts/bench.sh${*:+ $*}\`"
