//! The token source of the configured backend, as an operator and the start-up guard see it:
//! where it stands, how to move it forward, and a fresh draw to prove where it stands.
//!
//! Every token a backend grants comes from one counter: PostgreSQL's `fencing_token_seq`, or
//! etcd's cluster revision. The proxy's marks only make sense while that counter is above
//! them: a lockdb restored from a backup, or a switch from one backend to the other, puts it
//! below tokens the proxy has already accepted, and then a new grant can draw a token *equal*
//! to an old grant's (accepted as "the same grant" — the old holder is no longer fenced,
//! INV-05) or below every mark (fenced out: payments stop). C1 §1.7 asks for a fast-forward
//! before traffic resumes; this module is its mechanics, used by `railguard fast-forward`, by
//! the guard ([`super::guard`]) and by the poisoned-account recovery of the admin listener.
//!
//! **Moving forward, never back.** PostgreSQL: `setval` while holding `lock_entry` in
//! `EXCLUSIVE` mode, which every acquire statement needs before it evaluates `nextval`, so no
//! grant draws while the value is read and set, and the value is only ever raised. etcd: a
//! revision cannot be set; it grows by one per write, so the source is moved by writes to a
//! scratch key outside the lock prefix until the revision has passed the target — many
//! concurrent single-put requests (a transaction is one revision however many puts it holds,
//! so batching into transactions would not help). The revision itself is the progress, so an
//! interrupted run resumes where the cluster is.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use deadpool_postgres::Pool;

use super::etcd::EtcdLocks;

/// Why the source could not be read or moved.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SourceError {
    #[error("the token source is unavailable: {0}")]
    Unavailable(String),
    #[error("interrupted at position {0}; run the command again to continue from there")]
    Interrupted(i64),
}

/// How far a fast-forward has come: called often, from one task at a time.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub position: i64,
    pub target: i64,
}

/// The configured backend's token counter.
#[derive(Clone)]
pub enum TokenSource {
    /// `fencing_token_seq` in the railguard database.
    Postgres { pool: Pool, timeout: Duration },
    /// The etcd cluster's revision, moved by writes to `scratch_key`.
    Etcd {
        locks: Arc<EtcdLocks>,
        scratch_key: String,
        /// Writes in flight at once while moving forward.
        concurrency: usize,
    },
}

const PG_POSITION_SQL: &str = "\
SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM fencing_token_seq";

fn pg_error(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unavailable(format!("PostgreSQL: {e}"))
}

impl TokenSource {
    /// `"postgres"` or `"etcd"`.
    pub fn name(&self) -> &'static str {
        match self {
            TokenSource::Postgres { .. } => "postgres",
            TokenSource::Etcd { .. } => "etcd",
        }
    }

    /// Every token this source has issued is at most this, and every later one is above it.
    pub async fn position(&self) -> Result<i64, SourceError> {
        match self {
            TokenSource::Postgres { pool, timeout } => {
                pg_value(pool, *timeout, PG_POSITION_SQL).await
            }
            TokenSource::Etcd {
                locks, scratch_key, ..
            } => {
                let mut client = locks.client().await.map_err(etcd_error)?;
                etcd_position(&mut client, scratch_key, locks.request_timeout()).await
            }
        }
    }

    /// A fresh draw: a value this source will never issue again, and above everything it has
    /// issued so far. What `fast-forward` checks before it reports success.
    pub async fn draw(&self) -> Result<i64, SourceError> {
        match self {
            TokenSource::Postgres { pool, timeout } => {
                pg_value(pool, *timeout, "SELECT nextval('fencing_token_seq')").await
            }
            TokenSource::Etcd {
                locks, scratch_key, ..
            } => {
                let mut client = locks.client().await.map_err(etcd_error)?;
                etcd_put(&mut client, scratch_key, locks.request_timeout()).await
            }
        }
    }

    /// Moves the source until its position is at least `target`; never backwards. Reports
    /// progress as it goes and stops early, with [`SourceError::Interrupted`], once `stop` is
    /// set. Returns the position reached.
    pub async fn advance_to(
        &self,
        target: i64,
        progress: &(dyn Fn(Progress) + Sync),
        stop: &AtomicBool,
    ) -> Result<i64, SourceError> {
        match self {
            TokenSource::Postgres { pool, timeout } => {
                let position = bounded(*timeout * 4, pg_raise(pool, target)).await?;
                progress(Progress { position, target });
                Ok(position)
            }
            TokenSource::Etcd {
                locks,
                scratch_key,
                concurrency,
            } => etcd_advance(locks, scratch_key, *concurrency, target, progress, stop).await,
        }
    }
}

async fn bounded<T>(
    limit: Duration,
    work: impl Future<Output = Result<T, SourceError>>,
) -> Result<T, SourceError> {
    tokio::time::timeout(limit, work).await.unwrap_or_else(|_| {
        Err(SourceError::Unavailable(format!(
            "no answer within {limit:?}"
        )))
    })
}

/// The one bigint `sql` returns.
async fn pg_value(pool: &Pool, timeout: Duration, sql: &str) -> Result<i64, SourceError> {
    bounded(timeout, async {
        let client = pool.get().await.map_err(pg_error)?;
        let row = client.query_one(sql, &[]).await.map_err(pg_error)?;
        Ok(row.get::<_, i64>(0))
    })
    .await
}

/// Raises `fencing_token_seq` to `target` unless it is already there, with every acquire
/// held off meanwhile (see the module docs). Returns the position after.
async fn pg_raise(pool: &Pool, target: i64) -> Result<i64, SourceError> {
    let mut client = pool.get().await.map_err(pg_error)?;
    let transaction = client.transaction().await.map_err(pg_error)?;
    transaction
        .batch_execute("LOCK TABLE lock_entry IN EXCLUSIVE MODE")
        .await
        .map_err(pg_error)?;
    let position: i64 = transaction
        .query_one(PG_POSITION_SQL, &[])
        .await
        .map_err(pg_error)?
        .get(0);
    if position < target {
        transaction
            .query_one("SELECT setval('fencing_token_seq', $1, true)", &[&target])
            .await
            .map_err(pg_error)?;
    }
    transaction.commit().await.map_err(pg_error)?;
    Ok(position.max(target))
}

fn etcd_error(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unavailable(format!("etcd: {e}"))
}

/// The cluster's revision, read linearizably (a get of the scratch key).
async fn etcd_position(
    client: &mut etcd_client::Client,
    key: &str,
    limit: Duration,
) -> Result<i64, SourceError> {
    bounded(limit, async {
        let response = client.get(key, None).await.map_err(etcd_error)?;
        response
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| etcd_error("a get answered without a revision"))
    })
    .await
}

/// One write to the scratch key; its revision.
async fn etcd_put(
    client: &mut etcd_client::Client,
    key: &str,
    limit: Duration,
) -> Result<i64, SourceError> {
    bounded(limit, async {
        let response = client
            .put(key, "railguard fast-forward", None)
            .await
            .map_err(etcd_error)?;
        response
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| etcd_error("a put answered without a revision"))
    })
    .await
}

/// Writes to `key` from `concurrency` tasks until the revision is at least `target`.
async fn etcd_advance(
    locks: &EtcdLocks,
    key: &str,
    concurrency: usize,
    target: i64,
    progress: &(dyn Fn(Progress) + Sync),
    stop: &AtomicBool,
) -> Result<i64, SourceError> {
    let client = locks.client().await.map_err(etcd_error)?;
    let limit = locks.request_timeout();
    let reached = Arc::new(AtomicI64::new(
        etcd_position(&mut client.clone(), key, limit).await?,
    ));
    progress(Progress {
        position: reached.load(Ordering::Relaxed),
        target,
    });
    if reached.load(Ordering::Relaxed) >= target {
        return Ok(reached.load(Ordering::Relaxed));
    }
    let halt = Arc::new(AtomicBool::new(false));
    let mut writers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let mut client = client.clone();
        let reached = reached.clone();
        let halt = halt.clone();
        let key = key.to_string();
        writers.spawn(async move {
            // A failed write is retried a few times (an election, a slow member); a run of
            // failures ends this writer with the error.
            let mut failures = 0;
            while !halt.load(Ordering::Relaxed) && reached.load(Ordering::Relaxed) < target {
                match etcd_put(&mut client, &key, limit).await {
                    Ok(revision) => {
                        failures = 0;
                        reached.fetch_max(revision, Ordering::Relaxed);
                    }
                    Err(e) => {
                        failures += 1;
                        if failures >= 5 {
                            return Err(e);
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            Ok(())
        });
    }
    let mut failed = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            done = writers.join_next() => match done {
                None => break,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => {
                    failed.get_or_insert(e);
                    halt.store(true, Ordering::Relaxed);
                }
                Some(Err(e)) => {
                    failed.get_or_insert(etcd_error(format!("a writer panicked: {e}")));
                    halt.store(true, Ordering::Relaxed);
                }
            },
            _ = tick.tick() => {
                if stop.load(Ordering::Relaxed) {
                    halt.store(true, Ordering::Relaxed);
                }
                progress(Progress { position: reached.load(Ordering::Relaxed), target });
            }
        }
    }
    let position = reached.load(Ordering::Relaxed);
    progress(Progress { position, target });
    if position >= target {
        return Ok(position);
    }
    match failed {
        Some(e) => Err(e),
        None => Err(SourceError::Interrupted(position)),
    }
}
