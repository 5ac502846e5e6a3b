//! Places for a batcher's statements in flight, and what becomes of a statement that stalls.
//!
//! Each group-commit batcher (the fence's compare-and-sets, the idempotency completions, the
//! fence's last looks: `batch::run`) runs at most `concurrency` statements at once: while they wait for
//! their commit the next batch fills, and the fewer run at once, the larger — and the cheaper
//! per request — each batch is.
//!
//! A statement can stall without failing. A connection that stays open but carries nothing (a
//! stopped backend, a network path holding its packets while the kernel still acknowledges
//! them) fires none of the timeouts that would end it: `statement_timeout` runs on a server
//! that may never have seen the statement, and `tcp_user_timeout` needs data left
//! unacknowledged. The batcher must keep listening to such a statement — it may still commit,
//! and its answer is the only truth about what it did (`marks`' `advance`) — but it must
//! not keep its place, or every request queued behind it waits until its deadline passes.
//!
//! So a statement holds its place for at most [`hold_for`] (a tenth of `database.timeout_ms`).
//! Past that it is counted in `railguard_db_statements_stalled` and moves aside, to one of a
//! few overrun places, where it is listened to until it answers; the next batch starts beside
//! it on another connection. A statement that is merely slow costs one more statement in
//! flight, nothing else. The overrun places are bounded (as many as the normal ones, and at
//! least two), so a database that stalls every statement is not handed a new connection per
//! batch: once they are taken, a stalled statement keeps its place and the batcher waits, as
//! it would without them.
//!
//! Every statement is counted in the process's work tracker ([`crate::work`]) until it has answered and what its answer
//! left to do is done (a record nobody was told about is deleted: `records::Created`), so
//! that shutdown waits for it: a compare-and-set that commits after its process stopped would
//! leave its idempotency record in flight, and later in doubt, though nothing was forwarded.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::work::Tracked;

/// How long a statement holds its place before the next one may start beside it.
pub fn hold_for(timeout: Duration) -> Duration {
    timeout / 10
}

/// Most statements of one batcher in flight at once, stalled ones included: the sessions a
/// pool given to one batcher alone needs so that a stalled statement never leaves the next
/// one waiting for a connection.
pub fn most_in_flight(concurrency: usize) -> usize {
    let concurrency = concurrency.max(1);
    concurrency + overrun_places(concurrency)
}

fn overrun_places(concurrency: usize) -> usize {
    concurrency.max(2)
}

/// The places of one batcher's statements.
pub struct StatementSlots {
    places: Arc<Semaphore>,
    overrun: Arc<Semaphore>,
    hold_for: Duration,
    stalled: IntGauge,
    unanswered: Tracked,
}

/// A statement's place, taken before its batch is made.
pub struct Slot {
    _place: OwnedSemaphorePermit,
}

impl StatementSlots {
    /// `concurrency` places; statements hold one for at most [`hold_for`]`(timeout)`, are
    /// counted in `stalled` while they run past it, and in `unanswered` until they answer.
    pub fn new(
        concurrency: usize,
        timeout: Duration,
        stalled: IntGauge,
        unanswered: Tracked,
    ) -> Self {
        let concurrency = concurrency.max(1);
        Self {
            places: Arc::new(Semaphore::new(concurrency)),
            overrun: Arc::new(Semaphore::new(overrun_places(concurrency))),
            hold_for: hold_for(timeout),
            stalled,
            unanswered,
        }
    }

    /// Waits for a free place.
    pub async fn wait(&self) -> Slot {
        Slot {
            _place: self
                .places
                .clone()
                .acquire_owned()
                .await
                .expect("the semaphore is never closed"),
        }
    }

    /// Runs `statement` on a task of its own, in `slot` until it answers or has held the slot
    /// for [`hold_for`]; then aside, listened to until it answers.
    pub fn run(&self, slot: Slot, statement: impl Future<Output = ()> + Send + 'static) {
        let (overrun, hold_for, stalled) =
            (self.overrun.clone(), self.hold_for, self.stalled.clone());
        let running = self.unanswered.start();
        tokio::spawn(async move {
            let _running = running;
            let mut statement = std::pin::pin!(statement);
            tokio::select! {
                biased;
                () = &mut statement => return,
                () = tokio::time::sleep(hold_for) => {}
            }
            let _stalled = Stalled::count(stalled);
            let aside = tokio::select! {
                biased;
                () = &mut statement => return,
                place = overrun.acquire_owned() => place.expect("the semaphore is never closed"),
            };
            drop(slot);
            statement.await;
            drop(aside);
        });
    }
}

/// One statement counted as stalled, until it answers.
struct Stalled(IntGauge);

impl Stalled {
    fn count(gauge: IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Stalled {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    fn slots(concurrency: usize) -> StatementSlots {
        let gauge = IntGauge::new("stalled", "stalled").unwrap();
        StatementSlots::new(
            concurrency,
            Duration::from_secs(1),
            gauge,
            Tracked::alone(crate::work::Work::Statement),
        )
    }

    /// A statement that answers when told to.
    fn held() -> (
        oneshot::Sender<()>,
        impl Future<Output = ()> + Send + 'static,
    ) {
        let (answer, answered) = oneshot::channel::<()>();
        (answer, async move {
            let _ = answered.await;
        })
    }

    async fn takes_a_place(slots: &StatementSlots, within: Duration) -> bool {
        tokio::time::timeout(within, slots.wait()).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_holds_its_place_until_it_answers_or_for_a_tenth_of_the_timeout() {
        let slots = slots(1);
        let (answer, statement) = held();
        slots.run(slots.wait().await, statement);
        assert!(!takes_a_place(&slots, Duration::from_millis(99)).await);
        assert_eq!(slots.stalled.get(), 0);
        assert!(takes_a_place(&slots, Duration::from_millis(2)).await);
        assert_eq!(
            slots.stalled.get(),
            1,
            "counted while it runs past its hold"
        );
        answer.send(()).unwrap();
        tokio::task::yield_now().await;
        assert_eq!(slots.stalled.get(), 0, "and no longer once it answered");
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_that_answers_in_time_frees_its_place_at_once() {
        let slots = slots(1);
        let (answer, statement) = held();
        slots.run(slots.wait().await, statement);
        tokio::time::sleep(Duration::from_millis(10)).await;
        answer.send(()).unwrap();
        assert!(takes_a_place(&slots, Duration::from_millis(1)).await);
        assert_eq!(slots.stalled.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn stalled_statements_move_aside_only_while_overrun_places_last() {
        let slots = slots(1); // one place, two overrun places
        let mut answers = Vec::new();
        for _ in 0..3 {
            let (answer, statement) = held();
            answers.push(answer);
            let slot = tokio::time::timeout(Duration::from_millis(150), slots.wait())
                .await
                .expect("the previous statement moved aside");
            slots.run(slot, statement);
        }
        // The third keeps its place: both overrun places are taken.
        assert!(!takes_a_place(&slots, Duration::from_secs(60)).await);
        assert_eq!(slots.stalled.get(), 3);
        // One of the first two answers: the third moves aside into its overrun place.
        answers.remove(0).send(()).unwrap();
        assert!(takes_a_place(&slots, Duration::from_millis(1)).await);
        assert_eq!(slots.stalled.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_can_wait_until_every_statement_has_answered() {
        let slots = slots(1);
        let (first, statement) = held();
        slots.run(slots.wait().await, statement);
        let (second, statement) = held();
        let slot = slots.wait().await; // the first moved aside
        slots.run(slot, statement);
        assert_eq!(slots.unanswered.count(), 2);
        let waiting = tokio::spawn({
            let unanswered = slots.unanswered.clone();
            async move { unanswered.none_left().await }
        });
        first.send(()).unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "one is still unanswered");
        second.send(()).unwrap();
        tokio::time::timeout(Duration::from_millis(1), waiting)
            .await
            .expect("none left")
            .unwrap();
    }

    #[test]
    fn a_pool_for_one_batcher_has_room_for_its_stalled_statements() {
        assert_eq!(most_in_flight(1), 3);
        assert_eq!(most_in_flight(2), 4);
        assert_eq!(most_in_flight(4), 8);
        assert_eq!(most_in_flight(0), 3);
    }
}
