//! `railguard rail-sim`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use railguard::config::LogFormat;
use railguard::railsim::RailSim;
use railguard::{http, server, telemetry};

use super::config::rust_log;

/// Run the rail simulator: a non-idempotent payment rail, for tests and demos.
///
/// It accepts every POST as a new payment and lists what it received at GET /ledger, until
/// SIGTERM/SIGINT.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9090")]
    listen: SocketAddr,
    /// Delay before answering each payment, to make overlaps visible.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Random delay up to this long before a payment is recorded, so that requests can
    /// arrive in a different order than they were sent.
    #[arg(long, default_value_t = 0)]
    jitter_ms: u64,
    /// Behave like a payment API that deduplicates by Idempotency-Key: a second POST with
    /// a key already seen on the account is answered with the first one's response and is
    /// not a new payment.
    #[arg(long)]
    dedupe_idempotency_keys: bool,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let Args {
        listen,
        latency_ms,
        jitter_ms,
        dedupe_idempotency_keys,
    } = args;
    telemetry::init(LogFormat::Pretty, "info", rust_log().as_deref());
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => return super::fail_logged(&format!("cannot listen on {listen}: {e}")),
    };
    let mut sim = RailSim::new(Duration::from_millis(latency_ms))
        .with_jitter(Duration::from_millis(jitter_ms));
    if dedupe_idempotency_keys {
        sim = sim.deduplicating();
    }
    tracing::info!(%listen, latency_ms, jitter_ms, "rail simulator listening");
    http::serve(
        listener,
        move |_peer| {
            let sim = sim.clone();
            hyper::service::service_fn(move |request| sim.clone().handle(request))
        },
        server::shutdown_signal(),
        Duration::from_secs(5),
    )
    .await;
    ExitCode::SUCCESS
}
