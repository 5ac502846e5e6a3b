//! This railguard process as the owner of the idempotency records it creates.
//!
//! Forgetting a record in doubt is safe only when its owner can no longer send it. A record
//! names the instance that made it (`idempotency_record.owner_instance`), and each process
//! holds a session advisory lock named by its [`InstanceId`] for its whole life, on a
//! connection of its own: a held lock shows the owner running. Its absence shows nothing — a
//! paused process whose session was lost (a backend crash, a terminated session, a failover)
//! holds none and may send once it runs again — so "the owner has stopped" is said by the owner
//! itself, as it stops with nothing left to send ([`record_clean_stop`], which also says from
//! when nothing it sent can still reach the rail), or by an operator who saw it stop
//! (`railguard idempotency-forget --owner-stopped`).

use std::time::Duration;

/// One railguard process as the owner of idempotency records: a random positive id, held as a
/// session advisory lock for as long as the process lives (see [`hold_instance_lock`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceId(i64);

impl InstanceId {
    pub fn generate() -> Self {
        let bytes = crate::proof::random_bytes::<8>();
        Self((i64::from_be_bytes(bytes) & (i64::MAX >> 1)).max(1))
    }

    pub fn get(self) -> i64 {
        self.0
    }

    /// The instance a stored record names (`idempotency_record.owner_instance`), or one an
    /// operator named.
    pub fn from_stored(id: i64) -> Self {
        Self(id)
    }
}

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Holds `instance`'s advisory lock on a connection of its own for as long as the process
/// runs; `held` is told once it is first held. Reconnects when the connection is lost (the
/// database restarted), or when its server stops answering or taking writes (checked every
/// 5 s, `db::still_primary`): until then this process's records look ownerless. Its session is
/// on a server that takes writes: PostgreSQL grants advisory locks on a standby too, where
/// forget, which runs on the primary, would not see them.
pub async fn hold_instance_lock(
    url: String,
    timeout: Duration,
    instance: InstanceId,
    held: tokio::sync::oneshot::Sender<()>,
) {
    let mut held = Some(held);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let crate::tls::postgres::PgConnect {
                mut config, tls, ..
            } = crate::db::pg_config(&url, timeout).map_err(|e| e.to_string())?;
            config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
            let (client, connection) = crate::db::establish(&config, tls)
                .await
                .map_err(|e| e.to_string())?;
            let connection = tokio::spawn(connection);
            // A server-wide idle_session_timeout must not end this (idle) session.
            let _ = client.batch_execute("SET idle_session_timeout = 0").await;
            client
                .execute("SELECT pg_advisory_lock($1)", &[&instance.get()])
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((client, connection))
        };
        match attempt.await {
            Ok((client, mut connection)) => {
                backoff = Duration::from_millis(100);
                if let Some(held) = held.take() {
                    let _ = held.send(());
                }
                // Held until the session ends, or until its server stops answering (paused
                // under it) or takes writes no more: the lock is then taken again where the
                // database is now.
                let mut check = tokio::time::interval(crate::db::SESSION_CHECK);
                check.tick().await;
                let why = loop {
                    tokio::select! {
                        _ = &mut connection => break "the session ended".to_string(),
                        _ = check.tick() => {
                            if let Err(why) = crate::db::still_primary(&client, timeout).await {
                                break why;
                            }
                        }
                    }
                };
                connection.abort();
                drop(client);
                tracing::warn!(
                    instance = instance.get(),
                    "lost the session that marks this railguard's idempotency records as owned \
                     ({why}); reconnecting"
                );
            }
            Err(e) => tracing::warn!(error = %e, "cannot hold the instance lock; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Records, in `railguard_audit`, that `instance` has stopped with nothing left to send: every
/// forward it started has ended — answered, or ended without an answer after which it wrote
/// nothing more — and it starts no more. What it wrote may still be on its way to the rail for
/// `quiet_in` (`proxy.rail_transit_ms` after the latest forward that ended unanswered,
/// `forward::LateForwards::quiet_in`): the row says when the rail can receive nothing more from
/// it (`quiet_after`, by the database's clock), and forget takes the records it owned as
/// ownerless only after that. Called by a graceful stop only once that holds; a process that
/// crashed, or stopped with forwards still out, says nothing, and its records wait for an
/// operator's word. Returns `quiet_after` (UTC).
pub async fn record_clean_stop(
    pool: &deadpool_postgres::Pool,
    instance: InstanceId,
    quiet_in: Duration,
    rail_transit: Duration,
    timeout: Duration,
) -> Result<String, String> {
    let millis = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let write = async {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        let row = client
            .query_one(
                "INSERT INTO railguard_audit (action, reason, outcome, finished_at)
                 VALUES ('instance_stopped',
                         'railguard stopped with every forward ended: it sends nothing more, and \
                          nothing it sent can reach the rail after quiet_after',
                         jsonb_build_object(
                             'instance', $1::bigint,
                             'quiet_after', now() + $2::bigint * interval '1 millisecond',
                             'rail_transit_ms', $3::bigint),
                         now())
                 RETURNING to_char((outcome->>'quiet_after')::timestamptz AT TIME ZONE 'UTC',
                                   'YYYY-MM-DD HH24:MI:SS.US\"Z\"')",
                &[&instance.get(), &millis(quiet_in), &millis(rail_transit)],
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok(row.get(0))
    };
    tokio::time::timeout(timeout, write)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}
