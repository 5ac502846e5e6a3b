//! Where the fence finds the per-account high-water marks: PostgreSQL's, through
//! [`crate::store::marks`], in the server; marks in memory in this module's unit tests.

use std::future::Future;

use crate::store::marks::{HighWaterStore, StoreError, Verdict};
use crate::store::records::NewRecord;
use crate::token::{AccountId, FencingToken};

/// Where the per-account high-water marks live (FR-17).
pub trait HighWater: Send + Sync + 'static {
    /// The compare-and-set: accepts `token` for `account` iff `token >= mark`, and then sets
    /// `mark := token`; creates `record` in the same commit if accepted, and hands it back
    /// in the verdict.
    fn advance(
        &self,
        account: &AccountId,
        token: FencingToken,
        record: Option<NewRecord>,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send;

    /// The account's mark as the store has it now (0 when it has none).
    fn current_mark(
        &self,
        account: &AccountId,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send;

    /// How long a store operation may take: each of the above ends, with an error if need be,
    /// by then. A record's in-doubt deadline includes it.
    fn timeout(&self) -> std::time::Duration;
}

impl HighWater for HighWaterStore {
    fn advance(
        &self,
        account: &AccountId,
        token: FencingToken,
        record: Option<NewRecord>,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        HighWaterStore::advance(self, account, token, record)
    }

    fn current_mark(
        &self,
        account: &AccountId,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send {
        HighWaterStore::current_mark(self, account)
    }

    fn timeout(&self) -> std::time::Duration {
        HighWaterStore::timeout(self)
    }
}
