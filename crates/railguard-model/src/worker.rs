//! A payment worker, as `crates/railguard-harness/src/worker.rs` runs one: acquire the
//! account's lock → claim the account's next payment in paydb (fenced) → submit it through
//! the proxy (the grant's token in `Fencing-Token`, the payment id in `Idempotency-Key`) →
//! on the rail's answer complete it in paydb (fenced) → release.
//!
//! The token is a value in the worker's phase, taken from the grant once (FR-02, C2 §2.7).
//! A worker may pause between any two steps for as long as it likes: nothing forces it to
//! act. It may time out waiting for an answer and retry the same submit; it may notice, by a
//! failed renewal, that its lease is gone and stop; a refusal (409) makes it stop too. A
//! payment it leaves unfinished stays `submitting` in paydb and the next holder retries it.

use crate::lock::{GrantId, Token};

/// Where a worker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    Idle,
    /// PostgreSQL: `nextval` returned `token`; the acquire statement has not run yet.
    Drawn {
        token: Token,
    },
    Holding {
        grant: GrantId,
        token: Token,
    },
    Claimed {
        grant: GrantId,
        token: Token,
        payment: u8,
    },
    /// The submit was sent; waiting for the proxy's answer.
    Awaiting {
        grant: GrantId,
        token: Token,
        payment: u8,
    },
    /// The rail took the payment; paydb does not know yet.
    Paid {
        grant: GrantId,
        token: Token,
        payment: u8,
    },
    /// The payment is complete in paydb; the lock is still held.
    Completed {
        grant: GrantId,
        token: Token,
    },
}

impl Phase {
    /// The grant the worker believes it holds, and its token.
    pub fn grant(&self) -> Option<(GrantId, Token)> {
        match *self {
            Phase::Idle | Phase::Drawn { .. } => None,
            Phase::Holding { grant, token }
            | Phase::Claimed { grant, token, .. }
            | Phase::Awaiting { grant, token, .. }
            | Phase::Paid { grant, token, .. }
            | Phase::Completed { grant, token } => Some((grant, token)),
        }
    }
}

/// One worker: the account it works for, where it is, and what it may still do.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Worker {
    pub account: u8,
    pub phase: Phase,
    /// Acquire attempts left (PostgreSQL: draws; etcd and the per-row variant: grants).
    pub acquires_left: u8,
}
