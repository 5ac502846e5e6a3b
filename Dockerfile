# railguard: build with the Rust toolchain, run on Debian slim with the PostgreSQL server
# binaries available for `database.url = "embedded"` (point it at a real server in production).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY crates crates
COPY migrations migrations
COPY config config
# The OpenAPI document is compiled in (served at /openapi.yaml on the admin listener).
COPY docs docs
RUN cargo build --release --locked -p railguard --bin railguard

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql procps ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /var/lib/railguard railguard
COPY --from=build /src/target/release/railguard /usr/local/bin/railguard
COPY config/railguard.toml /etc/railguard/railguard.toml
USER railguard
ENV RAILGUARD__PROXY__LISTEN=0.0.0.0:8080 \
    RAILGUARD__ADMIN__LISTEN=0.0.0.0:9100 \
    RAILGUARD__LOCK__LISTEN=0.0.0.0:7070 \
    RAILGUARD__DATABASE__DATA_DIR=/var/lib/railguard/pg
# Marks and grants live here in embedded mode: keep it across container restarts.
VOLUME /var/lib/railguard
EXPOSE 8080 7070 9100
# railguard drains in up to four waits of shutdown.grace_ms (10 s) each — requests, late
# forwards, unanswered statements, idempotency outcomes; each ends as soon as nothing is left —
# and then stops PostgreSQL cleanly: give it longer than that, e.g. `docker stop -t 60`. A stop
# cut short leaves no clean-stop record (records in doubt then need --owner-stopped).
STOPSIGNAL SIGTERM
ENTRYPOINT ["railguard"]
CMD ["serve", "--config", "/etc/railguard/railguard.toml"]
