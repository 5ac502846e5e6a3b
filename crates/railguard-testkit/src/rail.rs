//! The rail simulator served in-process on a port-0 listener, its ledger readable directly.

use std::net::SocketAddr;
use std::time::Duration;

use railguard::railsim::{LedgerEntry, RailSim};
use tokio::net::TcpListener;

/// The rail simulator, served in-process on a free port.
pub struct Rail {
    pub addr: SocketAddr,
    sim: RailSim,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Rail {
    pub async fn start() -> Rail {
        Self::with_latency(Duration::ZERO).await
    }

    pub async fn with_latency(latency: Duration) -> Rail {
        Self::with_sim(RailSim::new(latency)).await
    }

    /// A rail behind a network path of variable delay (up to `jitter` before arrival).
    pub async fn with_jitter(latency: Duration, jitter: Duration) -> Rail {
        Self::with_sim(RailSim::new(latency).with_jitter(jitter)).await
    }

    /// A rail that deduplicates by `Idempotency-Key`, as most payment APIs do.
    pub async fn deduplicating() -> Rail {
        Self::with_sim(RailSim::new(Duration::ZERO).deduplicating()).await
    }

    /// Repeats of a seen idempotency key the rail answered without a new payment.
    pub fn absorbed(&self) -> u64 {
        self.sim.absorbed()
    }

    async fn with_sim(sim: RailSim) -> Rail {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind rail");
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = sim.clone();
        tokio::spawn(railguard::http::serve(
            listener,
            move |_| {
                let sim = served.clone();
                hyper::service::service_fn(move |r| sim.clone().handle(r))
            },
            async move {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Rail {
            addr,
            sim,
            stop: Some(stop),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.sim.ledger()
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
