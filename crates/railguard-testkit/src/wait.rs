//! Waiting for something to become true, bounded: the one way tests wait, instead of
//! hand-written sleep loops.

use std::future::Future;
use std::time::Duration;

/// Polls `probe` every 50 ms until it gives `Some`, and returns that; panics after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not true within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
