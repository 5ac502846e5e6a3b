#!/usr/bin/env bash
# Installs whatever the tests need and is missing, then runs every check and test.
#
#   scripts/test.sh            # from anywhere inside a clone
#
# Needs: a Rust toolchain (rustup), and root or sudo for apt-get when a package is missing.
# Installs (Debian/Ubuntu) what is missing of: postgresql (server binaries for throwaway test
# clusters), etcd-server (throwaway etcd members), protobuf-compiler and libprotobuf-dev
# (etcd-client's build needs protoc and the well-known protos).
# The tests start their own PostgreSQL and etcd instances on free loopback ports in temp
# dirs; they never touch a server already running on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

have_pg_server() {
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && return 0
    command -v pg_config >/dev/null && [ -x "$(pg_config --bindir)/initdb" ]
}

missing=()
have_pg_server || missing+=(postgresql)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v protoc >/dev/null || missing+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)

if ((${#missing[@]})); then
    echo "==> installing: ${missing[*]}"
    if [ "$(id -u)" -eq 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
        echo "error: need root or sudo to install ${missing[*]}" >&2; exit 1
    fi
    "${sudo[@]}" apt-get update -qq
    # Recommended packages stay on: libprotobuf-dev's well-known protos are needed.
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
    # The packages may start their own PostgreSQL or etcd; the tests do not use them.
fi

if ! command -v cargo >/dev/null; then
    echo "error: cargo not found; install Rust with rustup first" >&2
    exit 1
fi

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy"
cargo clippy --all-targets --locked -- -D warnings
echo "==> tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --locked --no-fail-fast
else
    cargo test --locked --no-fail-fast --all-targets
fi
echo "==> doc tests"
cargo test --locked --doc
