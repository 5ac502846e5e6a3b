//! A TCP relay on a free loopback port that can delay what crosses it: a slow network path
//! between two real processes (railguard and PostgreSQL, railguard and the rail).
//!
//! Every chunk read from one side is written to the other `delay` after it was read, in order,
//! so a delay models latency, not loss. The delay is read when a chunk arrives and can be
//! changed at any time; it applies to both directions. Dropping the relay stops accepting;
//! connections already open keep running until either side closes; a close reaches the
//! other side half a second after the last data.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub struct Relay {
    pub addr: SocketAddr,
    delay: Arc<Mutex<Duration>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Relays every connection made to [`Relay::addr`] to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().unwrap();
        let delay = Arc::new(Mutex::new(Duration::ZERO));
        let shared = delay.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let delay = shared.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(pump(client_read, server_write, delay.clone()));
                    tokio::spawn(pump(server_read, client_write, delay));
                });
            }
        });
        Relay {
            addr,
            delay,
            accept,
        }
    }

    /// Delays every chunk read from now on by `delay`, both ways.
    pub fn set_delay(&self, delay: Duration) {
        *self.delay.lock().unwrap() = delay;
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

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Arc<Mutex<Duration>>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        // The sender's FIN follows its data later, as across a real network: a server that
        // sees a request and its connection's end in one read may drop the request.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let due = Instant::now() + *delay.lock().unwrap();
                if tx.send((due, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}
