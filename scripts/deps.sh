#!/usr/bin/env bash
# Installs (Debian/Ubuntu, with apt-get) whatever railguard needs to build, run and test and is
# missing. Sourced by scripts/run.sh and scripts/test.sh; safe to run on its own.
#
#   postgresql                          server binaries: the embedded database, test clusters
#   protobuf-compiler, libprotobuf-dev  protoc and the well-known protos, for etcd-client's build
#   etcd-server                         throwaway etcd members for the tests (only with --test)
#   etcd-client                         etcdctl: snapshots and restores of those members (only
#                                       with --test)
#   patroni, python3-etcd               throwaway high-availability PostgreSQL clusters for the
#                                       failover tests (only with --test)
#   prometheus                          promtool for the alert rules' tests, and a throwaway
#                                       Prometheus for tests/operations/alerts.rs (only with --test)
#   openssl                             the test kit's private CA for the TLS tests (only with --test)
#   cargo-fuzz (crates.io)              builds and runs the fuzz targets in fuzz/ (only with --test)
set -euo pipefail

have_pg_server() {
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && return 0
    command -v pg_config >/dev/null && [ -x "$(pg_config --bindir)/initdb" ]
}

missing=()
have_pg_server || missing+=(postgresql)
command -v protoc >/dev/null || missing+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
# Installed without its recommended packages: prometheus-node-exporter would listen on
# 127.0.0.1:9100, railguard's default admin address.
bare=()
if [ "${1:-}" = "--test" ]; then
    command -v etcd >/dev/null || missing+=(etcd-server)
    command -v etcdctl >/dev/null || missing+=(etcd-client)
    # The test kit runs /usr/bin/patroni under /usr/bin/python3, whatever python is on PATH.
    [ -x /usr/bin/patroni ] || missing+=(patroni python3-etcd)
    command -v openssl >/dev/null || missing+=(openssl)
    { [ -x /usr/bin/promtool ] && [ -x /usr/bin/prometheus ]; } || bare+=(prometheus)
fi

all=("${missing[@]}" "${bare[@]}")
if ((${#all[@]})); then
    echo "==> installing: ${all[*]}"
    if [ "$(id -u)" -eq 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
        echo "error: need root or sudo to install ${all[*]}" >&2; exit 1
    fi
    "${sudo[@]}" apt-get update -qq
    # Recommended packages stay on: libprotobuf-dev's well-known protos are needed.
    if ((${#missing[@]})); then
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if ((${#bare[@]})); then
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
            "${bare[@]}" >/dev/null
    fi
    # The packages may start their own PostgreSQL, etcd or Prometheus (on :9090); railguard and
    # its tests never use them: the tests start their own on free loopback ports.
fi

if ! command -v cargo >/dev/null; then
    echo "error: cargo not found; install Rust with rustup first" >&2
    exit 1
fi

if [ "${1:-}" = "--test" ] && ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi
