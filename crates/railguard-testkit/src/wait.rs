//! Waiting for something to become true, bounded: the one way tests wait, instead of
//! hand-written sleep loops.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

/// The first pause between two probes; each pause doubles, up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const LONGEST_PAUSE: Duration = Duration::from_millis(200);

/// Polls `probe` until it gives `Some`, and returns that; fails the test after `limit`, with
/// a message that names `what` was awaited. The first probe is at once, the next after 10 ms,
/// then at doubling pauses of at most 200 ms. A probe that is itself slow is waited for until
/// the deadline (at least a second), then counted as a no.
///
/// ```ignore
/// let row = eventually(Duration::from_secs(5), "the record stored", || async {
///     pg.client().await.query_opt(SQL, &[&key]).await.unwrap()
/// })
/// .await;
/// ```
pub async fn eventually<T, F, Fut>(limit: Duration, what: impl Display, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = tokio::time::Instant::now();
    match within(limit, probe).await {
        Ok(found) => found,
        Err(probes) => panic!(
            "waited {:?} (limit {limit:?}, {probes} probes) for {what}",
            start.elapsed()
        ),
    }
}

/// Polls `probe` as [`eventually`] does, for a test in which it may rightly never give
/// `Some` (a record an operator must lift, which stays): what it gave, or how many probes
/// said no in `limit`.
pub async fn within<T, F, Fut>(limit: Duration, mut probe: F) -> Result<T, u32>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = tokio::time::Instant::now();
    let deadline = start + limit;
    let mut pause = FIRST_PAUSE;
    let mut probes = 0u32;
    loop {
        probes += 1;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let answer = tokio::time::timeout(left.max(Duration::from_secs(1)), probe()).await;
        if let Ok(Some(found)) = answer {
            return Ok(found);
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(probes);
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

/// [`eventually`] for a probe that answers yes or no.
pub async fn until<F, Fut>(limit: Duration, what: impl Display, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually(limit, what, || {
        let answer = probe();
        async move { answer.await.then_some(()) }
    })
    .await
}
