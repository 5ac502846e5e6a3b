//! What the fence hands the layers below it with a request it let through.
//!
//! One value per request, made once by the fence and moved down the stack with the request
//! ([`Admitted`]): everything the request holds until its forward ends, and every clean-up rule
//! for it, in the parts it owns. Dropped — at any point, by any layer, for any reason — it lets
//! go of each:
//!
//! - its key's record ([`RecordGuard`]): forgotten if the request cannot have reached the rail,
//!   in doubt if it may have;
//! - its turn at the rail ([`Turn`]): the account's next forward in this process may start, and
//!   the forward's entry among the account's forwarders is settled.
//!
//! Its place among the process's outstanding work ([`crate::work`]) is the fence's to count,
//! around everything below it, from before the compare-and-set until the answer is stored.
//!
//! What it says about the request is the fence's decision alone; no layer below changes it.

use super::FencedRequest;
use super::fence::Turn;
use super::idempotency::{MaybeSent, RecordGuard};

/// A request the fence let through, and what it was let through with.
pub struct Admitted {
    pub request: FencedRequest,
    pub admission: Admission,
}

/// What a request holds from its admission until its forward ends; see the module docs.
#[derive(Default)]
pub struct Admission {
    /// The record of the request's idempotency key, when its compare-and-set made it: the
    /// request is the key's first and is forwarded, and its answer is stored for the key.
    pub record: Option<RecordGuard>,
    /// How the request is forwarded with respect to its key.
    pub keyed: Keyed,
    /// Set the moment the request may have left for the rail (its record's guard reads it).
    pub sent: MaybeSent,
    /// The account's turn at the rail; `None` only with fencing off (`fencing.enforce`).
    pub turn: Option<Turn>,
}

/// How an admitted request is forwarded with respect to its idempotency key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Keyed {
    /// As its key says: the key's first request (it holds the record) is forwarded, a repeat
    /// is answered from the record and never forwarded.
    #[default]
    AsItsKeySays,
    /// As if it had no key: fencing is off and no record was made for it (a stale token, or
    /// no verdict from the database), so there is none to answer a repeat from.
    AsUnkeyed,
}
