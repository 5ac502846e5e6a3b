//! How a stopping process ends: the signals that ask it to, and the work it waits for
//! before it goes — within one deadline, `shutdown.grace_ms` from the signal.

use std::future::Future;

use prometheus::IntGauge;
use tokio::time::Instant;

use crate::config::Config;
use crate::proxy::forward::LateForwards;
use crate::store::instance::{InstanceId, record_clean_stop};
use crate::work::{Work, WorkTracker};

/// Every kind of work a stopping process still has out once its listeners have drained, in the
/// order one kind can add to the next: forwards waiting for the rail's answer (past their
/// deadline, left by their client, or run for an idempotency key), database statements still
/// unanswered (a compare-and-set that commits after this process is gone leaves the record of
/// a request that was never forwarded in flight, then in doubt), and idempotency outcomes the
/// database did not take at once — all counted in the process's one work tracker
/// ([`crate::work`]).
pub(super) struct Outstanding {
    pub(super) work: WorkTracker,
    /// When the latest forward ended without the rail's answer, for the clean stop's
    /// `quiet_after`.
    pub(super) late_forwards: LateForwards,
    pub(super) outcomes_pending: IntGauge,
}

impl Outstanding {
    fn counts(&self) -> (usize, usize, usize) {
        (
            self.work.count(Work::Forward),
            self.work.count(Work::Statement),
            self.work.count(Work::Outcome),
        )
    }

    /// Waits until nothing is out, or `deadline`; logs what it waits for, and what is left
    /// when the deadline ends the wait.
    pub(super) async fn settle(&self, deadline: Instant) {
        let (forwards, statements, outcomes) = self.counts();
        if forwards > 0 {
            tracing::info!(
                forwards,
                "waiting for the rail's answers to forwards still on their way (past their \
                 deadline, left by their client, or run for an idempotency key)"
            );
        }
        if statements > 0 {
            tracing::info!(
                statements,
                "waiting for database statements still unanswered"
            );
        }
        if outcomes > 0 {
            tracing::info!(
                outcomes,
                "waiting for idempotency outcomes still retried until the database takes them"
            );
        }
        if tokio::time::timeout_at(deadline, self.work.none_left())
            .await
            .is_err()
        {
            let (forwards, statements, outcomes) = self.counts();
            tracing::warn!(
                forwards,
                statements,
                outcomes,
                outcomes_pending = self.outcomes_pending.get(),
                "shutdown.grace_ms is over with work still outstanding. Forwards still waiting \
                 for the rail's answer: a newer grant's request sent by another railguard may \
                 reach the rail before them. Statements unanswered: a compare-and-set among them \
                 that commits later leaves its idempotency record in flight, then in doubt, \
                 though its request was refused (503) and never forwarded; a completion among \
                 them that never commits leaves its record in doubt though the rail answered. \
                 Outcomes not stored: their records stay in flight and become in doubt. A repeat \
                 of such a request is refused, never forwarded twice; `railguard \
                 idempotency-forget` clears such a record once this process has stopped"
            );
        }
    }

    /// Records this process's clean stop if every forward it started has ended and no
    /// statement is out: it starts no more, and says from when nothing it sent can still reach
    /// the rail (`proxy.rail_transit_ms` after the latest forward that ended without an answer),
    /// so that forget takes the records it owned as ownerless from then on. A crash, or a stop
    /// with forwards still out, says nothing; those records wait for an operator's
    /// `--owner-stopped`.
    pub(super) async fn record_stop(
        &self,
        pool: &deadpool_postgres::Pool,
        instance: InstanceId,
        config: &Config,
    ) {
        if self.work.count(Work::Forward) != 0 || self.work.count(Work::Statement) != 0 {
            tracing::warn!(
                instance = instance.get(),
                "stopping with forwards or statements still out, so no clean stop is recorded: \
                 a record in doubt this process owned needs `railguard idempotency-forget \
                 --owner-stopped {instance}`"
            );
            return;
        }
        let quiet_in = self.late_forwards.quiet_in(config.proxy.rail_transit);
        match record_clean_stop(
            pool,
            instance,
            quiet_in,
            config.proxy.rail_transit,
            config.database.timeout,
        )
        .await
        {
            Ok(quiet_after) => tracing::info!(
                instance = instance.get(),
                quiet_after,
                "recorded this process's clean stop: records in doubt it owned can be forgotten \
                 without --owner-stopped once nothing it sent can still reach the rail \
                 (quiet_after)"
            ),
            Err(e) => tracing::warn!(
                instance = instance.get(),
                error = %e,
                "could not record this process's clean stop: a record in doubt it owned needs \
                 `railguard idempotency-forget --owner-stopped {instance}`"
            ),
        }
    }
}

/// SIGHUP, as [`Reload::requests`](crate::reload::Reload::requests): one message per signal (signals that arrive while one is
/// being handled are folded into one more). The handler is installed when this is called, so
/// from then on SIGHUP never ends the process, even before it serves.
pub fn hangup_requests() -> tokio::sync::mpsc::Receiver<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            if tx.try_send(()).is_err() && tx.is_closed() {
                tracing::warn!("SIGHUP received while stopping: nothing reloaded");
            }
        }
    });
    rx
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not when
/// the future is first polled, so a signal during start-up is not lost. A second signal while
/// draining exits at once.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second signal: exiting without draining");
            std::process::exit(130);
        });
    }
}
