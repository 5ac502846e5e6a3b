//! The store went back: a PostgreSQL failover or rewind, or etcd restored from a snapshot,
//! noticed before a session is used, and fenced without a person.
//!
//! **What goes back.** An asynchronous standby promoted after it missed the last commits, or a
//! data directory put back to an earlier copy, takes the fencing marks, the idempotency
//! records, the lock rows and `fencing_token_seq` back *together*, to a state that is
//! consistent in itself. Nothing in the data can tell. Left alone, a new grant repeats a token
//! already handed out (INV-04) and an old grant's token is accepted after a newer one paid
//! (INV-05): the rail pays twice.
//!
//! **How it is noticed.** What cannot go back with the data is where it lives: a rewind or a
//! failover always means a restart or another server, and a restored dump means new storage
//! for the tables. `railguard_store_epoch` holds the identity the database was last
//! acknowledged on — system identifier, timeline, postmaster start time, the storage of
//! railguard's tables and sequence — and every session railguard opens compares it with where
//! it is connected before the session is used ([`crate::db::SessionGate`]). The row went back
//! with the data, so it still names the old identity: any railguard sees the mismatch,
//! including one started after the event. Sessions live and die with their server, so a
//! session checked once stays checked.
//!
//! **What is done.** Under the row's lock, the first railguard to see a new server moves the
//! token source past anything that could have been issued before and raises the **floor** to
//! it, in one transaction with the new identity and an audit row:
//! - PostgreSQL lock backend: the floor is at least a [`FLOOR_GAP`] above everything known —
//!   the sequence, the marks, the floor, what this process saw — and at least the server's
//!   clock in microseconds, and `fencing_token_seq` is set to it; grants below it are ended. The data may have gone back past an earlier floor (a second rewind, a
//!   standby that missed the last change) with no railguard left that saw it: then nothing
//!   known is above the tokens that floor handed out, and only the clock is — tokens are drawn
//!   far slower than one a microsecond. This one case leans on the clock not going back. A
//!   railguard that saw such a token and meets a floor another set below it fences again.
//! - etcd lock backend: etcd did not go back with PostgreSQL, so the floor is one above its
//!   revision now: every grant made before is below it.
//!
//! The fence's compare-and-set refuses every token below the floor. So each holder from
//! before the change is fenced out once and takes a new grant; the floor never goes down and
//! no mark is lowered. A restart that lost nothing is indistinguishable from one that did, so
//! it costs the same: one new grant per holder.
//!
//! etcd restored from a snapshot does not change PostgreSQL; the etcd backend records each
//! key's highest token in `lock_issued` before a grant is handed out, and the token-source
//! guard ([`crate::lock::guard`]) raises the floor with [`StoreEpoch::raise_floor`] when a
//! grant is not above it.
//!
//! The floor is a bound, not a token: nothing here gives a writer a token to present (C2
//! §2.7), and answers never reveal it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use prometheus::{IntCounter, IntGauge, Registry};
use tokio_postgres::Client;

/// The least a floor moves the PostgreSQL token source past what the data knows: far more
/// tokens than a standby could miss.
pub const FLOOR_GAP: i64 = 1_000_000_000;

/// The storage of the tables and sequence a store going back takes with it: a logical restore
/// recreates them on the same server (a `VACUUM FULL` of one also changes it: a change fenced
/// for nothing, which is safe).
macro_rules! relations {
    () => {
        "concat_ws('/', pg_relation_filenode('railguard_store_epoch'),
                   pg_relation_filenode('rail_high_water'),
                   pg_relation_filenode('fencing_token_seq'),
                   pg_relation_filenode('idempotency_record'),
                   pg_relation_filenode('lock_entry'))"
    };
}

/// The server's identity beside the one acknowledged in the row, and the row's floor.
const IDENTITY_SQL: &str = concat!(
    "\
SELECT e.system_identifier IS NOT DISTINCT FROM s.system_identifier
       AND e.timeline IS NOT DISTINCT FROM l.timeline
       AND e.postmaster_start IS NOT DISTINCT FROM pg_postmaster_start_time()
       AND e.relations IS NOT DISTINCT FROM ",
    relations!(),
    ",
       e.system_identifier IS NULL,
       e.floor, e.epoch,
       format('system %s, timeline %s, started %s, storage %s',
              s.system_identifier, l.timeline, pg_postmaster_start_time(), ",
    relations!(),
    "),
       format('system %s, timeline %s, started %s, storage %s',
              e.system_identifier, e.timeline, e.postmaster_start, e.relations),
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint,
       COALESCE((extract(epoch FROM e.went_back_at) * 1000000)::bigint, 0)
FROM railguard_store_epoch e,
     pg_control_system() s,
     (SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint
        AS timeline) l"
);

/// Everything a token could have reached before the change, as far as this database says.
const KNOWN_SQL: &str = "\
SELECT GREATEST((SELECT COALESCE(max(highest_token), 0) FROM rail_high_water),
                (SELECT COALESCE(max(token), 0) FROM lock_issued),
                (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM fencing_token_seq))";

const ACKNOWLEDGE_SQL: &str = concat!(
    "\
UPDATE railguard_store_epoch SET
    system_identifier = s.system_identifier,
    timeline = ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint,
    postmaster_start = pg_postmaster_start_time(),
    relations = ",
    relations!(),
    ",
    floor = GREATEST(floor, $1),
    epoch = epoch + $2,
    changed_at = now(),
    went_back_at = CASE WHEN $2 > 0 THEN now() ELSE went_back_at END
FROM pg_control_system() s
RETURNING floor, epoch, COALESCE((extract(epoch FROM went_back_at) * 1000000)::bigint, 0)"
);

const AUDIT_SQL: &str = "\
INSERT INTO railguard_audit (action, reason, outcome, finished_at)
VALUES ($1, $2, $3::text::jsonb, now())";

/// How a change of server moves the token source.
#[derive(Clone)]
pub enum TokenJump {
    /// The PostgreSQL lock backend: `fencing_token_seq` went back with the data; it is set to
    /// the floor, at least [`FLOOR_GAP`] above everything known.
    Sequence,
    /// The etcd lock backend: the floor is one above the revision this reads now.
    Revision(RevisionRead),
}

/// Reads the etcd revision now.
pub type RevisionRead =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<i64, String>> + Send>> + Send + Sync>;

struct EpochMetrics {
    changes: IntCounter,
    epoch: IntGauge,
    detection: IntGauge,
}

/// This process's view of the store's epoch and floor, and the check every session passes.
pub struct StoreEpoch {
    detect: bool,
    jump: TokenJump,
    /// The highest floor this process has seen: tokens below it are refused without asking
    /// the database (which refuses them anyway).
    floor: AtomicI64,
    /// The epoch last seen; -1 before the first check.
    epoch: AtomicI64,
    /// The highest token this process saw granted or accepted ([`StoreEpoch::observe`]).
    seen: AtomicI64,
    /// When the PostgreSQL server last changed (`went_back_at`, the database's clock in
    /// microseconds; 0: never), as this process last read it.
    went_back: AtomicI64,
    /// The epoch after whose changes nothing sent before can still reach the rail, as this
    /// process found ([`StoreEpoch::change_settled`]); -1: none yet. Epochs, not times: the
    /// servers that set `went_back_at` need not agree on the clock.
    settled: AtomicI64,
    timeout: Duration,
    metrics: EpochMetrics,
}

impl std::fmt::Debug for StoreEpoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreEpoch")
            .field("detect", &self.detect)
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Why a session could not be checked or the change not be fenced: the session is not used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("store epoch check: {0}")]
pub struct EpochError(pub String);

impl From<tokio_postgres::Error> for EpochError {
    fn from(e: tokio_postgres::Error) -> Self {
        EpochError(crate::db::causes(&e))
    }
}

impl StoreEpoch {
    /// `detect = false` is the negative control (`guard.detect_store_changes`): sessions are
    /// used whatever server they reach.
    pub fn new(jump: TokenJump, detect: bool, timeout: Duration, registry: &Registry) -> Self {
        let changes = IntCounter::new(
            "railguard_store_changes_total",
            "Changes of the PostgreSQL server or of the token source this process saw (a \
             failover, a restart, a rewound data directory, etcd restored): each raised the \
             fencing floor, and every grant from before it is fenced out once",
        )
        .expect("metric");
        let epoch = IntGauge::new(
            "railguard_store_epoch",
            "How many changes of server or token source the database has been through, as this \
             process last read it",
        )
        .expect("metric");
        let detection = IntGauge::new(
            "railguard_store_change_detection",
            "1 while a store going back is detected and fenced; 0 only with \
             guard.detect_store_changes = false, which exists to demonstrate the double \
             payments it prevents",
        )
        .expect("metric");
        detection.set(i64::from(detect));
        for metric in [
            Box::new(changes.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(epoch.clone()),
            Box::new(detection.clone()),
        ] {
            let _ = registry.register(metric);
        }
        Self {
            detect,
            jump,
            floor: AtomicI64::new(0),
            epoch: AtomicI64::new(-1),
            seen: AtomicI64::new(0),
            went_back: AtomicI64::new(0),
            settled: AtomicI64::new(-1),
            timeout,
            metrics: EpochMetrics {
                changes,
                epoch,
                detection,
            },
        }
    }

    /// Tokens below this are refused. Never decreases.
    pub fn floor(&self) -> i64 {
        self.floor.load(Ordering::Acquire)
    }

    pub fn detects(&self) -> bool {
        self.metrics.detection.get() == 1
    }

    /// This process fenced a change itself: counted at once, started or not.
    fn fenced(&self, floor: i64, epoch: i64, went_back: i64) {
        if self.epoch.fetch_max(epoch, Ordering::AcqRel) < epoch {
            self.metrics.changes.inc();
        }
        self.learn(floor, epoch, went_back);
    }

    fn learn(&self, floor: i64, epoch: i64, went_back: i64) {
        self.floor.fetch_max(floor, Ordering::AcqRel);
        self.went_back.fetch_max(went_back, Ordering::AcqRel);
        let before = self.epoch.fetch_max(epoch, Ordering::AcqRel);
        if before >= 0 && epoch > before {
            self.metrics
                .changes
                .inc_by(u64::try_from(epoch - before).unwrap_or(1));
        }
        self.metrics
            .epoch
            .set(self.epoch.load(Ordering::Acquire).max(0));
    }

    /// The check every session passes before it is used: the server it reached is the one
    /// the database was acknowledged on, or the change is fenced now.
    pub async fn check_session(&self, client: &mut Client) -> Result<(), EpochError> {
        let limit = self.timeout * 4;
        tokio::time::timeout(limit, self.check_unbounded(client))
            .await
            .unwrap_or_else(|_| {
                Err(EpochError(format!(
                    "no answer within {limit:?}; the session is not used"
                )))
            })
    }

    async fn check_unbounded(&self, client: &mut Client) -> Result<(), EpochError> {
        let row = client.query_one(IDENTITY_SQL, &[]).await?;
        let (same, floor, epoch): (bool, i64, i64) = (row.get(0), row.get(2), row.get(3));
        let went_back: i64 = row.get(7);
        if !self.detect {
            self.learn(floor, epoch, went_back);
            return Ok(());
        }
        if same && !self.floor_below_what_was_seen(floor, epoch) {
            self.learn(floor, epoch, went_back);
            return Ok(());
        }
        self.fence_change(client).await
    }

    /// Another railguard fenced a change this process had not seen yet, and the floor it set
    /// is not above a token this process saw before: the data went back past an earlier floor
    /// (a second rewind, a failover to a standby that missed the last one), and that railguard
    /// did not know. Only PostgreSQL's sequence goes back with the data.
    fn floor_below_what_was_seen(&self, floor: i64, epoch: i64) -> bool {
        let before = self.epoch.load(Ordering::Acquire);
        matches!(self.jump, TokenJump::Sequence)
            && before >= 0
            && epoch > before
            && self.seen.load(Ordering::Acquire) >= floor
    }

    /// Whether the PostgreSQL server ever changed under this database and this process has not
    /// found, since the epoch it last read, that nothing sent before can still reach the rail:
    /// a forward of a newer grant waits for that first (`store::handover`).
    pub fn unsettled_change(&self) -> bool {
        self.went_back.load(Ordering::Acquire) != 0
            && self.epoch.load(Ordering::Acquire) > self.settled.load(Ordering::Acquire)
    }

    /// Nothing sent before the changes up to `epoch` can still reach the rail.
    pub fn change_settled(&self, epoch: i64) {
        self.settled.fetch_max(epoch, Ordering::AcqRel);
    }

    /// A token this process saw granted or accepted: the floor of a later change must be above
    /// it.
    pub fn observe(&self, token: i64) {
        self.seen.fetch_max(token, Ordering::AcqRel);
    }

    /// The server is not the acknowledged one (or the floor set for it is not above what this
    /// process saw): under the row's lock (another railguard may be doing the same), move the
    /// token source, raise the floor, acknowledge the server, audit.
    async fn fence_change(&self, client: &mut Client) -> Result<(), EpochError> {
        let tx = client.transaction().await?;
        let row = tx
            .query_one(&format!("{IDENTITY_SQL} FOR UPDATE OF e"), &[])
            .await?;
        let (same, never, old_floor, old_epoch): (bool, bool, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let (now, before): (String, String) = (row.get(4), row.get(5));
        let clock_us: i64 = row.get(6);
        let old_went_back: i64 = row.get(7);
        if same && !self.floor_below_what_was_seen(old_floor, old_epoch) {
            // Another railguard fenced it while this one waited for the row.
            tx.commit().await?;
            self.learn(old_floor, old_epoch, old_went_back);
            return Ok(());
        }
        let known: i64 = tx.query_one(KNOWN_SQL, &[]).await?.get(0);
        let known = known
            .max(old_floor)
            .max(self.floor())
            .max(self.seen.load(Ordering::Acquire));
        if never && known == 0 {
            // A new database: nothing was ever granted or accepted, nothing to fence.
            let acked = tx.query_one(ACKNOWLEDGE_SQL, &[&0i64, &0i64]).await?;
            tx.commit().await?;
            tracing::info!(server = %now, "database acknowledged on this server");
            self.learn(acked.get(0), acked.get(1), acked.get(2));
            return Ok(());
        }
        let (floor, ended) = match &self.jump {
            TokenJump::Sequence => {
                tx.batch_execute("LOCK TABLE lock_entry IN EXCLUSIVE MODE")
                    .await?;
                // The data may have gone back past an earlier floor with no railguard left
                // that saw it (a second rewind, everything restarted): what the data knows is
                // then below tokens already handed out. The server's clock in microseconds is a
                // lower bound no such token reaches — tokens are drawn far slower than one a
                // microsecond — unless the clock went back too.
                let floor = floor_above(known)?.max(clock_us);
                tx.query_one("SELECT setval('fencing_token_seq', $1, false)", &[&floor])
                    .await?;
                let ended = tx
                    .execute(
                        "UPDATE lock_entry SET expires_at = clock_timestamp() \
                         WHERE token < $1 AND ended_at IS NULL AND expires_at > clock_timestamp()",
                        &[&floor],
                    )
                    .await?;
                (floor, ended)
            }
            TokenJump::Revision(read) => {
                let revision = read().await.map_err(EpochError)?;
                (revision.max(known).saturating_add(1), 0)
            }
        };
        let acked = tx.query_one(ACKNOWLEDGE_SQL, &[&floor, &1i64]).await?;
        let (new_floor, new_epoch, went_back): (i64, i64, i64) =
            (acked.get(0), acked.get(1), acked.get(2));
        let why = if never {
            "first check of this database against its server: whatever happened before is \
             fenced once"
        } else if same {
            "the floor set for this server is not above a token this railguard saw before it: \
             the data went back past an earlier floor"
        } else {
            "the database is served by another server, or the same one restarted, since it was \
             acknowledged: commits may have been lost (a failover, a rewound data directory)"
        };
        let outcome = serde_json::json!({
            "before": before,
            "now": now,
            "floor": new_floor,
            "epoch": new_epoch,
            "grants_ended": ended,
        })
        .to_string();
        tx.execute(AUDIT_SQL, &[&"store_changed", &why, &outcome])
            .await?;
        tx.commit().await?;
        tracing::error!(
            before = %before,
            now = %now,
            floor = new_floor,
            epoch = new_epoch,
            grants_ended = ended,
            "!!! THE DATABASE RAILGUARD FENCES AGAINST CHANGED SERVER !!! ({why}). The fencing \
             floor was raised: every grant from before is fenced out once and its holder takes a \
             new one (docs/operations.md, \"When a store goes back\")"
        );
        self.fenced(new_floor, new_epoch, went_back);
        Ok(())
    }

    /// Raises the floor to at least `floor` (the token source went back on its own: etcd
    /// restored), one epoch on, audited with `why`. Returns the floor in force.
    pub async fn raise_floor(
        &self,
        client: &mut Client,
        floor: i64,
        why: &str,
        details: serde_json::Value,
    ) -> Result<i64, EpochError> {
        let tx = client.transaction().await?;
        let row = tx
            .query_one(
                "UPDATE railguard_store_epoch SET floor = GREATEST(floor, $1), epoch = epoch + 1, \
                 changed_at = now() RETURNING floor, epoch, \
                 COALESCE((extract(epoch FROM went_back_at) * 1000000)::bigint, 0)",
                &[&floor],
            )
            .await?;
        let (new_floor, new_epoch, went_back): (i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2));
        let mut outcome = details;
        outcome["floor"] = new_floor.into();
        outcome["epoch"] = new_epoch.into();
        tx.execute(
            AUDIT_SQL,
            &[&"token_source_went_back", &why, &outcome.to_string()],
        )
        .await?;
        tx.commit().await?;
        tracing::error!(
            floor = new_floor,
            epoch = new_epoch,
            "!!! THE TOKEN SOURCE WENT BACK !!! ({why}). The fencing floor was raised: every \
             grant from before is fenced out once (docs/operations.md, \"When a store goes back\")"
        );
        self.fenced(new_floor, new_epoch, went_back);
        Ok(new_floor)
    }
}

/// The PostgreSQL backend's floor above `known`: the next multiple of [`FLOOR_GAP`] that is
/// more than a gap above it.
pub fn floor_above(known: i64) -> Result<i64, EpochError> {
    known
        .checked_div(FLOOR_GAP)
        .and_then(|n| n.checked_add(2))
        .and_then(|n| n.checked_mul(FLOOR_GAP))
        .ok_or_else(|| {
            EpochError(format!(
                "no floor above {known} fits in a token: the token space is used up"
            ))
        })
}

impl crate::db::SessionCheck for StoreEpoch {
    fn check<'a>(
        &'a self,
        client: &'a mut Client,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>> {
        Box::pin(async move { self.check_session(client).await.map_err(|e| e.to_string()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_is_a_round_number_more_than_a_gap_above_everything_known() {
        assert_eq!(floor_above(0).unwrap(), 2 * FLOOR_GAP);
        assert_eq!(floor_above(41).unwrap(), 2 * FLOOR_GAP);
        assert_eq!(floor_above(FLOOR_GAP - 1).unwrap(), 2 * FLOOR_GAP);
        assert_eq!(floor_above(FLOOR_GAP).unwrap(), 3 * FLOOR_GAP);
        for known in [0, 1, 999_999_999, 1_000_000_000, 5_123_456_789] {
            let floor = floor_above(known).unwrap();
            assert!(floor > known + FLOOR_GAP - 1, "{known} → {floor}");
            assert_eq!(floor % FLOOR_GAP, 0);
        }
        assert!(floor_above(i64::MAX - 1).is_err());
    }
}
