//! A rail that does not accept connections: a listener whose accept queue is full, so that the
//! kernel drops the SYN of every new connection and the connecting side keeps trying (about a
//! second, then three) until its connect timeout. What a rail looks like to railguard while
//! it is overloaded or half-up — a forward that is still connecting, not refused.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The listener and the connections that fill its queue (they keep it full while held).
pub struct FullRail {
    pub listener: TcpListener,
    pub addr: SocketAddr,
    queued: Vec<TcpStream>,
}

impl FullRail {
    pub async fn start() -> FullRail {
        let socket = TcpSocket::new_v4().expect("a socket");
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("bind");
        let listener = socket.listen(1).expect("listen");
        let addr = listener.local_addr().expect("local address");
        let mut queued = Vec::new();
        for _ in 0..16 {
            match tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => queued.push(stream),
                _ => break,
            }
        }
        assert!(
            !queued.is_empty() && queued.len() < 16,
            "the accept queue did not fill: {} connections",
            queued.len()
        );
        FullRail {
            listener,
            addr,
            queued,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Lets go of the connections that fill the queue (still queued until accepted): the
    /// listener's `accept` then takes them, and what comes after.
    pub fn release(&mut self) {
        self.queued.clear();
    }
}
