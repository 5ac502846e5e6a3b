//! Background renewal of a lease, and a prompt "lost" when it can no longer be trusted.
//!
//! Renewals go out every ttl/3. The lease is reported lost as soon as either
//! - the lock service answers that the grant no longer holds the key (410), or
//! - no renewal has succeeded for a whole ttl, counted from the *start* of the last renewal
//!   that succeeded. The service extended the lease at some moment after that start, so the
//!   lease cannot have run out earlier than this: it is the earliest moment it might have,
//!   measured on the worker's own monotonic clock.
//!
//! Losing the lease means: stop writing. A write already on its way is still fenced by its
//! token; this signal exists so a worker stops *starting* work it no longer owns.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{LockClient, LockHandle, SdkError};

/// Why a lease was given up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseLost {
    /// The lock service said the grant no longer holds the key.
    Revoked,
    /// No renewal succeeded for a whole ttl; the last error is kept.
    Unconfirmed(String),
}

/// Renews a lease until dropped. Dropping it stops renewing (it does not release).
pub struct KeepAlive {
    state: watch::Receiver<Option<LeaseLost>>,
    task: tokio::task::JoinHandle<()>,
}

impl KeepAlive {
    pub(super) fn start(client: LockClient, handle: LockHandle) -> Self {
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(renew_loop(client, handle, tx));
        Self { state: rx, task }
    }

    /// `Some` once the lease is lost.
    pub fn lost_reason(&self) -> Option<LeaseLost> {
        self.state.borrow().clone()
    }

    /// Resolves when the lease is lost.
    pub async fn lost(&mut self) -> LeaseLost {
        loop {
            if let Some(reason) = self.state.borrow_and_update().clone() {
                return reason;
            }
            if self.state.changed().await.is_err() {
                return self
                    .state
                    .borrow()
                    .clone()
                    .unwrap_or(LeaseLost::Unconfirmed("keep-alive stopped".into()));
            }
        }
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn renew_loop(client: LockClient, handle: LockHandle, tx: watch::Sender<Option<LeaseLost>>) {
    let ttl = handle.ttl();
    let period = (ttl / 3).max(Duration::from_millis(1));
    let mut confirmed_until = handle.lease_floor();
    let mut next = Instant::now() + period;
    loop {
        tokio::time::sleep_until(next).await;
        let started = Instant::now();
        let attempt = tokio::time::timeout_at(confirmed_until, client.renew(&handle)).await;
        match attempt {
            Ok(Ok(())) => {
                confirmed_until = started + ttl;
                next = started + period;
            }
            Ok(Err(SdkError::Lost)) => {
                tracing::warn!(
                    lock.key = handle.key(),
                    lock.token = handle.token().get(),
                    "lease lost: revoked"
                );
                let _ = tx.send(Some(LeaseLost::Revoked));
                return;
            }
            Ok(Err(e)) if Instant::now() < confirmed_until => {
                tracing::debug!(lock.key = handle.key(), lock.token = handle.token().get(), error = %e, "renewal failed; retrying");
                next = (Instant::now() + period / 4).min(confirmed_until);
            }
            Ok(Err(e)) => {
                lost(&tx, &handle, e.to_string());
                return;
            }
            Err(_) => {
                lost(
                    &tx,
                    &handle,
                    format!("no renewal confirmed within the ttl ({ttl:?})"),
                );
                return;
            }
        }
        if Instant::now() >= confirmed_until {
            lost(
                &tx,
                &handle,
                format!("no renewal confirmed within the ttl ({ttl:?})"),
            );
            return;
        }
    }
}

fn lost(tx: &watch::Sender<Option<LeaseLost>>, handle: &LockHandle, why: String) {
    tracing::warn!(
        lock.key = handle.key(),
        lock.token = handle.token().get(),
        why,
        "lease lost: unconfirmed"
    );
    let _ = tx.send(Some(LeaseLost::Unconfirmed(why)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::FencingToken;

    /// A handle as `acquire` makes one, for a grant made now with `ttl`.
    fn granted(ttl: Duration) -> LockHandle {
        LockHandle {
            key: "kept".into(),
            holder: "w".into(),
            token: FencingToken::new(7).unwrap(),
            secret: "secret".into(),
            proof: "proof".into(),
            ttl,
            lease_floor: Instant::now() + ttl,
            granted_at_us: 0,
            expires_at_us: 0,
        }
    }

    /// The instant the keep-alive says the lease is lost, with no renewal ever confirmed, on
    /// the runtime's paused clock (which moves only when every task waits).
    async fn reported_at(client: LockClient, handle: &LockHandle) -> (LeaseLost, Instant) {
        let mut keep = client.keep_alive(handle);
        let reason = keep.lost().await;
        (reason, Instant::now())
    }

    /// An address that refuses connections for as long as the returned socket lives: bound,
    /// never listening.
    fn refusing() -> (tokio::net::TcpSocket, std::net::SocketAddr) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        (socket, addr)
    }

    /// A lock service that takes connections and never answers; the first `answered` renewals
    /// it does answer, as the service would.
    async fn silent_after(answered: usize) -> (tokio::task::JoinHandle<()>, std::net::SocketAddr) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = tokio::spawn(async move {
            let mut held = Vec::new();
            let mut left = answered;
            while let Ok((mut socket, _)) = listener.accept().await {
                if left == 0 {
                    held.push(socket);
                    continue;
                }
                left -= 1;
                // The renewal's JSON body ends the request.
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.ends_with(b"}") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let body = r#"{"key":"kept","token":7,"ttl_ms":900,"expires_at_us":0}"#;
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(reply.as_bytes()).await;
            }
        });
        (serving, addr)
    }

    // The loss is reported at the earliest moment the lease may have run out (its floor, no
    // renewal having succeeded), never after it and never before, whether the service refuses
    // connections or takes them and never answers. The clock is the runtime's paused one, so
    // the instants are exact (to the timer's millisecond), not a measurement.
    #[tokio::test(start_paused = true)]
    async fn a_lease_no_renewal_confirms_is_reported_lost_at_its_floor() {
        /// A fresh grant's loss through the service at `addr`: at its floor, to the millisecond.
        async fn lost_at_its_floor(addr: std::net::SocketAddr) {
            let handle = granted(Duration::from_millis(900));
            let client = LockClient::new(format!("http://{addr}"));
            let (reason, at) = reported_at(client, &handle).await;
            assert!(matches!(reason, LeaseLost::Unconfirmed(_)), "{reason:?}");
            let floor = handle.lease_floor();
            assert!(at >= floor, "{:?} before the floor", floor - at);
            let after = at - floor;
            assert!(
                after <= Duration::from_millis(1),
                "{after:?} after the floor"
            );
        }

        let (_refusing, closed) = refusing();
        lost_at_its_floor(closed).await;
        let (silent, addr) = silent_after(0).await;
        lost_at_its_floor(addr).await;
        silent.abort();
    }

    // A renewal that succeeds moves the floor to a ttl after the renewal began (the service
    // extended the lease no earlier); once the service goes silent, the loss is reported
    // there: past the grant's own floor, not past the new one.
    #[tokio::test(start_paused = true)]
    async fn a_confirmed_renewal_moves_the_floor_to_a_ttl_after_it_began() {
        let ttl = Duration::from_millis(900);
        let (silent, addr) = silent_after(1).await;
        let handle = granted(ttl);
        let began = Instant::now();
        let (reason, at) = reported_at(LockClient::new(format!("http://{addr}")), &handle).await;
        assert!(matches!(reason, LeaseLost::Unconfirmed(_)), "{reason:?}");
        // Renewals go out every ttl/3: the one that succeeded began then.
        let floor = began + ttl / 3 + ttl;
        assert!(at > handle.lease_floor(), "the renewal moved the floor");
        assert!(at >= floor, "{:?} before the new floor", floor - at);
        // Each of the two timers (the renewal's, the loss's) may round up to the next millisecond.
        assert!(
            at <= floor + Duration::from_millis(2),
            "{:?} after the new floor",
            at - floor
        );
        silent.abort();
    }
}
