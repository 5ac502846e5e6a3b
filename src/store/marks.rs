//! The accounts' high-water marks in PostgreSQL: `rail_high_water(account_id, highest_token)`.
//!
//! [`HighWaterStore::advance`] is FR-17's compare-and-set: it inserts the account's first mark
//! or raises the existing one, and raises it only when the presented token is at least the
//! mark. PostgreSQL's `ON CONFLICT DO UPDATE` locks the row and evaluates the `WHERE` against
//! the latest committed version, so concurrent advances for one account are serialised by the
//! row lock and the mark never goes down. Equal tokens are accepted: they are the same grant
//! (C1 §1.6), so a holder may send any number of payments under one token.
//!
//! Durability is kept (`synchronous_commit` stays on) and its cost shared: concurrent advances
//! for *different* accounts are grouped into one statement and one commit (`advance`, run by
//! [`super::batch`]). Each
//! request is still exactly one row of that statement with its own verdict, so the semantics
//! are those of one compare-and-set per request, in some order.
//!
//! An advance may carry an idempotency record (C3 §3.1); it is inserted by the same statement,
//! only for an accepted request, so the record exists if and only if the fence let it through,
//! and it comes back inside the verdict as the [`Created`] record the caller takes charge of.
//!
//! Just before a forward starts, the fence reads the account's mark again
//! ([`HighWaterStore::current_mark`]): reads grouped by the same batcher (`look`), no commit.

mod advance;
mod look;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use prometheus::Histogram;
use tokio::sync::{mpsc, oneshot};

pub use self::advance::{ADVANCE_BATCH_SQL, BATCH_SQL};
pub use self::look::LAST_LOOK_SQL;
use crate::db::DbError;
use crate::store::batch::{self, Batching};
use crate::store::handover::{Entry, Foreign, Handover};
use crate::store::instance::InstanceId;
use crate::store::records::{Created, NewRecord, Records};
use crate::token::{AccountId, FencingToken};

/// The single-row compare-and-set, as one statement per request would run it. The proxy runs
/// the batched form (`advance`); benchmarks run this one with `pgbench` as the baseline.
pub const ADVANCE_SQL: &str = "\
INSERT INTO rail_high_water AS h (account_id, highest_token)
SELECT $1, $2 WHERE $2 >= (SELECT floor FROM railguard_store_epoch)
ON CONFLICT (account_id) DO UPDATE
    SET highest_token = EXCLUDED.highest_token, updated_at = now()
    WHERE h.highest_token <= EXCLUDED.highest_token";

/// What the compare-and-set decided.
#[derive(Debug)]
pub enum Verdict {
    /// The token was at least the mark; the mark is now the token. `record`: the request's
    /// idempotency record was created, and is forgotten unless the caller takes charge of it
    /// (`None` when the request had no key, or a record for it already existed). `entry`: the forward as this process's
    /// other processes see it, pending until dropped (`store::handover`); `foreign`: the other
    /// processes' entries the account's row held, whose forwards must be settled before this
    /// one starts.
    Accepted {
        record: Option<Created>,
        entry: Option<Entry>,
        foreign: Foreign,
    },
    /// The mark is above the token; nothing changed and no record was made.
    Stale,
}

/// The database could not give a verdict. Whether a compare-and-set that timed out committed
/// is unknown — which is safe either way (`proxy::fence` says why).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("the fence store is shutting down")]
    Closed,
    #[error("too many fence checks are waiting for the database")]
    Overloaded,
    /// PostgreSQL committed the compare-and-set locally, but its wait for the synchronous
    /// standby was cancelled: a failover may lose it, so it is not taken as accepted.
    #[error(
        "PostgreSQL committed the compare-and-set locally but its wait for the synchronous \
         standby was cancelled: it may be lost at a failover, so it was not taken as accepted"
    )]
    NotReplicated,
    /// The database changed server moments ago, and a forward sent before may still be on its
    /// way to the rail (`store::handover`): nothing was forwarded.
    #[error(
        "the database changed server moments ago: forwards of newer grants wait {0:?} more, \
         until nothing sent before the change can still reach the rail"
    )]
    HeldAfterStoreChange(Duration),
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError::Db(e.into())
    }
}

/// Fence checks that may wait for a statement; past it, new ones get 503 at once instead of
/// queueing behind a database that is not keeping up.
const QUEUE_LIMIT: usize = 16_384;

/// This process, as what the compare-and-sets write besides marks: the owner of the records
/// they make, and (with several processes on one database) its forwarders' entries
/// (`store::handover`; `None`: entries are written but never waited for).
#[derive(Clone)]
pub struct ThisProcess {
    pub instance: InstanceId,
    pub handover: Option<Arc<Handover>>,
}

/// Advances per-account high-water marks.
#[derive(Clone)]
pub struct HighWaterStore {
    pool: Pool,
    /// How statements are grouped; [`ready`](Self::ready) asks whether any batcher is jammed.
    batching: Batching,
    /// The last look's sessions: checked by [`ready`](Self::ready) too.
    looks: Pool,
    timeout: Duration,
    requests: mpsc::Sender<advance::Pending>,
    looks_asked: mpsc::Sender<look::Asked>,
}

impl HighWaterStore {
    /// Starts the batchers; they stop when the last clone of the store is dropped. Records
    /// created here are owned by `process`. The last looks run on `looks`
    /// ([`crate::db::build_look_pool`]), which needs
    /// [`crate::store::batch::most_in_flight`]`(batching.concurrency)` sessions.
    pub fn new(
        pool: Pool,
        looks: Pool,
        timeout: Duration,
        batching: Batching,
        batch_sizes: Histogram,
        process: ThisProcess,
        records: Arc<dyn Records>,
    ) -> Self {
        let (requests, queue) = mpsc::channel(QUEUE_LIMIT);
        let (looks_asked, look_queue) = mpsc::channel(QUEUE_LIMIT);
        tokio::spawn(batch::run(
            look::Look {
                pool: looks.clone(),
            },
            batching.clone(),
            timeout,
            look::MAX_BATCH,
            None,
            look_queue,
        ));
        let advance = advance::Advance {
            pool: pool.clone(),
            notices: batching.notices.clone(),
            instance: process.instance,
            handover: process.handover,
            records,
        };
        let max_batch = batching.max_batch;
        tokio::spawn(batch::run(
            advance,
            batching.clone(),
            timeout,
            max_batch,
            Some(batch_sizes),
            queue,
        ));
        Self {
            pool,
            batching,
            looks,
            timeout,
            requests,
            looks_asked,
        }
    }

    /// The database's fence timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The account's mark as PostgreSQL has it now (a read, grouped with other reads: no
    /// commit). The fence asks this just before a forward starts: a mark that has passed the
    /// request's token since its compare-and-set was raised by another railguard process, and
    /// the request must not reach the rail after the newer one.
    pub async fn current_mark(&self, account: &AccountId) -> Result<i64, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.looks_asked
            .try_send(look::Asked {
                account: account.clone(),
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => StoreError::Overloaded,
                mpsc::error::TrySendError::Closed(_) => StoreError::Closed,
            })?;
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError::Closed),
            Err(_) => Err(DbError::Timeout(self.timeout).into()),
        }
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The compare-and-set: accepts `token` for `account` iff `token >= highest_token`, and then
    /// sets `highest_token := token`; creates `record` in the same transaction if accepted.
    pub async fn advance(
        &self,
        account: &AccountId,
        token: FencingToken,
        record: Option<NewRecord>,
    ) -> Result<Verdict, StoreError> {
        let (reply, verdict) = oneshot::channel();
        let pending = advance::Pending {
            account: account.clone(),
            token,
            record,
            reply,
        };
        self.requests.try_send(pending).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => StoreError::Overloaded,
            mpsc::error::TrySendError::Closed(_) => StoreError::Closed,
        })?;
        let mut verdict = std::pin::pin!(verdict);
        match tokio::time::timeout(self.timeout, &mut verdict).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError::Closed),
            // A verdict that arrived just as we gave up is still the verdict; otherwise dropping
            // the receiver tells the batch we are gone (`advance`).
            Err(_) => match verdict.try_recv() {
                Ok(result) => result,
                Err(_) => Err(DbError::Timeout(self.timeout).into()),
            },
        }
    }

    /// Whether PostgreSQL answers, on the pool and on the last look's sessions (every fenced
    /// request needs both), the schema is the one this binary expects, and no batcher is
    /// jammed by stalled statements (a database that answers a new session may still hold
    /// every statement railguard has in flight).
    pub async fn ready(&self) -> Result<(), String> {
        if let Some(why) = self.batching.jammed() {
            return Err(why);
        }
        let check = async {
            drop(
                self.looks
                    .get()
                    .await
                    .map_err(|e| format!("the last look's sessions: {}", DbError::from(e)))?,
            );
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
