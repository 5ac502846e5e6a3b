# railguard: build with the Rust toolchain, run on Debian slim with the PostgreSQL server
# binaries available for `database.url = "embedded"` (point it at a real server in production).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY config config
RUN cargo build --release --locked --bin railguard

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /var/lib/railguard railguard
COPY --from=build /src/target/release/railguard /usr/local/bin/railguard
COPY config/railguard.toml /etc/railguard/railguard.toml
USER railguard
ENV RAILGUARD__PROXY__LISTEN=0.0.0.0:8080 \
    RAILGUARD__ADMIN__LISTEN=0.0.0.0:9100 \
    RAILGUARD__DATABASE__DATA_DIR=/var/lib/railguard/pg
EXPOSE 8080 9100
STOPSIGNAL SIGTERM
ENTRYPOINT ["railguard"]
CMD ["serve", "--config", "/etc/railguard/railguard.toml"]
