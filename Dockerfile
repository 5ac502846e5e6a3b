# railguard: build with the Rust toolchain, run on Debian slim with the PostgreSQL server
# binaries available for `database.url = "embedded"` (point it at a real server in production).
#
#   docker build -t railguard .
#   docker run -e RAILGUARD__PROXY__UPSTREAM=http://rail.internal:9090 \
#       -p 8080:8080 -p 7070:7070 -v railguard:/var/lib/railguard railguard
#
# The image's config is config/container.toml: proxy and lock API on all interfaces, the
# admin listener on the container's loopback only (see that file to expose it), and no
# default rail: railguard refuses to start until RAILGUARD__PROXY__UPSTREAM is set.
FROM rust:1.95-bookworm AS build
# etcd-client's build script compiles the etcd API with protoc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies first, built against placeholder sources: this layer is rebuilt only when
# a manifest or Cargo.lock changes, not on every change to railguard's own code. Every
# workspace member's manifest is needed for cargo to read the workspace.
COPY Cargo.toml Cargo.lock ./
COPY crates/railguard-sdk/Cargo.toml crates/railguard-sdk/Cargo.toml
COPY crates/railguard-testkit/Cargo.toml crates/railguard-testkit/Cargo.toml
COPY crates/railguard-bench/Cargo.toml crates/railguard-bench/Cargo.toml
COPY crates/railguard-harness/Cargo.toml crates/railguard-harness/Cargo.toml
COPY crates/railguard-model/Cargo.toml crates/railguard-model/Cargo.toml
RUN for lib in src crates/railguard-sdk/src crates/railguard-testkit/src \
        crates/railguard-harness/src crates/railguard-model/src; do \
        mkdir -p "$lib" && touch "$lib/lib.rs"; \
    done \
 && for bin in src crates/railguard-bench/src crates/railguard-harness/src; do \
        echo 'fn main() {}' > "$bin/main.rs"; \
    done \
 && cargo build --release --locked -p railguard --bin railguard \
 && rm -rf src crates/*/src
COPY src src
COPY crates crates
COPY migrations migrations
COPY config config
# The OpenAPI document is compiled in (served at /openapi.yaml on the admin listener).
COPY docs docs
# The copied sources may be older than the placeholders: make cargo see them as changed.
RUN find src crates -name '*.rs' -exec touch {} + \
 && cargo build --release --locked -p railguard --bin railguard

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql procps ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /var/lib/railguard railguard
COPY --from=build /src/target/release/railguard /usr/local/bin/railguard
COPY config/container.toml /etc/railguard/railguard.toml
USER railguard
# Every command (serve, check-config, marks, …) reads this file without --config.
ENV RAILGUARD_CONFIG=/etc/railguard/railguard.toml
# Marks and grants live here in embedded mode: keep it across container restarts.
VOLUME /var/lib/railguard
# The proxy and the lock API. The admin listener (9100) listens inside the container only.
EXPOSE 8080 7070
# Liveness, from inside the container (the admin listener is on its loopback): /healthz
# answers while the process serves. /readyz (PostgreSQL answers, schema current, token source
# checked) is for a load balancer deciding where to send traffic.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD curl -fsS --max-time 2 http://127.0.0.1:9100/healthz || exit 1
# railguard drains within shutdown.grace_ms (10 s) of the signal — requests, late forwards,
# unanswered statements, idempotency outcomes; sooner as soon as nothing is left — and then
# stops PostgreSQL cleanly: give it longer than that, e.g. `docker stop -t 30`. A stop
# cut short leaves no clean-stop record (records in doubt then need --owner-stopped). SIGHUP
# (`docker kill -s HUP`) reloads credentials, TLS files and log.level (docs/operations.md).
STOPSIGNAL SIGTERM
ENTRYPOINT ["railguard"]
CMD ["serve"]
