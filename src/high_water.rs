//! The proxy's fencing point in PostgreSQL: `rail_high_water(account_id, highest_token)`.
//!
//! [`HighWaterStore::advance`] is FR-17's one compare-and-set. It is a single statement that
//! inserts the account's first mark or raises the existing one, and it raises it only when the
//! presented token is at least the mark. PostgreSQL's `ON CONFLICT DO UPDATE` locks the row and
//! evaluates the `WHERE` against the latest committed version, so two concurrent advances for
//! one account are serialised by the row lock and the mark never goes down.
//!
//! Equal tokens are accepted: they are the same grant (C1 §1.6), so a holder may send any
//! number of payments under one token.

use std::time::Duration;

use deadpool_postgres::Pool;

use crate::token::{AccountId, FencingToken};

/// The compare-and-set. One row affected: accepted. None: the mark is above the token.
pub const ADVANCE_SQL: &str = "\
INSERT INTO rail_high_water AS h (account_id, highest_token) VALUES ($1, $2)
ON CONFLICT (account_id) DO UPDATE
    SET highest_token = EXCLUDED.highest_token, updated_at = now()
    WHERE h.highest_token <= EXCLUDED.highest_token";

/// What the compare-and-set decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The token was at least the mark; the mark is now the token.
    Accepted,
    /// The mark is above the token; nothing changed.
    Stale,
}

/// The database could not give a verdict. Whether a compare-and-set that timed out committed
/// is unknown — which is safe either way (see `proxy::fence`).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no database connection: {0}")]
    Pool(String),
    #[error("the fence compare-and-set did not finish within {0:?}")]
    Timeout(Duration),
    #[error("the fence compare-and-set failed: {0}")]
    Query(#[from] tokio_postgres::Error),
}

/// Advances per-account high-water marks.
#[derive(Clone)]
pub struct HighWaterStore {
    pool: Pool,
    timeout: Duration,
}

impl HighWaterStore {
    pub fn new(pool: Pool, timeout: Duration) -> Self {
        Self { pool, timeout }
    }

    /// The compare-and-set: accepts `token` for `account` iff `token >= highest_token`, and then
    /// sets `highest_token := token`. A connection that turns out to have been closed (the
    /// server restarted) is retried once on a fresh one; retrying is safe because advancing to
    /// the same token twice is the same as once.
    pub async fn advance(
        &self,
        account: &AccountId,
        token: FencingToken,
    ) -> Result<Verdict, StoreError> {
        match tokio::time::timeout(self.timeout, self.advance_once(account, token)).await {
            Ok(Err(StoreError::Query(e))) if e.is_closed() => {
                tokio::time::timeout(self.timeout, self.advance_once(account, token))
                    .await
                    .map_err(|_| StoreError::Timeout(self.timeout))?
            }
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    async fn advance_once(
        &self,
        account: &AccountId,
        token: FencingToken,
    ) -> Result<Verdict, StoreError> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| StoreError::Pool(e.to_string()))?;
        let statement = client.prepare_cached(ADVANCE_SQL).await?;
        let rows = client
            .execute(&statement, &[&account.as_str(), &token.get()])
            .await?;
        Ok(if rows == 1 {
            Verdict::Accepted
        } else {
            Verdict::Stale
        })
    }

    /// Whether PostgreSQL answers and the schema is the one this binary expects.
    pub async fn ready(&self) -> Result<(), String> {
        let check = async {
            let client = self.pool.get().await.map_err(|e| e.to_string())?;
            let version = crate::db::migrate::current_version(&**client)
                .await
                .map_err(|e| e.to_string())?;
            let want = crate::db::migrate::latest_version();
            match version {
                Some(v) if v == want => Ok(()),
                other => Err(format!("schema version {other:?}, want {want}")),
            }
        };
        tokio::time::timeout(self.timeout, check)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.timeout)))
    }
}
