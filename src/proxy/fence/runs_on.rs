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
use std::task::{Context, Poll};

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
        // Taken out while it is polled: a future that panics is dropped by the unwinding, not
        // handed to a task of its own by `drop` and polled again.
        let Some(mut future) = self.future.take() else {
            // Not reachable through `.await`, which never polls a finished future.
            return Poll::Pending;
        };
        match future.as_mut().poll(cx) {
            Poll::Ready(output) => Poll::Ready(output),
            Poll::Pending => {
                self.future = Some(future);
                Poll::Pending
            }
        }
    }
}

impl<F> Drop for RunsOn<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            // A new task is scheduled at once, and its first poll replaces the wakers the
            // future registered under its caller's task (every future on a forward's path
            // registers the waker of the poll at hand). Outside a runtime (the process is
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

    /// Says, through the flag it is made with, that it was dropped.
    struct Flag(Arc<AtomicBool>);

    impl Flag {
        fn new() -> (Self, Arc<AtomicBool>) {
            let dropped = Arc::new(AtomicBool::new(false));
            (Self(dropped.clone()), dropped)
        }
    }

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn dropped_outside_a_runtime_it_is_dropped() {
        let (flag, dropped) = Flag::new();
        drop(RunsOn::new(async move {
            let _flag = flag;
        }));
        assert!(dropped.load(Ordering::SeqCst));
    }

    /// Panics on its first poll, and counts every poll.
    struct PanicsOnce(Arc<std::sync::atomic::AtomicUsize>);
    impl Future for PanicsOnce {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("the forward panicked");
            }
            Poll::Ready(())
        }
    }

    #[tokio::test]
    async fn a_future_that_panicked_is_not_run_on() {
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let caller = tokio::spawn(RunsOn::new(PanicsOnce(polls.clone())));
        assert!(caller.await.unwrap_err().is_panic());
        // Whatever its drop spawned has had its chance to run.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "a future is never polled again after it panicked"
        );
    }

    #[test]
    fn a_runtime_shutting_down_under_it_drops_it() {
        for threaded in [false, true] {
            let runtime = if threaded {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
            } else {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
            }
            .unwrap();
            let (flag, dropped) = Flag::new();
            let (started, has_started) = std::sync::mpsc::channel();
            runtime.spawn(RunsOn::new(async move {
                let _flag = flag;
                started.send(()).unwrap();
                std::future::pending::<()>().await;
            }));
            if !threaded {
                runtime.block_on(tokio::task::yield_now());
            }
            has_started
                .recv_timeout(Duration::from_secs(5))
                .expect("the future started");
            // Its caller's task is dropped with the runtime: what its drop spawns is dropped
            // too, and the runtime's shutdown ends.
            runtime.shutdown_timeout(Duration::from_secs(5));
            assert!(dropped.load(Ordering::SeqCst), "threaded: {threaded}");
        }
    }
}
