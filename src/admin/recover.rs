//! Recovering a poisoned account (`POST /recover`, `railguard recover-account`): an account
//! whose mark is above anything the token source has issued — a bug, a restore, a token from
//! before grant proofs — fences out every grant of its lock key, so its payments stop.
//!
//! A mark is never lowered: the mark is the only thing between a stalled old holder and the
//! rail, and a lower mark would let it through (INV-05). Instead the token source is moved
//! past that mark, so the next grant of the account's lock key draws a token above it. Every
//! other account is unaffected (their marks are lower still). PostgreSQL moves at once; etcd
//! needs one write per revision, so a gap larger than `max_writes` is refused with a pointer
//! to `railguard fast-forward`, which shows progress and can be resumed.
//!
//! Audited: a row in `railguard_audit` records the intent (account, reason) before anything
//! is done and what was found and done after, and the log says it at warn.

use std::sync::atomic::AtomicBool;

use deadpool_postgres::Pool;
use serde::Serialize;

use crate::lock::guard::SourceGuard;
use crate::lock::source::{SourceError, TokenSource};
use crate::token::AccountId;

/// etcd writes a recovery may make before it hands over to `railguard fast-forward`.
pub const MAX_RECOVERY_WRITES: i64 = 1_000_000;

/// What a recovery found and did: the body of a 200.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Recovered {
    /// `recovered`, or `nothing_to_do` when the source was already above the mark.
    pub outcome: &'static str,
    pub account: String,
    pub lock_key: String,
    pub mark: i64,
    /// Where the source stood before.
    pub position: i64,
    /// A fresh draw after the move, above the mark (`recovered` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drawn: Option<i64>,
    pub audit_id: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error(
        "the account's mark is {gap} revisions above etcd's: more than {MAX_RECOVERY_WRITES} \
         writes. Run `railguard fast-forward`, which shows progress and resumes when \
         interrupted; nothing was changed"
    )]
    GapTooLarge { gap: i64 },
    #[error("the mark is the largest token there is: no source can pass it")]
    Unpassable,
    #[error("{0}")]
    Source(#[from] SourceError),
    #[error("PostgreSQL: {0}")]
    Database(String),
    #[error(
        "a fresh draw came out at {drawn}, not above the mark {mark}: NOT recovered; another \
         process may be moving the source back"
    )]
    NotAbove { drawn: i64, mark: i64 },
}

fn db(e: impl std::fmt::Display) -> RecoverError {
    RecoverError::Database(e.to_string())
}

/// Writes the intent; returns the audit row's id.
async fn audit_intent(
    pool: &Pool,
    action: &str,
    account: &AccountId,
    reason: &str,
) -> Result<i64, RecoverError> {
    let client = pool.get().await.map_err(db)?;
    let row = client
        .query_one(
            "INSERT INTO railguard_audit (action, account_id, reason) VALUES ($1, $2, $3) \
             RETURNING id",
            &[&action, &account.as_str(), &reason],
        )
        .await
        .map_err(db)?;
    Ok(row.get(0))
}

async fn audit_outcome(
    pool: &Pool,
    id: i64,
    outcome: serde_json::Value,
) -> Result<(), RecoverError> {
    let client = pool.get().await.map_err(db)?;
    client
        .execute(
            "UPDATE railguard_audit SET outcome = $2::text::jsonb, finished_at = now() \
             WHERE id = $1",
            &[&id, &outcome.to_string()],
        )
        .await
        .map_err(db)?;
    Ok(())
}

/// Records an operator action that has no steps of its own (an idempotency forget).
pub async fn audit(
    pool: &Pool,
    action: &str,
    account: &AccountId,
    reason: &str,
    outcome: serde_json::Value,
) -> Result<(), RecoverError> {
    let id = audit_intent(pool, action, account, reason).await?;
    audit_outcome(pool, id, outcome).await
}

/// Moves the token source past `account`'s mark, audited (see the module docs).
pub async fn recover_account(
    guard: &SourceGuard,
    pool: &Pool,
    account: &AccountId,
    lock_key: String,
    mark: i64,
    reason: &str,
) -> Result<Recovered, RecoverError> {
    let id = audit_intent(pool, "recover_account", account, reason).await?;
    tracing::warn!(account = %account, lock.key = %lock_key, reason, audit_id = id,
        "an operator is recovering an account whose mark may be above the token source");
    let result = move_past(guard.source(), mark).await;
    let outcome = match &result {
        Ok((position, drawn)) => serde_json::json!({
            "mark": mark, "position": position, "drawn": drawn,
            "result": if drawn.is_some() { "recovered" } else { "nothing_to_do" },
        }),
        Err(e) => serde_json::json!({ "mark": mark, "result": "failed", "error": e.to_string() }),
    };
    audit_outcome(pool, id, outcome).await?;
    let (position, drawn) = result?;
    // Grants resume at once if the guard had closed over this mark.
    let _ = guard.check().await;
    tracing::warn!(account = %account, audit_id = id, position, ?drawn,
        "account recovery finished");
    Ok(Recovered {
        outcome: if drawn.is_some() {
            "recovered"
        } else {
            "nothing_to_do"
        },
        account: account.as_str().to_string(),
        lock_key,
        mark,
        position,
        drawn,
        audit_id: id,
    })
}

/// The source's position before, and the fresh draw after moving it (None: nothing to do).
async fn move_past(source: &TokenSource, mark: i64) -> Result<(i64, Option<i64>), RecoverError> {
    let position = source.position().await?;
    if position >= mark {
        return Ok((position, None));
    }
    if matches!(source, TokenSource::Etcd { .. }) && mark - position > MAX_RECOVERY_WRITES {
        return Err(RecoverError::GapTooLarge {
            gap: mark - position,
        });
    }
    let goal = mark.checked_add(1).ok_or(RecoverError::Unpassable)?;
    source
        .advance_to(goal, &|_| {}, &AtomicBool::new(false))
        .await?;
    let drawn = source.draw().await?;
    if drawn <= mark {
        return Err(RecoverError::NotAbove { drawn, mark });
    }
    Ok((position, Some(drawn)))
}
