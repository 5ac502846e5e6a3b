//! The token-source guard: a restored or switched backend is detected, not discovered by
//! paging.
//!
//! At start and every `guard.interval_ms`, the guard reads the highest high-water mark the
//! proxy has recorded, **then** the token source's position ([`super::source`]). Every mark
//! is a token the proxy accepted, so every token issued before the mark was read is below the
//! position read after it: a position below the highest mark means the source has gone back
//! (a restore, a backend switch) or a mark is poisoned. Until a check finds the source ahead,
//! the lock service grants nothing ([`SourceGuard::permit`], a 503 naming
//! `railguard fast-forward`), `/readyz` fails, `railguard_token_source_behind` is 1 and the
//! log says why, loudly. A failed check (a database or etcd outage) keeps the last verdict:
//! an unchecked source is never trusted.
//!
//! **Between checks**, every acquire takes the highest mark known at its start and, if the
//! grant it gets carries a token at or below it, ends that grant again and closes the guard at
//! once ([`SourceGuard::admit`]): the token was drawn after the mark was read, so it can only
//! be that low if the source went back. The first grant after a restore trips it.
//!
//! **Plausibility** ([`SourceGuard::issued`]): a token above the source's position was never
//! issued. The proxy refuses such a token when it comes without a grant proof
//! (`fencing.require_proof = false`), so that a made-up token cannot poison an account's mark.
//! The position is re-read at most once per wave of such requests.
//!
//! Nothing here is a token a writer could read: the guard holds a mark and a position to
//! compare with, and answers workers yes or no (C2 §2.7). Numbers go to the log and the
//! admin listener only.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::Pool;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::time::Instant;

use super::source::{Progress, SourceError, TokenSource};
use crate::store::epoch::{StoreEpoch, floor_above};

/// The guard's last verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No check has succeeded yet.
    Unchecked,
    /// The source is ahead of every mark: grants are safe.
    Ahead { position: i64, mark: i64 },
    /// The source is at or below a mark: a new grant could repeat an old token.
    Behind { position: i64, mark: i64 },
}

/// The guard's metrics; no labels beyond the fixed outcome.
struct GuardMetrics {
    behind: IntGauge,
    checks: IntCounterVec,
    implausible: IntCounter,
}

pub struct SourceGuard {
    source: TokenSource,
    marks: Pool,
    timeout: Duration,
    verdict: Mutex<Verdict>,
    open: AtomicBool,
    /// The highest mark a completed check read.
    known_mark: AtomicI64,
    /// The highest position any read found: every issued token is at most this.
    ceiling: AtomicI64,
    /// Serialises plausibility re-reads; holds when the last one started.
    reread: tokio::sync::Mutex<Option<Instant>>,
    /// Counts the times a grant showed the source behind: a check that started before such a
    /// moment must not reopen the guard with what it read.
    trips: std::sync::atomic::AtomicU64,
    /// `fencing.lock_key_template` split around `{account}`: which account a lock key fences.
    lock_key: (String, String),
    /// The store's epoch and floor (`store::epoch`): with it, the guard also compares against
    /// every token the etcd backend recorded and the floor, and moves the source on by itself
    /// when it went back.
    epoch: Option<Arc<StoreEpoch>>,
    /// One recovery at a time in this process.
    recovery: tokio::sync::Mutex<()>,
    metrics: GuardMetrics,
}

/// The most writes the guard makes to move etcd's revision on by itself after a restore;
/// past it (a switch of backend from PostgreSQL's far larger tokens) it waits for an operator
/// to run `railguard fast-forward`, which shows its progress.
pub const AUTO_ADVANCE_LIMIT: i64 = 1_000_000;

/// Why the lock service refuses to grant (a 503 on acquire; nothing was granted).
pub const BEHIND_MESSAGE: &str = "the token source is behind the highest fencing mark the proxy \
     has recorded (a restored lockdb or a switched lock backend): a new grant could repeat a \
     token already used. Nothing was granted. An operator must run `railguard fast-forward` \
     (docs/operations.md)";
const UNCHECKED_MESSAGE: &str = "the token source has not yet been checked against the \
     fencing marks (the database or etcd did not answer); nothing was granted, retry later";

const UNREADABLE_MARK_MESSAGE: &str = "the grant could not be checked against its account's \
     fencing mark (PostgreSQL did not answer); nothing was granted, retry later";

/// The highest mark recorded; 0 when there is none.
pub const MAX_MARK_SQL: &str =
    "SELECT COALESCE(max(highest_token), 0)::bigint FROM rail_high_water";

impl SourceGuard {
    pub fn new(source: TokenSource, marks: Pool, timeout: Duration, registry: &Registry) -> Self {
        let behind = IntGauge::new(
            "railguard_token_source_behind",
            "1 while the lock service's token source is not known to be above every fencing \
             mark (behind, or not yet checked): no grants are made; run railguard fast-forward",
        )
        .expect("metric");
        let checks = IntCounterVec::new(
            Opts::new(
                "railguard_token_source_checks_total",
                "Checks of the token source against the highest fencing mark, by outcome",
            ),
            &["outcome"],
        )
        .expect("metric");
        let implausible = IntCounter::new(
            "railguard_implausible_tokens_total",
            "Tokens refused because they are above every token the source has issued",
        )
        .expect("metric");
        for outcome in ["ahead", "behind", "failed"] {
            checks.with_label_values(&[outcome]);
        }
        behind.set(1);
        let _ = registry.register(Box::new(behind.clone()));
        let _ = registry.register(Box::new(checks.clone()));
        let _ = registry.register(Box::new(implausible.clone()));
        Self {
            source,
            marks,
            timeout,
            verdict: Mutex::new(Verdict::Unchecked),
            open: AtomicBool::new(false),
            known_mark: AtomicI64::new(0),
            ceiling: AtomicI64::new(0),
            reread: tokio::sync::Mutex::new(None),
            trips: std::sync::atomic::AtomicU64::new(0),
            lock_key: (String::new(), String::new()),
            epoch: None,
            recovery: tokio::sync::Mutex::new(()),
            metrics: GuardMetrics {
                behind,
                checks,
                implausible,
            },
        }
    }

    /// The lock keys whose grants fence an account: `prefix{account}suffix`.
    pub fn with_lock_key_template(mut self, prefix: &str, suffix: &str) -> Self {
        self.lock_key = (prefix.to_string(), suffix.to_string());
        self
    }

    /// Compares with the store's floor and the etcd backend's recorded tokens too, and moves
    /// the source on by itself when it went back (`guard.detect_store_changes`).
    pub fn with_epoch(mut self, epoch: Arc<StoreEpoch>) -> Self {
        self.epoch = Some(epoch);
        self
    }

    pub fn epoch(&self) -> Option<&Arc<StoreEpoch>> {
        self.epoch.as_ref()
    }

    fn detecting(&self) -> Option<&Arc<StoreEpoch>> {
        self.epoch.as_ref().filter(|epoch| epoch.detects())
    }

    fn account_of<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(self.lock_key.0.as_str())?
            .strip_suffix(self.lock_key.1.as_str())
            .filter(|account| !account.is_empty())
    }

    pub fn source(&self) -> &TokenSource {
        &self.source
    }

    pub fn verdict(&self) -> Verdict {
        self.verdict.lock().expect("guard verdict").clone()
    }

    /// Reads the highest mark, then the position, and records the verdict.
    pub async fn check(&self) -> Result<Verdict, SourceError> {
        let (mut trips, mut moved) = (self.trips.load(Ordering::Acquire), false);
        loop {
            let (mark, issued, position) = match self.read_position_and_mark().await {
                Ok(read) => read,
                Err(e) => {
                    self.metrics.checks.with_label_values(&["failed"]).inc();
                    tracing::warn!(error = %e, verdict = ?self.verdict(),
                        "could not check the token source against the fencing marks; keeping the last verdict");
                    return Err(e);
                }
            };
            let mark = mark.max(issued);
            self.known_mark.fetch_max(mark, Ordering::Relaxed);
            self.ceiling.fetch_max(position, Ordering::Relaxed);
            // Below a token it issued itself (or the floor): the source went back, and is moved
            // on by itself, then read once more. Below a mark only (a switched backend, a
            // poisoned mark) is for an operator to look at: grants wait for `fast-forward`.
            if position < issued && !moved && self.detecting().is_some() {
                moved = true;
                match self.recover(position, issued).await {
                    Ok(()) => {
                        trips = self.trips.load(Ordering::Acquire);
                        continue;
                    }
                    Err(e) => tracing::error!(error = %e, position, issued,
                        "the token source went back and could not be moved on by itself"),
                }
            }
            let verdict = if position < mark {
                Verdict::Behind { position, mark }
            } else if self.trips.load(Ordering::Acquire) != trips {
                // A grant showed the source behind while this check was reading: what it read
                // is older than that, and reopens nothing.
                return Ok(self.verdict());
            } else {
                Verdict::Ahead { position, mark }
            };
            self.record(verdict.clone());
            return Ok(verdict);
        }
    }

    /// The highest mark, the highest token the etcd backend recorded or the floor excludes
    /// (with detection on; else 0), then the source's position: in that order, so that every
    /// token issued before the first read is at most the second.
    async fn read_position_and_mark(&self) -> Result<(i64, i64, i64), SourceError> {
        let (mark, issued) = if self.detecting().is_some() {
            highest_known(&self.marks, self.timeout).await?
        } else {
            (highest_mark(&self.marks, self.timeout).await?, 0)
        };
        let position = self.source.position().await?;
        Ok((mark, issued, position))
    }

    fn record(&self, verdict: Verdict) {
        let mut current = self.verdict.lock().expect("guard verdict");
        match &verdict {
            Verdict::Behind { position, mark } => {
                self.metrics.checks.with_label_values(&["behind"]).inc();
                tracing::error!(
                    source = self.source.name(),
                    position,
                    mark,
                    "!!! THE TOKEN SOURCE IS BEHIND THE FENCING MARKS !!! (a restored lockdb, \
                     a switched lock.backend, or a poisoned mark). The lock API grants nothing \
                     and /readyz fails until an operator runs `railguard fast-forward` \
                     (docs/operations.md)."
                );
            }
            Verdict::Ahead { position, mark } => {
                self.metrics.checks.with_label_values(&["ahead"]).inc();
                if *current != Verdict::Unchecked && !matches!(*current, Verdict::Ahead { .. }) {
                    tracing::warn!(
                        source = self.source.name(),
                        position,
                        mark,
                        "the token source is ahead of every fencing mark again: grants resume"
                    );
                } else if *current == Verdict::Unchecked {
                    tracing::info!(
                        source = self.source.name(),
                        position,
                        mark,
                        "token source is ahead of every fencing mark"
                    );
                }
            }
            Verdict::Unchecked => {}
        }
        let open = matches!(verdict, Verdict::Ahead { .. });
        self.open.store(open, Ordering::Release);
        self.metrics.behind.set(i64::from(!open));
        *current = verdict;
    }

    /// Checks every `interval`, forever (the caller checked once at start). After a failed
    /// check the next comes within a second, so that a short outage at start does not keep
    /// grants refused for a whole interval.
    pub async fn run(&self, interval: Duration) {
        let soon = interval.min(Duration::from_secs(1));
        let mut next = if self.verdict() == Verdict::Unchecked {
            soon
        } else {
            interval
        };
        loop {
            tokio::time::sleep(next).await;
            self.check_store().await;
            next = match self.check().await {
                Ok(_) => interval,
                Err(_) => soon,
            };
        }
    }

    /// The store's server and floor, read again on a session of the pool (a floor another
    /// railguard raised is learnt here; a session opened since a change was checked when it
    /// opened).
    async fn check_store(&self) {
        let Some(epoch) = &self.epoch else {
            return;
        };
        let checked = async {
            let mut client = self.marks.get().await.map_err(|e| e.to_string())?;
            epoch
                .check_session(&mut client)
                .await
                .map_err(|e| e.to_string())
        };
        if let Err(e) = checked.await {
            tracing::warn!(error = %e, "could not check the database's server");
        }
    }

    /// May the lock service grant now? Returns the highest mark known, for [`admit`].
    ///
    /// [`admit`]: Self::admit
    pub fn permit(&self) -> Result<i64, &'static str> {
        if self.open.load(Ordering::Acquire) {
            Ok(self.known_mark.load(Ordering::Relaxed))
        } else if self.verdict() == Verdict::Unchecked {
            Err(UNCHECKED_MESSAGE)
        } else {
            Err(BEHIND_MESSAGE)
        }
    }

    /// A grant of lock `key` made after `permit` returned `mark_before` carries `token`: fine
    /// if it is above that mark and above the current mark of the account the key fences
    /// (read now, so that a source that went back since the last check is caught at the
    /// first grant of an account it would repeat a token for). Otherwise the source has gone
    /// back: closes the guard and says so; the caller ends the grant. A mark that cannot be
    /// read refuses the grant too.
    pub async fn admit(&self, key: &str, token: i64, mark_before: i64) -> Result<(), &'static str> {
        self.ceiling.fetch_max(token, Ordering::Relaxed);
        if let Some(epoch) = &self.epoch {
            epoch.observe(token);
        }
        let mut mark = mark_before;
        let account = self.account_of(key);
        let detecting = self.detecting().is_some();
        if account.is_some() || detecting {
            let sql = match (&self.source, detecting) {
                (TokenSource::Etcd { .. }, true) => ADMIT_RECORDING_SQL,
                _ => ADMIT_SQL,
            };
            match grant_marks(&self.marks, self.timeout, sql, key, token, account).await {
                Ok((new_for_key, current, floor)) => {
                    mark = mark.max(current);
                    if detecting && (!new_for_key || token < floor) {
                        tracing::error!(
                            lock.key = key,
                            lock.token = token,
                            "a grant's token is not above every token granted before for its key, \
                             or is below the fencing floor: the token source went back"
                        );
                        self.trip(token, mark.max(floor));
                        let known = match highest_known(&self.marks, self.timeout).await {
                            Ok((_, issued)) => issued.max(token),
                            Err(_) => token,
                        };
                        match self.recover(token, known).await {
                            // Grants resume once a check that started after the trip finds
                            // the source ahead; this grant is ended all the same.
                            Ok(()) => {
                                let _ = self.check().await;
                            }
                            Err(e) => {
                                tracing::error!(error = %e, "could not move the token source on");
                            }
                        }
                        return Err(BEHIND_MESSAGE);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the granted key's fencing mark");
                    return Err(UNREADABLE_MARK_MESSAGE);
                }
            }
        }
        if token > mark {
            return Ok(());
        }
        self.trip(token, mark);
        if detecting {
            // The source may have gone back below tokens it issued (a restored etcd) for a key
            // this grant did not show: a check now finds it and moves the source on by itself;
            // below a mark alone it stays closed for an operator.
            let _ = self.check().await;
        }
        Err(BEHIND_MESSAGE)
    }

    fn trip(&self, position: i64, mark: i64) {
        self.trips.fetch_add(1, Ordering::AcqRel);
        self.record(Verdict::Behind { position, mark });
    }

    /// The source went back (it is at `position`, below `known`, the highest of the marks,
    /// the etcd backend's recorded tokens and the floor): raises the floor above everything
    /// known, audited, so that every grant from before is fenced out once, then moves the
    /// source to the floor. The next check finds it ahead and grants resume.
    async fn recover(&self, position: i64, known: i64) -> Result<(), String> {
        let Some(epoch) = self.detecting() else {
            return Err("store change detection is off".into());
        };
        let _one = self.recovery.lock().await;
        let floor = match &self.source {
            TokenSource::Postgres { .. } => floor_above(known).map_err(|e| e.to_string())?,
            TokenSource::Etcd { .. } => known.saturating_add(1),
        };
        let current = self.source.position().await.map_err(|e| e.to_string())?;
        if matches!(self.source, TokenSource::Etcd { .. })
            && floor.saturating_sub(current) > AUTO_ADVANCE_LIMIT
        {
            return Err(format!(
                "etcd's revision {current} is {} below the floor {floor}: more writes than the \
                 guard makes by itself; run `railguard fast-forward` (docs/operations.md)",
                floor - current
            ));
        }
        if epoch.floor() < floor {
            let mut client = self.marks.get().await.map_err(|e| e.to_string())?;
            epoch
                .raise_floor(
                    &mut client,
                    floor,
                    "a grant's token, or the token source's position, was not above every token \
                     granted or accepted before: the token source went back (etcd restored \
                     from a snapshot, a switched lock backend)",
                    serde_json::json!({
                        "source": self.source.name(),
                        "position": position,
                        "known": known,
                    }),
                )
                .await
                .map_err(|e| e.to_string())?;
        }
        let logged = std::sync::atomic::AtomicI64::new(0);
        let progress = |p: Progress| {
            let step = (p.target / 20).max(1);
            if p.position / step > logged.load(Ordering::Relaxed) {
                logged.store(p.position / step, Ordering::Relaxed);
                tracing::warn!(
                    position = p.position,
                    target = p.target,
                    "moving the token source past the fencing floor"
                );
            }
        };
        let reached = self
            .source
            .advance_to(
                floor - 1,
                &progress,
                &std::sync::atomic::AtomicBool::new(false),
            )
            .await
            .map_err(|e| e.to_string())?;
        tracing::warn!(
            source = self.source.name(),
            position = reached,
            "the token source is past the fencing floor: grants resume"
        );
        Ok(())
    }

    /// Was `token` ever issued by the source? `false` only when a read of the position that
    /// started after this call found it below `token`.
    pub async fn issued(&self, token: i64) -> Result<bool, SourceError> {
        if token <= self.ceiling.load(Ordering::Relaxed) {
            return Ok(true);
        }
        let arrived = Instant::now();
        let mut last = self.reread.lock().await;
        if token <= self.ceiling.load(Ordering::Relaxed) {
            return Ok(true);
        }
        if last.is_some_and(|started| started > arrived) {
            self.metrics.implausible.inc();
            return Ok(false);
        }
        let started = Instant::now();
        let position = self.source.position().await?;
        *last = Some(started);
        let ceiling = self
            .ceiling
            .fetch_max(position, Ordering::Relaxed)
            .max(position);
        if token <= ceiling {
            Ok(true)
        } else {
            self.metrics.implausible.inc();
            Ok(false)
        }
    }
}

/// "Was this token ever issued?", as the proxy asks it of a token sent without a proof.
pub trait IssuedTokens: Send + Sync + std::fmt::Debug {
    fn issued(
        &self,
        token: i64,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<bool, SourceError>> + Send + '_>>;
}

impl std::fmt::Debug for SourceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceGuard")
            .field("source", &self.source.name())
            .field("verdict", &self.verdict())
            .finish_non_exhaustive()
    }
}

impl IssuedTokens for SourceGuard {
    fn issued(
        &self,
        token: i64,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<bool, SourceError>> + Send + '_>> {
        Box::pin(SourceGuard::issued(self, token))
    }
}

/// What a grant is compared with: whether its token is above every token recorded for its key
/// (always, here: PostgreSQL's grants are the record), its account's mark, and the floor.
const ADMIT_SQL: &str = "\
SELECT $1::text IS NOT NULL AND $2::bigint IS NOT NULL,
       COALESCE((SELECT highest_token FROM rail_high_water WHERE account_id = $3), 0),
       (SELECT floor FROM railguard_store_epoch)";

/// The same for the etcd backend, which records the grant's token for its key first: no row
/// comes back from the insert when the key's recorded token is not below it.
const ADMIT_RECORDING_SQL: &str = "\
WITH issued AS (
    INSERT INTO lock_issued AS l (key, token) VALUES ($1, $2)
    ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token WHERE l.token < EXCLUDED.token
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM issued),
       COALESCE((SELECT highest_token FROM rail_high_water WHERE account_id = $3), 0),
       (SELECT floor FROM railguard_store_epoch)";

/// The highest mark; and the highest of the etcd backend's recorded tokens and the floor's last
/// excluded token: the source's position must not be below either.
const HIGHEST_KNOWN_SQL: &str = "\
SELECT (SELECT COALESCE(max(highest_token), 0) FROM rail_high_water)::bigint,
       GREATEST((SELECT COALESCE(max(token), 0) FROM lock_issued),
                (SELECT floor - 1 FROM railguard_store_epoch))::bigint";

async fn grant_marks(
    pool: &Pool,
    timeout: Duration,
    sql: &'static str,
    key: &str,
    token: i64,
    account: Option<&str>,
) -> Result<(bool, i64, i64), SourceError> {
    let read = async {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        let row = client
            .query_one(sql, &[&key, &token, &account])
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>((row.get(0), row.get(1), row.get(2)))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(found)) => Ok(found),
        Ok(Err(e)) => Err(SourceError::Unavailable(format!(
            "PostgreSQL (fencing marks): {e}"
        ))),
        Err(_) => Err(SourceError::Unavailable(format!(
            "PostgreSQL (fencing marks): no answer within {timeout:?}"
        ))),
    }
}

async fn highest_known(pool: &Pool, timeout: Duration) -> Result<(i64, i64), SourceError> {
    let read = async {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        let row = client
            .query_one(HIGHEST_KNOWN_SQL, &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok::<(i64, i64), String>((row.get(0), row.get(1)))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(known)) => Ok(known),
        Ok(Err(e)) => Err(SourceError::Unavailable(format!(
            "PostgreSQL (fencing marks): {e}"
        ))),
        Err(_) => Err(SourceError::Unavailable(format!(
            "PostgreSQL (fencing marks): no answer within {timeout:?}"
        ))),
    }
}

/// `max(rail_high_water.highest_token)`, 0 when no account has a mark.
pub async fn highest_mark(pool: &Pool, timeout: Duration) -> Result<i64, SourceError> {
    let read = async {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        let row = client
            .query_one(MAX_MARK_SQL, &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok::<i64, String>(row.get(0))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(mark)) => Ok(mark),
        Ok(Err(e)) => Err(SourceError::Unavailable(format!(
            "PostgreSQL (fencing marks): {e}"
        ))),
        Err(_) => Err(SourceError::Unavailable(format!(
            "PostgreSQL (fencing marks): no answer within {timeout:?}"
        ))),
    }
}
