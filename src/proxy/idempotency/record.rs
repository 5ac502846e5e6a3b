//! The one owner of "a record this request created".
//!
//! The fence's compare-and-set creates a request's idempotency record in the same commit that
//! accepts its token. From that commit on, exactly one value — the [`RecordGuard`] — stands for
//! the record, and the record ends in exactly one of three ways:
//!
//! - **completed** ([`RecordGuard::complete`]): the rail answered; its answer is stored for
//!   replay (now, or in the background once the database takes it);
//! - **forgotten**: the guard is dropped before the forward may have reached the rail — the
//!   caller gave up before the verdict arrived, a higher token was admitted first, the deadline
//!   passed while waiting for a turn, the last look at the mark refused it, or the connection
//!   to the rail was never made. The rail cannot have seen it, so a retry must not be refused:
//!   the record is deleted;
//! - **in doubt**: the guard is dropped after the forward may have reached the rail (a timeout,
//!   a broken connection, a body that never arrived). Whether the rail acted is unknown, so the
//!   record is declared in doubt at once and never forwarded again on its own.
//!
//! Which of the last two applies is decided by one flag, [`MaybeSent`], that the forward sets
//! at the moment a request may have left for the rail — the moment the guard is "disarmed".
//! There is no other path by which a record is removed for being unsent.
//!
//! A record in doubt still takes the rail's answer should it come late, while railguard holds
//! the connection (`late`): a late answer completes it as an answer in time would have.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::store::records::{Created, RecordId, Records, StoredResponse};

/// Set once the forward of a request may have reached the rail. The forward sets it when a
/// connection first asks for the request's body (hyper asks only after the request head is on
/// its way) or, for a request without a body, when the request is handed to the client — the
/// earliest moment the rail can have seen anything.
///
/// It is never cleared, with one exception that is a fact rather than a guess: when the client
/// reports that no connection to the rail could be made ([`MaybeSent::never_connected`]),
/// nothing can have reached the rail, whatever was marked before. That lets an empty-body
/// request that was marked at hand-off still be forgotten when the rail refuses connections.
///
/// The same value also says whether the request was handed to a connection at all
/// ([`MaybeSent::handed_to_connection`]): a forward whose caller left before that sent
/// nothing, whatever an empty body's early mark says (one allocation per request for both).
/// That bit, unlike the sending state, is cleared when a connection hands the request back
/// unwritten ([`MaybeSent::taken_back`]).
#[derive(Debug, Clone, Default)]
pub struct MaybeSent(Arc<AtomicU8>);

/// The sending state, in the low two bits.
const STATE: u8 = 0b011;
const UNSENT: u8 = 0;
const MAYBE: u8 = 1;
const NEVER_CONNECTED: u8 = 2;
/// The request was handed to a connection (a bit of its own).
const HANDED: u8 = 0b100;

impl MaybeSent {
    pub fn set(&self) {
        // Only from "unsent": a request known never to have been connected stays so.
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & STATE == UNSENT).then_some(v | MAYBE)
            });
    }

    /// The connection to the rail was never made: the request cannot have been received.
    pub fn never_connected(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some((v & !STATE) | NEVER_CONNECTED)
            });
    }

    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire) & STATE == MAYBE
    }

    /// The request is being handed to a connection: from now on it may leave for the rail.
    pub fn handed_to_connection(&self) {
        self.0.fetch_or(HANDED, Ordering::AcqRel);
    }

    /// The connection handed the request back unwritten: until another takes it, nothing of
    /// it can leave.
    pub fn taken_back(&self) {
        self.0.fetch_and(!HANDED, Ordering::AcqRel);
    }

    /// Whether the request was handed to a connection.
    pub fn was_handed(&self) -> bool {
        self.0.load(Ordering::Acquire) & HANDED != 0
    }
}

/// Owns a record its request created; see the module docs.
#[must_use = "dropping the guard forgets the record, or declares it in doubt"]
pub struct RecordGuard {
    records: Arc<dyn Records>,
    /// `None` once the record's outcome has been handed over.
    record: Option<RecordId>,
    maybe_sent: MaybeSent,
}

impl RecordGuard {
    /// Takes charge of a record that was just created for `record.owner`.
    pub fn new(records: Arc<dyn Records>, record: RecordId, maybe_sent: MaybeSent) -> Self {
        Self {
            records,
            record: Some(record),
            maybe_sent,
        }
    }

    /// Takes charge of the record the request's compare-and-set created.
    pub fn adopt(created: Created, maybe_sent: MaybeSent) -> Self {
        let (records, record) = created.take();
        Self::new(records, record, maybe_sent)
    }

    pub fn id(&self) -> &RecordId {
        self.record
            .as_ref()
            .expect("a guard holds its record until it is consumed")
    }

    /// The rail answered: store its answer for replay.
    pub async fn complete(mut self, response: StoredResponse) {
        if let Some(record) = self.record.take() {
            self.records.complete(record, response).await;
        }
    }
}

impl Drop for RecordGuard {
    fn drop(&mut self) {
        let Some(record) = self.record.take() else {
            return;
        };
        if self.maybe_sent.is_set() {
            self.records.declare_in_doubt(record);
        } else {
            self.records.forget_unsent(record);
        }
    }
}

impl std::fmt::Debug for RecordGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordGuard")
            .field("record", &self.record)
            .field("maybe_sent", &self.maybe_sent.is_set())
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::db::DbError;
    use crate::store::records::{BoxFuture, Forgot, Record};
    use crate::token::AccountId;

    /// What a guard did with its record.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum Ended {
        Completed(RecordId, u16),
        CompletedLate(RecordId, u16),
        InDoubt(RecordId),
        Forgotten(RecordId),
    }

    /// Records in memory, remembering how each record ended.
    pub(crate) struct MemoryRecords {
        pub(crate) found: Mutex<Option<Record>>,
        /// The fencing floor the store would report.
        pub(crate) floor: i64,
        pub(crate) ended: Mutex<Vec<Ended>>,
        /// What forgetting a record the rail does not have would say.
        pub(crate) forget_verdict: Mutex<Forgot>,
    }

    impl Default for MemoryRecords {
        fn default() -> Self {
            Self {
                found: Mutex::default(),
                floor: 0,
                ended: Mutex::default(),
                forget_verdict: Mutex::new(Forgot::StillInFlight),
            }
        }
    }

    impl MemoryRecords {
        pub(crate) fn ended(&self) -> Vec<Ended> {
            self.ended.lock().unwrap().clone()
        }
    }

    impl Records for MemoryRecords {
        fn find<'a>(
            &'a self,
            _account: &'a AccountId,
            _key: &'a str,
        ) -> BoxFuture<'a, Result<Option<Record>, DbError>> {
            let found = self.found.lock().unwrap().clone();
            Box::pin(async move { Ok(found) })
        }

        fn first_attempt_lost<'a>(
            &'a self,
            _account: &'a AccountId,
            _key: &'a str,
            _first_token: i64,
        ) -> BoxFuture<'a, Result<bool, DbError>> {
            let found = self.found.lock().unwrap().is_some();
            Box::pin(async move { Ok(!found && self.floor > _first_token) })
        }

        fn complete(&self, record: RecordId, response: StoredResponse) -> BoxFuture<'static, ()> {
            self.ended
                .lock()
                .unwrap()
                .push(Ended::Completed(record, response.status));
            Box::pin(async {})
        }

        fn declare_in_doubt(&self, record: RecordId) {
            self.ended.lock().unwrap().push(Ended::InDoubt(record));
        }

        fn complete_late(&self, record: RecordId, response: StoredResponse) {
            self.ended
                .lock()
                .unwrap()
                .push(Ended::CompletedLate(record, response.status));
        }

        fn forget_unsent(&self, record: RecordId) {
            self.ended.lock().unwrap().push(Ended::Forgotten(record));
        }

        fn audit_first_request_after_store_change<'a>(
            &'a self,
            _account: &'a AccountId,
            _key: &'a str,
        ) -> BoxFuture<'a, Result<(), DbError>> {
            Box::pin(async { Ok(()) })
        }

        fn complete_from_the_rail<'a>(
            &'a self,
            _account: &'a AccountId,
            _key: &'a str,
            response: StoredResponse,
        ) -> BoxFuture<'a, Result<bool, DbError>> {
            let mut found = self.found.lock().unwrap();
            let in_doubt = found
                .as_ref()
                .is_some_and(|r| r.state == super::super::RecordState::InDoubt);
            if in_doubt && let Some(record) = found.as_mut() {
                record.state = super::super::RecordState::Done(response);
            }
            Box::pin(async move { Ok(in_doubt) })
        }

        fn forget_not_on_the_rail<'a>(
            &'a self,
            _account: &'a AccountId,
            _key: &'a str,
            dry_run: bool,
        ) -> BoxFuture<'a, Result<Forgot, DbError>> {
            let verdict = match self.forget_verdict.lock().unwrap().clone() {
                Forgot::Forgotten(because) if dry_run => Forgot::WouldForget(because),
                verdict => verdict,
            };
            if matches!(verdict, Forgot::Forgotten(_)) {
                *self.found.lock().unwrap() = None;
            }
            Box::pin(async move { Ok(verdict) })
        }
    }

    pub(crate) fn record_id() -> RecordId {
        RecordId {
            account: AccountId::parse("acct-1", 64).unwrap(),
            key: "pay-1".into(),
            owner: "owner-1".into(),
        }
    }

    #[test]
    fn the_hand_over_to_a_connection_is_told_apart_from_the_sending_state() {
        let m = MaybeSent::default();
        assert!(!m.is_set() && !m.was_handed());
        m.handed_to_connection();
        assert!(m.was_handed() && !m.is_set(), "handed is not sent");
        m.set();
        assert!(m.is_set() && m.was_handed());
        m.never_connected();
        assert!(!m.is_set(), "a connect failure is a fact");
        m.set();
        assert!(!m.is_set(), "and stays so");
        m.taken_back();
        assert!(!m.was_handed(), "handed back unwritten");
        let early = MaybeSent::default();
        early.set();
        assert!(
            early.is_set() && !early.was_handed(),
            "an empty body's early mark"
        );
    }

    #[test]
    fn a_guard_dropped_before_the_send_forgets_its_record() {
        let records = Arc::new(MemoryRecords::default());
        drop(RecordGuard::new(
            records.clone(),
            record_id(),
            MaybeSent::default(),
        ));
        assert_eq!(records.ended(), [Ended::Forgotten(record_id())]);
    }

    #[test]
    fn a_guard_dropped_after_the_send_declares_its_record_in_doubt() {
        let records = Arc::new(MemoryRecords::default());
        let maybe_sent = MaybeSent::default();
        let guard = RecordGuard::new(records.clone(), record_id(), maybe_sent.clone());
        maybe_sent.set();
        drop(guard);
        assert_eq!(records.ended(), [Ended::InDoubt(record_id())]);
    }

    #[tokio::test]
    async fn a_completed_guard_does_nothing_more_when_dropped() {
        let records = Arc::new(MemoryRecords::default());
        let maybe_sent = MaybeSent::default();
        maybe_sent.set();
        let guard = RecordGuard::new(records.clone(), record_id(), maybe_sent);
        guard
            .complete(StoredResponse {
                status: 201,
                headers: vec![],
                body: None,
            })
            .await;
        assert_eq!(records.ended(), [Ended::Completed(record_id(), 201)]);
    }
}
