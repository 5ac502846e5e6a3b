//! Reads of accounts' marks, grouped: the fence's last look before a forward starts.
//!
//! A read needs no commit, so it costs PostgreSQL far less than a compare-and-set; grouping
//! the reads of concurrent requests keeps it to one statement per batch. A batch takes every
//! read waiting when a slot frees up (a read that stalls stops holding its slot after a tenth
//! of the database timeout: [`crate::db::slots`]). The reads run on sessions of their own
//! ([`crate::db::build_look_pool`]), whose settings give the statement one plan, the primary
//! key's, instead of a plan per execution.

use std::collections::HashMap;

use deadpool_postgres::Pool;
use tokio::sync::{mpsc, oneshot};

use super::store::StoreError;
use crate::db::DbError;
use crate::db::slots::StatementSlots;
use crate::token::AccountId;

/// The last look, grouped. Only ever run on the look pool's sessions.
pub const LAST_LOOK_SQL: &str =
    "SELECT account_id, highest_token FROM rail_high_water WHERE account_id = ANY($1)";

/// Most reads in one statement.
const MAX_BATCH: usize = 1024;

/// One request waiting for its account's mark.
pub(super) struct Asked {
    pub account: AccountId,
    pub reply: oneshot::Sender<Result<i64, StoreError>>,
}

/// Runs until every sender is gone. Timeouts are the callers' (and the server's
/// `statement_timeout`): a read that answers late changes nothing.
pub(super) async fn run(pool: Pool, slots: StatementSlots, mut queue: mpsc::Receiver<Asked>) {
    while let Some(first) = queue.recv().await {
        let slot = slots.wait().await;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(asked) => batch.push(asked),
                Err(_) => break,
            }
        }
        let pool = pool.clone();
        slots.run(slot, async move {
            answer(&pool, batch).await;
        });
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
