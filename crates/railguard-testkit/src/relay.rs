//! A TCP relay on a free loopback port that can delay what crosses it: a slow network path
//! between two real processes (railguard and PostgreSQL, railguard and the rail).
//!
//! Every chunk read from one side is written to the other `delay` after it was read, in order,
//! so a delay models latency, not loss. The delay is read when a chunk arrives and can be
//! changed at any time; it applies to both directions. [`Relay::set_jitter`] adds to each
//! chunk a random delay of its own, up to a maximum: a path whose latency varies from packet
//! to packet. A connection's bytes still arrive in the order they were sent (a chunk never
//! overtakes the one before it), while connections overtake each other. Dropping the relay
//! stops accepting; connections already open keep running until either side closes; a close
//! reaches the other side half a second after the last data.
//!
//! [`Relay::cut_for`] is a partition of that path: every open connection is closed at once,
//! and connections made for a while are accepted and closed straight away.
//!
//! [`Relay::stall_first`] is a path that goes silent under one connection and stays open: the
//! first chunk sent towards the target that a test picks, and everything after it on that
//! connection, is held until [`Relay::release_stalled`]. Nothing is lost or closed, so none of
//! the sender's timeouts that need a closed or unacknowledged connection fire — as with a
//! stopped backend, or a middlebox holding one flow.
//!
//! [`Relay::reset_sources`] is a middlebox that resets the connections of the side that opened
//! them (the sender gets a connection reset) while still delivering to the target, delayed or
//! stalled as before, what it had already read from them: the sender takes its request as
//! lost, and the target receives it later all the same.
//!
//! [`Relay::rewrite_towards_target`] is a middlebox that changes what it passes on: every
//! chunk sent towards the target goes through a function first (a PostgreSQL pooler that drops
//! startup options, say: [`crate::without_startup_settings`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub struct Relay {
    pub addr: SocketAddr,
    delay: Arc<Mutex<Delay>>,
    cut: Arc<Cut>,
    stall: Arc<Stall>,
    rewrite: Arc<Mutex<Option<Rewrite>>>,
    /// Counts [`Relay::reset_sources`]; each open connection watches it.
    resets: tokio::sync::watch::Sender<u64>,
    accept: tokio::task::JoinHandle<()>,
}

/// How late a chunk is written: `fixed`, plus a random part up to `jitter` drawn per chunk.
#[derive(Debug, Clone, Copy)]
struct Delay {
    fixed: Duration,
    jitter: Duration,
    /// The state of the generator the random parts are drawn from (splitmix64).
    state: u64,
}

impl Delay {
    fn new(seed: u64) -> Self {
        Self {
            fixed: Duration::ZERO,
            jitter: Duration::ZERO,
            state: seed,
        }
    }

    /// The next chunk's delay.
    fn draw(&mut self) -> Duration {
        if self.jitter.is_zero() {
            return self.fixed;
        }
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let span = self.jitter.as_micros() as u64 + 1;
        self.fixed + Duration::from_micros(z % span)
    }
}

/// Changes a chunk sent towards the target.
type Rewrite = Box<dyn FnMut(&[u8]) -> Vec<u8> + Send>;

/// Picks the chunk that stalls its connection.
type Trap = Box<dyn FnMut(&[u8]) -> bool + Send>;

/// Which chunk stalls its connection (taken by the first that matches), and the word that
/// lets the stalled connections go.
struct Stall {
    trap: Mutex<Option<Trap>>,
    released: tokio::sync::watch::Sender<bool>,
}

impl Stall {
    /// Whether `chunk` springs the trap (which then disarms).
    fn springs(&self, chunk: &[u8]) -> bool {
        let mut trap = self.trap.lock().unwrap();
        if trap.as_mut().is_some_and(|matches| matches(chunk)) {
            *trap = None;
            return true;
        }
        false
    }
}

/// The relay's partition state: until when new connections are refused, and the tasks of the
/// connections open now (aborting one closes both of its sockets).
#[derive(Default)]
struct Cut {
    until: Mutex<Option<Instant>>,
    open: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Cut {
    fn refusing(&self) -> bool {
        self.until
            .lock()
            .unwrap()
            .is_some_and(|until| Instant::now() < until)
    }
}

impl Relay {
    /// Relays every connection made to [`Relay::addr`] to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().unwrap();
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(addr.port());
        let delay = Arc::new(Mutex::new(Delay::new(seed)));
        let cut = Arc::new(Cut::default());
        let stall = Arc::new(Stall {
            trap: Mutex::new(None),
            released: tokio::sync::watch::channel(false).0,
        });
        let rewrite: Arc<Mutex<Option<Rewrite>>> = Arc::default();
        let resets = tokio::sync::watch::channel(0u64).0;
        let (shared, shared_cut, shared_stall) = (delay.clone(), cut.clone(), stall.clone());
        let (shared_rewrite, shared_resets) = (rewrite.clone(), resets.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if shared_cut.refusing() {
                    drop(client);
                    continue;
                }
                let delay = shared.clone();
                let stall = shared_stall.clone();
                let rewrite = shared_rewrite.clone();
                // Only resets from now on reach this connection.
                let reset = shared_resets.subscribe();
                let task = tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        pump(
                            client_read,
                            server_write,
                            delay.clone(),
                            Some(stall),
                            Some(rewrite),
                            Some((reset.clone(), SourceEnd::Read)),
                        ),
                        pump(
                            server_read,
                            client_write,
                            delay,
                            None,
                            None,
                            Some((reset, SourceEnd::Write)),
                        )
                    );
                });
                let mut open = shared_cut.open.lock().unwrap();
                open.retain(|t| !t.is_finished());
                open.push(task.abort_handle());
            }
        });
        Relay {
            addr,
            delay,
            cut,
            stall,
            rewrite,
            resets,
            accept,
        }
    }

    /// Resets every connection open now on the side of its source: the source's socket gets a
    /// reset (RST) and nothing more from the target, while what the relay already read from the
    /// source still goes to the target — after its delay, or once released if it is stalled
    /// ([`Relay::stall_first`]) — followed by the close. Connections made afterwards carry on
    /// as usual.
    pub fn reset_sources(&self) {
        self.resets.send_modify(|n| *n += 1);
    }

    /// Delays every chunk read from now on by `delay`, both ways.
    pub fn set_delay(&self, delay: Duration) {
        self.delay.lock().unwrap().fixed = delay;
    }

    /// Delays every chunk read from now on by a random `0..=max` more (drawn per chunk), both
    /// ways, on top of [`Relay::set_delay`]'s. A chunk is never written before the one read
    /// before it on its connection, so each connection's bytes keep their order; requests on
    /// different connections overtake each other. `Duration::ZERO` turns it off.
    pub fn set_jitter(&self, max: Duration) {
        self.delay.lock().unwrap().jitter = max;
    }

    /// A partition for `duration`: closes every connection open now and refuses new ones
    /// (accepts and closes them) until `duration` has passed.
    pub fn cut_for(&self, duration: Duration) {
        *self.cut.until.lock().unwrap() = Some(Instant::now() + duration);
        for task in self.cut.open.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// Stalls the connection of the first chunk sent towards the target for which `matches`
    /// is true: that chunk and everything after it on that connection is held, the
    /// connection left open, until [`Relay::release_stalled`]. Other connections carry on.
    pub fn stall_first(&self, matches: impl FnMut(&[u8]) -> bool + Send + 'static) {
        self.stall.released.send_replace(false);
        *self.stall.trap.lock().unwrap() = Some(Box::new(matches));
    }

    /// [`Relay::stall_first`] for the first chunk that contains `text` (a statement's text,
    /// say).
    pub fn stall_first_containing(&self, text: &'static [u8]) {
        self.stall_first(move |chunk| chunk.windows(text.len()).any(|w| w == text));
    }

    /// Whether the trap set by [`Relay::stall_first`] has caught a connection.
    pub fn has_stalled(&self) -> bool {
        self.stall.trap.lock().unwrap().is_none()
    }

    /// Passes every chunk read from now on towards the target through `rewrite` (the
    /// connections already open too).
    pub fn rewrite_towards_target(&self, rewrite: impl FnMut(&[u8]) -> Vec<u8> + Send + 'static) {
        *self.rewrite.lock().unwrap() = Some(Box::new(rewrite));
    }

    /// Lets every stalled connection go: what it holds is delivered, in order.
    pub fn release_stalled(&self) {
        self.stall.released.send_replace(true);
    }

    /// `postgres://` URL of a PostgreSQL reached through this relay (same user and database).
    pub fn postgres_url(&self, direct: &str) -> String {
        let port = direct
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .expect("a host:port URL");
        direct.replacen(&format!(":{port}/"), &format!(":{}/", self.addr.port()), 1)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Which half of the source's socket a pump holds, for [`Relay::reset_sources`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum SourceEnd {
    /// The pump reads from the source: on a reset it stops reading and resets the socket, and
    /// still writes what it read to the target.
    Read,
    /// The pump writes to the source: on a reset it stops at once, dropping its half.
    Write,
}

/// Resolves at the next [`Relay::reset_sources`] (never, once the relay is gone).
async fn reset_comes(reset: &mut tokio::sync::watch::Receiver<u64>) {
    if reset.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Copies `from` to `to`, each chunk `delay` late; `stall` and `rewrite`: this is the
/// direction towards the target, where [`Relay::stall_first`] may hold it and
/// [`Relay::rewrite_towards_target`] change it; `reset`: which half of the source's socket this
/// pump holds, for [`Relay::reset_sources`].
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<Mutex<Delay>>,
    stall: Option<Arc<Stall>>,
    rewrite: Option<Arc<Mutex<Option<Rewrite>>>>,
    reset: Option<(tokio::sync::watch::Receiver<u64>, SourceEnd)>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>, bool)>();
    let mut released = stall.as_ref().map(|s| s.released.subscribe());
    let (mut read_reset, mut write_reset) = match reset {
        Some((reset, SourceEnd::Read)) => (Some(reset), None),
        Some((reset, SourceEnd::Write)) => (None, Some(reset)),
        None => (None, None),
    };
    // In the connection's own task (not spawned), so that aborting it closes this side too.
    let writer = async move {
        while let Some((due, bytes, stalls)) = rx.recv().await {
            if let (true, Some(released)) = (stalls, released.as_mut()) {
                // Everything after this chunk queues behind it.
                let _ = released.wait_for(|go| *go).await;
            }
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        // The sender's FIN follows its data later, as across a real network: a server that
        // sees a request and its connection's end in one read may drop the request.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = to.shutdown().await;
    };
    // Writing to the source: a reset drops this half at once.
    let writer = async move {
        match write_reset.as_mut() {
            Some(reset) => tokio::select! {
                () = writer => {}
                () = reset_comes(reset) => {}
            },
            None => writer.await,
        }
    };
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let read = match read_reset.as_mut() {
                Some(reset) => tokio::select! {
                    read = from.read(&mut buf) => read,
                    () = reset_comes(reset) => {
                        // Closed with SO_LINGER 0 when this half goes (the other half is
                        // dropped by its own pump): the source gets a reset.
                        let _ = AsRef::<TcpStream>::as_ref(&from).set_zero_linger();
                        break;
                    }
                },
                None => from.read(&mut buf).await,
            };
            match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    // The writer takes chunks in order, so a chunk due earlier than the one
                    // before it waits for it: order within the connection holds.
                    let due = Instant::now() + delay.lock().unwrap().draw();
                    let stalls = stall.as_ref().is_some_and(|s| s.springs(&buf[..n]));
                    let chunk = match rewrite.as_ref().map(|r| r.lock().unwrap()) {
                        Some(mut guard) => match guard.as_mut() {
                            Some(rewrite) => rewrite(&buf[..n]),
                            None => buf[..n].to_vec(),
                        },
                        None => buf[..n].to_vec(),
                    };
                    if tx.send((due, chunk, stalls)).is_err() {
                        break;
                    }
                }
            }
        }
        drop(tx);
        drop(from);
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on a free loopback port.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn jitter_delays_each_chunk_within_its_bound_and_keeps_a_connections_order() {
        let relay = Relay::start(echo().await).await;
        let max = Duration::from_millis(40);
        relay.set_jitter(max);
        let mut conn = TcpStream::connect(relay.addr).await.unwrap();
        let began = Instant::now();
        let mut sent = Vec::new();
        for i in 0..30u8 {
            conn.write_all(&[i]).await.unwrap();
            sent.push(i);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let mut got = vec![0u8; sent.len()];
        tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut got))
            .await
            .expect("every byte came back")
            .unwrap();
        assert_eq!(got, sent, "one connection's bytes keep their order");
        // Each way at most `max` per chunk, behind the chunks before it.
        assert!(
            began.elapsed() < Duration::from_millis(30 * 2) + max * 2 + Duration::from_secs(1),
            "{:?}",
            began.elapsed()
        );
        // The draws vary and stay within the bound.
        let mut delay = Delay::new(7);
        delay.jitter = max;
        let draws: Vec<Duration> = (0..200).map(|_| delay.draw()).collect();
        assert!(draws.iter().all(|d| *d <= max));
        assert!(draws.iter().any(|d| *d < max / 4));
        assert!(draws.iter().any(|d| *d > max * 3 / 4));
        // Off again: no delay at all.
        relay.set_jitter(Duration::ZERO);
        let quick = Instant::now();
        conn.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        conn.read_exact(&mut one).await.unwrap();
        assert!(quick.elapsed() < Duration::from_millis(200));
    }
}
