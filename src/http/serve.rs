//! Accept loop shared by every listener: the proxy, the admin endpoint and the rail simulator.
//!
//! Takes an already-bound listener (so tests bind port 0 and callers choose the address), a
//! service per connection, and a shutdown future. On shutdown it stops accepting, lets every
//! open connection finish its in-flight requests within the grace period, and then returns.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::http::BoxError;

/// Serves HTTP/1.1 and cleartext HTTP/2 on `listener` until `shutdown` resolves, then drains.
pub async fn serve<F, S, B>(
    listener: TcpListener,
    make_service: F,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) where
    F: Fn(SocketAddr) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static,
{
    let builder = Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let local = listener.local_addr().ok();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let connection = builder.serve_connection(TokioIo::new(stream), make_service(peer));
                let connection = graceful.watch(connection.into_owned());
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, %peer, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(listener = ?local, "stopped accepting; draining open connections");
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(listener = ?local, ?grace, "grace period over; closing remaining connections");
    }
}
