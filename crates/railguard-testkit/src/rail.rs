//! The rail simulator served in-process on a port-0 listener, its ledger readable directly.
//!
//! The simulator sits behind a switch, so that [`Rail::clear_ledger`] can swap in an empty one
//! (configured as the first) between two runs: the benchmark does so around each measured run,
//! which keeps memory bounded and lets it check exactly what the rail received in that run.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use railguard::railsim::{LedgerEntry, RailSim};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::LaunchError;

/// Makes a fresh simulator, configured as the rail's first one was.
type NewSim = Arc<dyn Fn() -> RailSim + Send + Sync>;

/// The rail simulator, served in-process on a free port.
pub struct Rail {
    pub addr: SocketAddr,
    /// The simulator serving requests now.
    current: Arc<Mutex<RailSim>>,
    new_sim: NewSim,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Rail {
    pub async fn start() -> Rail {
        Self::with_latency(Duration::ZERO).await
    }

    /// [`start`](Self::start), for callers that report rather than panic (the benchmark).
    pub async fn try_start() -> Result<Rail, LaunchError> {
        Self::launch(Arc::new(|| RailSim::new(Duration::ZERO))).await
    }

    pub async fn with_latency(latency: Duration) -> Rail {
        Self::with_sim(Arc::new(move || RailSim::new(latency))).await
    }

    /// A rail behind a network path of variable delay (up to `jitter` before arrival).
    pub async fn with_jitter(latency: Duration, jitter: Duration) -> Rail {
        Self::with_sim(Arc::new(move || RailSim::new(latency).with_jitter(jitter))).await
    }

    /// A rail that deduplicates by `Idempotency-Key`, as most payment APIs do.
    pub async fn deduplicating() -> Rail {
        Self::with_sim(Arc::new(|| RailSim::new(Duration::ZERO).deduplicating())).await
    }

    /// Repeats of a seen idempotency key the rail answered without a new payment.
    pub fn absorbed(&self) -> u64 {
        self.sim().absorbed()
    }

    async fn with_sim(new_sim: NewSim) -> Rail {
        Self::launch(new_sim)
            .await
            .unwrap_or_else(|e| panic!("rail simulator: {e}"))
    }

    async fn launch(new_sim: NewSim) -> Result<Rail, LaunchError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| LaunchError::Io { what, source }
        };
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(io("cannot bind the rail simulator"))?;
        let addr = listener
            .local_addr()
            .map_err(io("the rail simulator's address"))?;
        let current = Arc::new(Mutex::new(new_sim()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let switch = current.clone();
        let task = tokio::spawn(railguard::http::serve(
            listener,
            move |_| {
                let switch = switch.clone();
                hyper::service::service_fn(move |request| {
                    let sim = switch.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    sim.handle(request)
                })
            },
            async move {
                let _ = stopped.await;
            },
            Duration::from_secs(1),
        ));
        Ok(Rail {
            addr,
            current,
            new_sim,
            stop: Some(stop),
            task: Some(task),
        })
    }

    fn sim(&self) -> RailSim {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn ledger(&self) -> Vec<LedgerEntry> {
        self.sim().ledger()
    }

    /// The fencing token of every arrival, in arrival order.
    pub fn tokens(&self) -> Vec<i64> {
        self.ledger()
            .iter()
            .map(|e| e.token.as_deref().and_then(|t| t.parse().ok()).unwrap_or(0))
            .collect()
    }

    /// Waits until the rail has received at least `payments` (fails the test after 10 s).
    pub async fn until_paid(&self, payments: usize) {
        crate::until(
            Duration::from_secs(10),
            format!("{payments} payments at the rail"),
            || async move { self.ledger().len() >= payments },
        )
        .await
    }

    /// Fails the test, showing the ledger, unless the rail has received exactly `payments`;
    /// `why` says what that number means.
    #[track_caller]
    pub fn assert_paid(&self, payments: usize, why: &str) {
        let ledger = self.ledger();
        assert_eq!(ledger.len(), payments, "{why}: {ledger:#?}");
    }

    /// How many arrivals carried idempotency key `key`.
    pub fn times_paid(&self, key: &str) -> usize {
        self.ledger()
            .iter()
            .filter(|e| e.idempotency_key.as_deref() == Some(key))
            .count()
    }

    /// Swaps in an empty ledger (a fresh simulator, configured as this one) and returns how
    /// many payments the old one had received. A payment still in flight at the swap lands
    /// in the old ledger, uncounted.
    pub fn clear_ledger(&self) -> usize {
        let fresh = (self.new_sim)();
        let old = std::mem::replace(
            &mut *self.current.lock().unwrap_or_else(|p| p.into_inner()),
            fresh,
        );
        old.ledger().len()
    }

    /// Stops serving and waits until the server has (open connections get a second).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Rail {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
