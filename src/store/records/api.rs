//! What the proxy asks of idempotency records, as plain values: which record ([`RecordId`]),
//! one to create with a compare-and-set ([`NewRecord`]), one a compare-and-set created
//! ([`Created`]), and where they live ([`Records`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use super::{Forgot, Record, StoredResponse};
use crate::db::DbError;
use crate::token::AccountId;

/// A record to create with the compare-and-set if, and only if, the request is accepted.
#[derive(Debug, Clone)]
pub struct NewRecord {
    pub key: String,
    pub fingerprint: String,
    /// The request's own random id: see `idempotency_record.owner`.
    pub owner: String,
    /// How long after its creation the record is in doubt unless completed: the owning
    /// request's own remaining time plus the time its completion may take. Decided by the
    /// owner, so that no reader judges it by its own configuration.
    pub in_doubt_after: Duration,
}

/// Which record: an account's key, as created by one request (its owner id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordId {
    pub account: AccountId,
    pub key: String,
    pub owner: String,
}

/// A boxed future, for the object-safe [`Records`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where idempotency records live: PostgreSQL's `idempotency_record`
/// ([`IdempotencyStore`](super::IdempotencyStore)) in the server, memory in the proxy's unit
/// tests.
pub trait Records: Send + Sync + 'static {
    /// The record of `key` on `account`, if there is one.
    fn find<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, DbError>>;

    /// Whether `key` on `account`, first sent under `first_token`, may have had its record
    /// lost with the store: the token is below the fencing floor (it predates the last time
    /// the store went back) and the key has no record now.
    fn first_attempt_lost<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
        first_token: i64,
    ) -> BoxFuture<'a, Result<bool, DbError>>;

    /// Stores the rail's answer for the record's owner: at once if the database takes it,
    /// otherwise in the background (a repeat meanwhile is told `in_flight`).
    fn complete(&self, record: RecordId, response: StoredResponse) -> BoxFuture<'static, ()>;

    /// Says, for the owner, that its forward ended without the rail's answer (in the
    /// background, retried until the database takes it).
    fn declare_in_doubt(&self, record: RecordId);

    /// Stores the rail's answer that came after the owner's forward had ended without it (a
    /// late answer, `late`): the record is completed whether it is still in flight or was
    /// declared in doubt meanwhile. In the background, retried until the database takes it.
    fn complete_late(&self, record: RecordId, response: StoredResponse);

    /// Deletes, in the background, a record whose request cannot have reached the rail.
    fn forget_unsent(&self, record: RecordId);

    /// The rail's lookup found the payment of `key`'s record in doubt: completes the record
    /// with the rail's answer, audited (`resolve`). `false` when it is not in doubt.
    fn complete_from_the_rail<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
        response: StoredResponse,
    ) -> BoxFuture<'a, Result<bool, DbError>>;

    /// The rail's lookup found no payment with `key`: forgets its record in doubt only as
    /// `idempotency-forget` would without an operator's word (`resolve`).
    /// With `dry_run`, only whether it would be forgotten now (`Forgot::WouldForget`).
    fn forget_not_on_the_rail<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<Forgot, DbError>>;

    /// The rail's lookup found no payment under `key`, whose first attempt's record went back
    /// with the store, asked once nothing sent before the change could still reach the rail:
    /// the audit record of its retry going on as the key's first request (`resolve`). The retry
    /// goes on only once it is written.
    fn audit_first_request_after_store_change<'a>(
        &'a self,
        account: &'a AccountId,
        key: &'a str,
    ) -> BoxFuture<'a, Result<(), DbError>>;
}

/// A record a compare-and-set just created, on its way to the request that made it. Until that
/// request takes charge of it ([`take`](Self::take)), nothing can have been forwarded under it:
/// dropped — its verdict undelivered because the caller gave up, or the batch's commit not
/// known to be replicated — it is forgotten, so that a retry of the key is not refused.
#[must_use = "dropping it forgets the record"]
pub struct Created {
    records: Arc<dyn Records>,
    id: Option<RecordId>,
}

impl Created {
    pub fn new(records: Arc<dyn Records>, id: RecordId) -> Self {
        Self {
            records,
            id: Some(id),
        }
    }

    pub fn id(&self) -> &RecordId {
        self.id.as_ref().expect("held until taken")
    }

    /// The record, and where it lives, for its request to decide how it ends.
    pub fn take(mut self) -> (Arc<dyn Records>, RecordId) {
        let id = self.id.take().expect("held until taken");
        (self.records.clone(), id)
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.records.forget_unsent(id);
        }
    }
}

impl std::fmt::Debug for Created {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Created").field(&self.id).finish()
    }
}
