//! The fencing protocol of ADR-002, model-checked with [stateright].
//!
//! railguard's safety rests on one argument: a grant's token is drawn once, strictly increases
//! per key, and every fencing point (the paydb fenced UPDATE, the proxy's compare-and-set, its
//! per-account forwarding order and, across processes, the handover) refuses or holds back
//! anything below what it has seen. Tests of the
//! real code exercise a few interleavings; this crate checks *every* interleaving of a small
//! system — workers that acquire, pause for arbitrarily long, write, submit, retry and release;
//! a lock service with PostgreSQL or etcd semantics; the proxy; a rail that records arrivals;
//! a network that delays, reorders and loses messages — and shows that each alternative
//! ADR-002 rejected breaks a property with a concrete counterexample.
//!
//! There are no clocks (INV-07): a lease may expire at any moment its holder is not looking,
//! and a worker may pause between any two of its steps.
//!
//! Map of the modules:
//! - [`lock`]: the lock service, both backends, and the ledger of every grant it made;
//! - [`epoch`]: a store going back (PostgreSQL to an earlier copy, etcd to an older snapshot)
//!   and the store epoch that fences it: the server check, the floor, `lock_issued`;
//! - [`worker`]: the payment worker's steps, from acquire to release;
//! - [`paydb`]: the worker's own database and its fenced UPDATE;
//! - [`proxy`]: the fence — mark cache, compare-and-set, idempotency records, forwarding order,
//!   and the handover that orders an account's forwards across proxy processes;
//! - [`network`]: the messages in flight between workers, proxies and the rail, and the rail;
//! - [`model`]: the [`stateright::Model`] that ties them together;
//! - [`properties`]: INV-02, INV-04, INV-05, INV-06, "equal token ⇒ same grant", and the
//!   `sometimes` checks that show the model is not vacuous (and, with a store that goes back,
//!   the one payment no fencing can save);
//! - [`variants`]: the rejected alternatives and removed guards, each expected to fail;
//! - [`check`]: running the checker and rendering a counterexample readably.

pub mod check;
pub mod epoch;
pub mod lock;
pub mod model;
pub mod network;
pub mod paydb;
pub mod properties;
pub mod proxy;
pub mod variants;
pub mod worker;

pub use check::{Outcome, run};
pub use model::{Action, Bounds, FencingModel, ProtocolState};
pub use variants::Variant;

/// Which lock service backend grants the leases (FR-09).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// One global `nextval`, drawn before the row is locked; takeover of an ended row only
    /// with a higher token; rows are never deleted (FR-11, C1 §1.3).
    Postgres,
    /// A cluster-global revision; the token is the ModRevision in the winning txn's response;
    /// an entry whose lease is gone is taken over in place (FR-10).
    Etcd,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "postgres",
            Backend::Etcd => "etcd",
        })
    }
}
