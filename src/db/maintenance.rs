//! Online schema maintenance: changes to indexes of tables that take writes, made with
//! `CREATE INDEX CONCURRENTLY` while railguard serves, outside the numbered migrations.
//!
//! A numbered migration runs in the migrators' transaction; an index built there would block
//! every insert into its table until it was done, minutes on a large table. A concurrent build
//! cannot run in a transaction, and a numbered migration would also bump the schema version,
//! which takes every older process out of rotation (docs/operations.md). What is done here
//! changes no behaviour — both binaries' statements are correct with the index or without it —
//! only cost, so it is not a schema version: the first process of a newer binary does it in
//! the background, others skip it while one holds the maintenance lock, and any of them picks
//! it up again where an interrupted one left it.
//!
//! **The retention index.** Migration 0003 indexed `completed_at`, partial on
//! `state = 'done'`; a completion sets both columns, so no completion of an idempotency record
//! could be a heap-only (HOT) update: each wrote a new row version with new entries in both of
//! the table's indexes. Retention now walks an index on `created_at`, which a completion leaves
//! alone (a record completed before the cutoff was created before it too, so the sweep names
//! both columns and finds its rows with either index). Measured with pgbench on PostgreSQL 15:
//! 0 of 447,000 completions HOT with the old index, 98% with the new one, the completion
//! statement 17-20% faster (docs/performance.md).
//!
//! **What a build holds.** `CREATE INDEX CONCURRENTLY` lets the table's inserts, updates and
//! deletes through, but holds a lock that other schema changes of the table (and VACUUM and
//! ANALYZE) wait for, for the whole build. A future migration that alters
//! `idempotency_record` must not wait behind a build: payments would queue behind it (take
//! this module's lock first, or a short `lock_timeout` and retry). A build that fails leaves an
//! invalid index that inserts still maintain until the next attempt replaces it.

use std::time::Duration;

use super::{DatabaseError, open, pg_config};

/// Arbitrary, fixed: the session advisory lock held while maintenance runs ("rgmaint").
const MAINTENANCE_LOCK: i64 = 0x7267_6d61_696e_7400;

/// The maintenance session's settings, from its start (no `SET` that a transaction-pooling
/// proxy could leave on a connection others use): a build takes as long as the table needs,
/// and a wait for a lock (behind transactions older than the build) gives up after a minute;
/// the next attempt starts it again.
const SESSION_SETTINGS: &str = "-c statement_timeout=0 -c lock_timeout=60s";

/// What one attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Maintenance {
    /// The indexes are as this binary wants them; `changed` says whether this attempt built or
    /// dropped anything.
    Done { changed: bool },
    /// Another session holds the maintenance lock (another railguard, or the server session
    /// of one that was killed mid-build and is finishing it).
    Busy,
}

/// Brings the indexes to what this binary wants, on a session of its own, if no other session
/// is at it. Safe to run at any time and as often as wanted: each step is done only if needed,
/// and an index left invalid by an interrupted build is dropped and built again.
pub async fn run_once(url: &str, timeout: Duration) -> Result<Maintenance, DatabaseError> {
    let mut connect = pg_config(url, timeout)?;
    // Never on a standby of a multi-host URL: it would take the lock and fail every build.
    connect
        .config
        .options(SESSION_SETTINGS)
        .target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    let (client, driver) = open(connect, url).await?;
    let result = async {
        // The session is this function's own, and ends with it, and so does the lock.
        let taken: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&MAINTENANCE_LOCK])
            .await?
            .get(0);
        if !taken {
            return Ok(Maintenance::Busy);
        }
        let mut changed = false;
        match index_valid(&client, "idempotency_record_created_at").await? {
            Some(true) => {}
            found => {
                if found == Some(false) {
                    tracing::info!("dropping idempotency_record_created_at, left invalid by an interrupted build");
                    client
                        .batch_execute("DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_created_at")
                        .await?;
                }
                tracing::info!("building idempotency_record_created_at (CREATE INDEX CONCURRENTLY: records are written meanwhile)");
                client
                    .batch_execute(
                        "CREATE INDEX CONCURRENTLY idempotency_record_created_at \
                         ON idempotency_record (created_at)",
                    )
                    .await?;
                changed = true;
            }
        }
        if index_valid(&client, "idempotency_record_completed_at")
            .await?
            .is_some()
        {
            client
                .batch_execute("DROP INDEX CONCURRENTLY IF EXISTS idempotency_record_completed_at")
                .await?;
            changed = true;
        }
        Ok::<_, tokio_postgres::Error>(Maintenance::Done { changed })
    }
    .await;
    drop(client);
    let _ = driver.await;
    result.map_err(|e| DatabaseError::Maintenance(super::causes(&e)))
}

/// Whether the index exists, and if so whether it is valid.
async fn index_valid(
    client: &tokio_postgres::Client,
    name: &str,
) -> Result<Option<bool>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT i.indisvalid FROM pg_index i
             JOIN pg_class c ON c.oid = i.indexrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relname = $1 AND n.nspname = current_schema()",
            &[&name],
        )
        .await?
        .map(|row| row.get(0)))
}

/// Runs [`run_once`] until the indexes are as wanted, waiting while another session is at it
/// (a railguard, or the server session of one killed mid-build finishing it): what
/// `railguard migrate` does, where a failure is reported rather than retried.
pub async fn wait_until_done(url: &str, timeout: Duration) -> Result<(), DatabaseError> {
    let mut said_busy = false;
    loop {
        match run_once(url, timeout).await? {
            Maintenance::Done { .. } => return Ok(()),
            Maintenance::Busy => {
                if !said_busy {
                    tracing::info!(
                        "another session is bringing the indexes up to date; waiting for it"
                    );
                    said_busy = true;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
}

/// Runs [`run_once`] until the indexes are as wanted, backing off from a minute to an hour
/// between attempts that could not finish (another session at it, a build that gave up
/// behind an old transaction, a role that does not own the table).
pub async fn until_done(url: String, timeout: Duration) {
    let mut wait = Duration::from_secs(60);
    loop {
        match run_once(&url, timeout).await {
            Ok(Maintenance::Done { changed: true }) => {
                tracing::info!(
                    "idempotency records' retention index is current: completions are HOT updates"
                );
                return;
            }
            Ok(Maintenance::Done { changed: false }) => return,
            Ok(Maintenance::Busy) => {
                tracing::info!(retry_in = ?wait, "another session holds the schema maintenance lock");
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait,
                    "could not bring the retention index of idempotency_record up to date; \
                     railguard works without it, at a higher cost per keyed request");
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(3600));
    }
}
