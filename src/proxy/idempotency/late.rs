//! The rail's answer to a keyed request that comes after its caller stopped waiting.
//!
//! A forward whose request deadline passed (the client got 504) goes on without its caller
//! while the request may be on its way (`forward`'s hand-off), and a response whose body was
//! still coming at the deadline is read on in the background. Its record was declared in doubt
//! when the caller gave up; whatever the rail answers afterwards, while railguard still holds
//! the connection — a graceful stop's drain included — is the payment's outcome, and becomes
//! the record's stored answer ([`Records::complete_late`]): a retry then gets it replayed
//! instead of `409 in_doubt`, and no operator is asked to judge a payment the rail has answered.

use std::sync::Arc;

use super::replay;
use crate::proxy::{BoxError, ProxyResponse};
use crate::store::records::{RecordId, Records};

/// Where a late answer to the request that owns `record` goes. The idempotency layer hands it
/// to the forward with the request (as a request extension); the forward keeps it while it
/// waits for a late answer.
#[derive(Clone)]
pub struct LateAnswer {
    records: Arc<dyn Records>,
    record: RecordId,
    max_response_bytes: usize,
}

impl LateAnswer {
    pub fn new(records: Arc<dyn Records>, record: RecordId, max_response_bytes: usize) -> Self {
        Self {
            records,
            record,
            max_response_bytes,
        }
    }

    /// Reads the rail's late answer and stores it as the record's (in the background, retried
    /// until the database takes it, like any outcome). Returns its status; an error when its
    /// body broke off, which leaves the record in doubt.
    pub async fn store(self, response: ProxyResponse) -> Result<u16, BoxError> {
        let (_, stored) = replay::capture(response, self.max_response_bytes).await?;
        let status = stored.status;
        self.records.complete_late(self.record, stored);
        Ok(status)
    }
}

impl std::fmt::Debug for LateAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LateAnswer")
            .field("record", &self.record)
            .finish()
    }
}
