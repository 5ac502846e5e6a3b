//! A future that finishes whether or not its caller waits for it.
//!
//! A keyed request's forward must run to its end — the rail's answer stored in its record, its
//! turn handed on — even if its client hangs up and hyper drops the request's future. Running
//! every such forward as a task of its own would do that at the price of a task per request
//! and a hand-off between two tasks on its way back, although almost every client waits. A
//! [`RunsOn`] is polled in its caller's task instead, and only when it is dropped before its
//! end does what is left of it become a task of its own.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

/// `future`, polled by whoever awaits it; dropped unfinished, it runs on as a task of its own
/// on the current tokio runtime, its output unused.
pub(super) struct RunsOn<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// Boxed, so that a drop can hand it to a task without moving it. `None` once it finished.
    future: Option<Pin<Box<F>>>,
    /// The span it was made in: its caller's polls run inside it already, and a task it becomes
    /// runs inside it too.
    span: tracing::Span,
}

impl<F> RunsOn<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(super) fn new(future: F) -> Self {
        Self {
            future: Some(Box::pin(future)),
            span: tracing::Span::current(),
        }
    }
}

impl<F> Future for RunsOn<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(future) = self.future.as_mut() else {
            // Not reachable through `.await`, which never polls a finished future.
            return Poll::Pending;
        };
        let output = ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<F> Drop for RunsOn<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            // A new task is polled at once, so the wakers the future registered under its
            // caller's task are replaced by the new task's. Outside a runtime (the process is
            // ending) nothing could run it any more.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(tracing::Instrument::instrument(
                    future,
                    std::mem::replace(&mut self.span, tracing::Span::none()),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn awaited_it_runs_in_the_callers_task() {
        let (here, ran_in) = tokio::spawn(async {
            let here = tokio::task::id();
            (here, RunsOn::new(async { tokio::task::id() }).await)
        })
        .await
        .unwrap();
        assert_eq!(ran_in, here);
    }

    #[tokio::test]
    async fn dropped_before_its_end_it_runs_on_to_its_end() {
        let (go, wait) = oneshot::channel::<()>();
        let (done, finished) = oneshot::channel();
        let started = Arc::new(AtomicBool::new(false));
        let caller = tokio::spawn(async move {
            let mut runs_on = Box::pin(RunsOn::new({
                let started = started.clone();
                async move {
                    started.store(true, Ordering::SeqCst);
                    wait.await.unwrap();
                    done.send(tokio::task::id()).unwrap();
                }
            }));
            // Polled once by this task: it starts and waits.
            let first = std::future::poll_fn(|cx| Poll::Ready(runs_on.as_mut().poll(cx))).await;
            assert!(first.is_pending());
            assert!(started.load(Ordering::SeqCst));
            drop(runs_on);
            tokio::task::id()
        })
        .await
        .unwrap();
        // What wakes it now must reach the task it moved to.
        go.send(()).unwrap();
        let ran_in = tokio::time::timeout(Duration::from_secs(5), finished)
            .await
            .expect("it ran on after its caller let it go")
            .unwrap();
        assert_ne!(ran_in, caller);
    }

    #[test]
    fn dropped_outside_a_runtime_it_is_dropped() {
        let dropped = Arc::new(AtomicBool::new(false));
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let flag = Flag(dropped.clone());
        drop(RunsOn::new(async move {
            let _flag = flag;
        }));
        assert!(dropped.load(Ordering::SeqCst));
    }
}
