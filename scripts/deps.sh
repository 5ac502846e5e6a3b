#!/usr/bin/env bash
# Installs (Debian/Ubuntu, with apt-get) whatever railguard needs to build, run and test and is
# missing. Sourced by scripts/run.sh and scripts/test.sh; safe to run on its own.
#
#   postgresql                          server binaries: the embedded database, test clusters
#   protobuf-compiler, libprotobuf-dev  protoc and the well-known protos, for etcd-client's build
#   etcd-server                         throwaway etcd members for the tests (only with --test)
set -euo pipefail

have_pg_server() {
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && return 0
    command -v pg_config >/dev/null && [ -x "$(pg_config --bindir)/initdb" ]
}

missing=()
have_pg_server || missing+=(postgresql)
command -v protoc >/dev/null || missing+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
if [ "${1:-}" = "--test" ]; then
    command -v etcd >/dev/null || missing+=(etcd-server)
fi

if ((${#missing[@]})); then
    echo "==> installing: ${missing[*]}"
    if [ "$(id -u)" -eq 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
        echo "error: need root or sudo to install ${missing[*]}" >&2; exit 1
    fi
    "${sudo[@]}" apt-get update -qq
    # Recommended packages stay on: libprotobuf-dev's well-known protos are needed.
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
    # The packages may start their own PostgreSQL or etcd; railguard never uses them.
fi

if ! command -v cargo >/dev/null; then
    echo "error: cargo not found; install Rust with rustup first" >&2
    exit 1
fi
