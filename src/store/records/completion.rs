//! Storing a request's outcome: the rail's answer, a declaration of doubt, or the removal of
//! the record of a request that was never sent — at once through the batcher, or in the
//! background until the database takes it.

use std::time::Duration;

use super::*;

impl IdempotencyStore {
    /// Stores the rail's response: the record is `done` from now on. Only the request that
    /// owns the record can complete it. One statement for this record alone: the background
    /// retry's. Requests' own completions are group-committed (`outcomes`).
    pub async fn complete(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), DbError> {
        self.store_one(account, key, owner, response, false)
            .await
            .map(|_| ())
    }

    /// Stores the rail's late answer (`idempotency::late`): the record is `done` with it, whether
    /// it was still in flight or its owner had declared it in doubt. One statement for this
    /// record alone.
    pub async fn complete_late(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), DbError> {
        if self.store_one(account, key, owner, response, true).await? {
            tracing::info!(%account, key, status = response.status,
                "stored the rail's late answer: repeats of this key get it replayed");
        }
        Ok(())
    }

    /// Completes one record with `response` in a statement of its own — a late answer's
    /// statement if `late` — and reports a record that is gone. Whether it was stored.
    async fn store_one(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
        response: &StoredResponse,
        late: bool,
    ) -> Result<bool, DbError> {
        let record = RecordId {
            account: account.clone(),
            key: key.to_string(),
            owner: owner.to_string(),
        };
        self.bounded(async {
            // Its session goes back to the pool before the lookup takes one: a full pool must
            // not make this wait for itself.
            let stored = if late {
                outcomes::complete_late_one(&self.pool, &record, response).await?
            } else {
                outcomes::complete_one(&self.pool, &record, response).await?
            };
            if stored == 0 {
                outcomes::report_gone(&self.pool, &[&record]).await;
            }
            Ok(stored > 0)
        })
        .await
    }

    /// Queues the completion of `record` for the next batch ([`outcomes`]). Once queued, it
    /// is stored whether or not anyone waits for it.
    pub(super) fn queue_completion(
        &self,
        record: RecordId,
        response: StoredResponse,
    ) -> Result<QueuedCompletion, CompletionError> {
        let completions = self.completions.as_ref().ok_or(CompletionError::Closed)?;
        let (reply, stored) = oneshot::channel();
        let claim = outcomes::Claim::default();
        completions
            .try_send(Completion {
                record,
                response,
                claim: claim.clone(),
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => CompletionError::Overloaded,
                mpsc::error::TrySendError::Closed(_) => CompletionError::Closed,
            })?;
        Ok(QueuedCompletion {
            stored,
            claim,
            timeout: self.timeout,
        })
    }

    /// The rail's answer could not be stored now: the client hears it anyway, and the record
    /// is completed as soon as the database takes it (a repeat meanwhile gets `in_flight`).
    pub(super) fn complete_later(
        &self,
        error: &CompletionError,
        record: RecordId,
        response: StoredResponse,
    ) {
        tracing::warn!(error = %error, account = %record.account,
            "could not store the rail's response for replay yet; retrying in the background");
        self.complete_eventually(record.account, record.key, record.owner, response);
    }

    /// Says, for the owner, that its forward ended without an answer: the record is in doubt
    /// now, and may be forgotten by an operator even while this process runs.
    pub async fn declare_in_doubt(
        &self,
        account: &AccountId,
        key: &str,
        owner: &str,
    ) -> Result<(), DbError> {
        self.bounded(async {
            let client = self.client().await?;
            client
                .execute(
                    "UPDATE idempotency_record SET state = 'in_doubt'
                     WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3
                       AND state = 'in_flight'",
                    &[&account.as_str(), &key, &owner],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// [`complete`](Self::complete), retried in the background until the database takes it.
    pub fn complete_eventually(
        &self,
        account: AccountId,
        key: String,
        owner: String,
        response: StoredResponse,
    ) {
        self.store_eventually(account, key, owner, Outcome::Done(response));
    }

    /// [`declare_in_doubt`](Self::declare_in_doubt), retried in the background.
    pub fn declare_in_doubt_eventually(&self, account: AccountId, key: String, owner: String) {
        self.store_eventually(account, key, owner, Outcome::InDoubt);
    }

    pub(super) fn store_eventually(
        &self,
        account: AccountId,
        key: String,
        owner: String,
        outcome: Outcome,
    ) {
        let store = self.clone();
        let pending = &self.outcomes.pending;
        if pending.get() >= MAX_PENDING_OUTCOMES {
            self.outcomes.lost.inc();
            tracing::error!(account = %account, key, "too many idempotency outcomes wait for the database; this record stays in flight and will be in doubt");
            return;
        }
        pending.inc();
        let retrying = self.retrying.start();
        tokio::spawn(async move {
            let _retrying = retrying;
            let started = tokio::time::Instant::now();
            let mut pause = Duration::from_millis(50);
            loop {
                let stored = match &outcome {
                    Outcome::Done(response) => {
                        store.complete(&account, &key, &owner, response).await
                    }
                    Outcome::LateDone(response) => {
                        store.complete_late(&account, &key, &owner, response).await
                    }
                    Outcome::InDoubt => store.declare_in_doubt(&account, &key, &owner).await,
                    Outcome::Unsent => {
                        let record = RecordId {
                            account: account.clone(),
                            key: key.clone(),
                            owner: owner.clone(),
                        };
                        store.delete_if_unsent(&record).await.map(|n| {
                            tracing::info!(account = %account, records = n,
                                "removed the idempotency record of a request that never \
                                 reached the rail");
                        })
                    }
                };
                match stored {
                    Ok(()) => break,
                    Err(e) if started.elapsed() > OUTCOME_RETRY_FOR => {
                        store.outcomes.lost.inc();
                        tracing::error!(account = %account, key, error = %e,
                            "gave up storing an idempotency outcome; the record will be in doubt");
                        break;
                    }
                    Err(e) => {
                        if pause >= Duration::from_secs(1) {
                            tracing::warn!(account = %account, key, error = %e,
                                "idempotency outcome not stored yet; retrying");
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(5));
                    }
                }
            }
            store.outcomes.pending.dec();
        });
    }

    /// Deletes, in the background, a record whose request is known never to have reached the
    /// rail, so that a retry is forwarded rather than refused. The first attempt is one a
    /// graceful stop waits for (within the database timeout); one that fails is retried in the
    /// background until the database takes it, as completions are, but deletes only before the
    /// owner's deadline. Past it (or should the process stop first) the record is in doubt,
    /// which refuses a retry but never repeats a payment.
    pub(super) fn delete_unsent(&self, record: RecordId) {
        let store = self.clone();
        let running = self.unanswered.start();
        tokio::spawn(async move {
            let deleted = store.delete_if_unsent(&record).await;
            drop(running);
            match deleted {
                Ok(n) => tracing::info!(account = %record.account, records = n,
                    "removed the idempotency record of a request that never reached the rail"),
                Err(e) => {
                    tracing::warn!(account = %record.account, error = %e,
                        "could not remove the idempotency record of an unsent request yet; \
                         retrying in the background (a retry meanwhile is told in_flight)");
                    let RecordId {
                        account,
                        key,
                        owner,
                    } = record;
                    store.store_eventually(account, key, owner, Outcome::Unsent);
                }
            }
        });
    }

    /// The delete itself, within the database timeout: only the owner's record, only while
    /// it is still in flight, and only before its owner's deadline (`in_doubt_at`). Past that a
    /// reader may already have been told the record is in doubt, which holds for good: only
    /// an operator lifts it (`idempotency-forget`), so a delete that comes too late changes
    /// nothing, and is not tried again.
    pub(super) async fn delete_if_unsent(&self, record: &RecordId) -> Result<u64, DbError> {
        self.bounded(async {
            let client = self.client().await?;
            Ok(client
                .execute(
                    "DELETE FROM idempotency_record
                     WHERE account_id = $1 AND idempotency_key = $2 AND owner = $3
                       AND state = 'in_flight' AND now() <= COALESCE(in_doubt_at, created_at)",
                    &[&record.account.as_str(), &record.key, &record.owner],
                )
                .await?)
        })
        .await
    }
}

/// A completion queued for a batch ([`IdempotencyStore::queue_completion`]).
pub(super) struct QueuedCompletion {
    stored: oneshot::Receiver<Result<(), DbError>>,
    claim: outcomes::Claim,
    timeout: Duration,
}

/// Why a completion is not stored yet, and who stores it.
pub(super) enum Unstored {
    /// The caller: its batch failed, or the caller stopped waiting before a batch took it.
    Retry(CompletionError),
    /// The batch that took it, still running when the caller stopped waiting: it either
    /// commits, or hands the completion to the background retry itself.
    InBatch(CompletionError),
}

impl QueuedCompletion {
    /// Waits, within the store's timeout, for the commit that holds the completion.
    pub(super) async fn wait(mut self) -> Result<(), Unstored> {
        match tokio::time::timeout(self.timeout, &mut self.stored).await {
            Ok(Ok(result)) => return result.map_err(|e| Unstored::Retry(e.into())),
            Ok(Err(_)) => return Err(Unstored::Retry(CompletionError::Closed)),
            Err(_) => {}
        }
        // From here the batch can no longer answer us: either its answer is already here, or
        // it finds us gone (and, should its statement fail, retries the completion itself).
        self.stored.close();
        match self.stored.try_recv() {
            Ok(result) => result.map_err(|e| Unstored::Retry(e.into())),
            Err(_) => {
                let timeout = CompletionError::Db(DbError::Timeout(self.timeout));
                if self.claim.for_retry() {
                    Err(Unstored::Retry(timeout))
                } else {
                    Err(Unstored::InBatch(timeout))
                }
            }
        }
    }
}

/// A completion was not stored with its batch.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CompletionError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("too many idempotency completions are waiting for the database")]
    Overloaded,
    #[error("the idempotency completion batcher has stopped")]
    Closed,
}
