//! Reads of accounts' marks, grouped: the fence's last look before a forward starts.
//!
//! A read needs no commit, so it costs PostgreSQL far less than a compare-and-set; grouping
//! the reads of concurrent requests keeps it to one statement per batch, run by the same
//! batcher as the compare-and-sets ([`crate::store::batch`]). Reads never wait for one another
//! and lock nothing. The reads run on sessions of their own
//! ([`crate::db::build_look_pool`]), whose settings give the statement one plan, the primary
//! key's, instead of a plan per execution.

use std::collections::HashMap;

use std::future::Future;

use deadpool_postgres::Pool;
use tokio::sync::oneshot;

use super::StoreError;
use crate::db::DbError;
use crate::store::batch::{Fit, Job};
use crate::token::AccountId;

/// The last look, grouped. Only ever run on the look pool's sessions.
pub const LAST_LOOK_SQL: &str =
    "SELECT account_id, highest_token FROM rail_high_water WHERE account_id = ANY($1)";

/// Most reads in one statement.
pub(super) const MAX_BATCH: usize = 1024;

/// One request waiting for its account's mark.
pub(crate) struct Asked {
    pub account: AccountId,
    pub reply: oneshot::Sender<Result<i64, StoreError>>,
}

/// The last look as a batcher's job. Timeouts are the callers' (and the server's
/// `statement_timeout`): a read that answers late changes nothing.
pub(crate) struct Look {
    pub pool: Pool,
}

impl Job for Look {
    type Item = Asked;
    type Taken = ();
    const NAME: &'static str = "look";

    fn wanted(asked: &Asked) -> bool {
        !asked.reply.is_closed()
    }

    fn fits(_: &mut (), _: &Asked) -> Fit {
        Fit::Take
    }

    fn start(&self, batch: Vec<Asked>) -> impl Future<Output = ()> + Send + 'static {
        let pool = self.pool.clone();
        async move { answer(&pool, batch).await }
    }
}

async fn answer(pool: &Pool, batch: Vec<Asked>) {
    let batch: Vec<Asked> = batch.into_iter().filter(|a| !a.reply.is_closed()).collect();
    if batch.is_empty() {
        return;
    }
    let mut accounts: Vec<&str> = batch.iter().map(|a| a.account.as_str()).collect();
    accounts.sort_unstable();
    accounts.dedup();
    let result = async {
        let client = pool.get().await.map_err(DbError::from)?;
        let statement = client.prepare_cached(LAST_LOOK_SQL).await?;
        let rows = client.query(&statement, &[&accounts]).await?;
        Ok::<_, StoreError>(
            rows.into_iter()
                .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1)))
                .collect::<HashMap<_, _>>(),
        )
    }
    .await;
    for asked in batch {
        let reply = match &result {
            // The request's own compare-and-set made the row; a row that is gone holds no
            // mark above anything.
            Ok(marks) => Ok(marks.get(asked.account.as_str()).copied().unwrap_or(0)),
            Err(e) => Err(e.clone()),
        };
        let _ = asked.reply.send(reply);
    }
}
