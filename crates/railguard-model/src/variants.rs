//! The alternatives ADR-002 rejected, and the real code's guards removed one at a time.
//!
//! Each variant changes exactly one rule of the model. A variant that the checker could not
//! catch would mean either the model is too weak to see the hazard or the hazard is not real;
//! the tests assert a counterexample exists for each, and that the same bounds pass without
//! the variant, so that the failure is the variant's.
//!
//! Some variants bring the situation they concern with them: the handover ones a second proxy
//! process (unless the bounds let the one restart), the store epoch ones a store that may go
//! back ([`crate::epoch`]), the hold after a store change both. The variants that replace
//! etcd's token source are checked without `lock_issued`, which would only withdraw their
//! grants that do not increase — a wrong source hidden behind lost grants, not made right.

use crate::Backend;

/// One deliberate departure from the protocol as designed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// ADR-002 §A2.3: the worker re-reads "the current token" of the key (etcd: its
    /// ModRevision now; PostgreSQL: the row's token now) when it writes to paydb or submits.
    RereadTokenAtWrite,
    /// etcd: the token is the key's CreateRevision; an in-place steal keeps it (§A2.5).
    CreateRevisionToken,
    /// PostgreSQL: a per-row version column instead of the global sequence, and release
    /// deletes the row (§A2.5).
    PerRowVersionToken,
    /// etcd: the lease ID is the token; lease IDs are unique but not ordered (§A2.5).
    LeaseIdToken,
    /// The token is a wall-clock reading, and the clock may step back once (an NTP step).
    WallClockToken,
    /// PostgreSQL: the takeover condition without `e.token < EXCLUDED.token`; a draw that
    /// stalled between `nextval` and the row lock takes the key with a lower token.
    NoTakeoverTokenGuard,
    /// The proxy without its per-account forwarding order: an accepted lower token's
    /// forward may still be in the network when a higher one is sent.
    NoForwardOrder,
    /// The forwarding order's turn is passed on when the forward is *sent*, not when the rail
    /// has answered.
    TurnReleasedOnSend,
    /// The proxy gives up waiting for the rail (504) and passes the turn on while the forward
    /// may still be in the network — what `ordering.rs` does after an upstream timeout.
    TurnReleasedOnUpstreamTimeout,
    /// The handover off (`fencing.order_across_processes = false`): the compare-and-set records
    /// no entry and nothing waits for another process's forward. Checked with two proxy
    /// processes sharing one database, a worker sending each submit to either (or with one
    /// process that restarts: the instance after it is another process).
    NoCrossProcessOrder,
    /// The handover settles an entry when its forward is *sent*, not when the forward can no
    /// longer reach the rail.
    EntrySettledOnSend,
    /// The compare-and-set's entry replaces every entry in the account's row, not only its own
    /// process's previous one.
    EntryReplacesOthers,
    /// No `Idempotency-Key`: a retry of a payment whose answer was lost reaches the rail again.
    NoIdempotencyKeys,
    /// PostgreSQL backend, the store going back unnoticed (`guard.detect_store_changes =
    /// false`): sessions are used whatever server they reach, no floor is raised, and the
    /// sequence that went back hands out a token again.
    NoStoreEpochCheck,
    /// etcd backend, the same switch: no server check and no `lock_issued`. etcd restored
    /// hands out a revision again; PostgreSQL gone back forgets marks and records, and an old
    /// grant's retry is paid twice.
    NoStoreEpochCheckOnEtcd,
    /// No hold after a store change: once the floor is raised, a forward of a token above it
    /// starts as soon as its handover entries are settled, while another process's forward
    /// from before the change, whose entry went back with the mark row, may still be in the
    /// network. Checked with PostgreSQL going back and two proxy processes (or one that
    /// restarts).
    NoHoldAfterStoreChange,
    /// The rail's lookup by idempotency key forgets a record in doubt it finds no payment for
    /// once the owner can no longer send it, but without waiting until nothing the owner sent
    /// can still reach the rail (`proxy.rail_transit_ms`). Checked with a proxy that restarts
    /// (its records left in doubt, its forwards still in the network).
    LookupBeforeTransit,
    /// Retries without `Idempotency-First-Token`: a payment whose idempotency record went back
    /// with the store (the rail has it) is taken as a new payment by its retry. Checked with
    /// PostgreSQL going back.
    NoFirstToken,
    /// A retry whose first attempt's record may have gone back with the store asks the rail's
    /// lookup at once, not once nothing sent before the change can still reach the rail, and
    /// goes on when the rail has no such payment yet. Checked with PostgreSQL going back.
    LostLookupBeforeHold,
}

impl Variant {
    /// Every variant, in the order of the docs' table.
    pub const ALL: [Variant; 19] = [
        Variant::RereadTokenAtWrite,
        Variant::CreateRevisionToken,
        Variant::PerRowVersionToken,
        Variant::LeaseIdToken,
        Variant::WallClockToken,
        Variant::NoTakeoverTokenGuard,
        Variant::NoForwardOrder,
        Variant::TurnReleasedOnSend,
        Variant::TurnReleasedOnUpstreamTimeout,
        Variant::NoCrossProcessOrder,
        Variant::EntrySettledOnSend,
        Variant::EntryReplacesOthers,
        Variant::NoIdempotencyKeys,
        Variant::NoStoreEpochCheck,
        Variant::NoStoreEpochCheckOnEtcd,
        Variant::NoHoldAfterStoreChange,
        Variant::LookupBeforeTransit,
        Variant::NoFirstToken,
        Variant::LostLookupBeforeHold,
    ];

    /// The backend whose semantics the variant changes (or the one it is checked with).
    pub fn backend(self) -> Backend {
        match self {
            Variant::CreateRevisionToken
            | Variant::LeaseIdToken
            | Variant::WallClockToken
            | Variant::RereadTokenAtWrite
            | Variant::NoStoreEpochCheckOnEtcd => Backend::Etcd,
            Variant::PerRowVersionToken
            | Variant::NoTakeoverTokenGuard
            | Variant::NoForwardOrder
            | Variant::TurnReleasedOnSend
            | Variant::TurnReleasedOnUpstreamTimeout
            | Variant::NoCrossProcessOrder
            | Variant::EntrySettledOnSend
            | Variant::EntryReplacesOthers
            | Variant::NoIdempotencyKeys
            | Variant::NoStoreEpochCheck
            | Variant::NoHoldAfterStoreChange
            | Variant::LookupBeforeTransit
            | Variant::NoFirstToken
            | Variant::LostLookupBeforeHold => Backend::Postgres,
        }
    }

    /// What the variant is, in one line.
    pub fn describe(self) -> &'static str {
        match self {
            Variant::RereadTokenAtWrite => "§A2.3 re-read of the token at write time",
            Variant::CreateRevisionToken => "etcd CreateRevision as the token, in-place steal",
            Variant::PerRowVersionToken => "per-row version column, release deletes the row",
            Variant::LeaseIdToken => "etcd lease ID as the token",
            Variant::WallClockToken => "wall-clock token, the clock steps back",
            Variant::NoTakeoverTokenGuard => {
                "PostgreSQL takeover without `e.token < EXCLUDED.token`"
            }
            Variant::NoForwardOrder => "proxy without its per-account forwarding order",
            Variant::TurnReleasedOnSend => "forwarding turn passed on at send, not at the answer",
            Variant::TurnReleasedOnUpstreamTimeout => {
                "forwarding turn passed on after an upstream timeout (504)"
            }
            Variant::NoCrossProcessOrder => "no handover between proxy processes",
            Variant::EntrySettledOnSend => "handover entry settled when its forward is sent",
            Variant::EntryReplacesOthers => {
                "handover entry replaces the other processes' entries in the row"
            }
            Variant::NoIdempotencyKeys => "no idempotency keys on submits",
            Variant::NoStoreEpochCheck => "PostgreSQL going back unnoticed (no store epoch check)",
            Variant::NoStoreEpochCheckOnEtcd => {
                "etcd or PostgreSQL going back unnoticed (no store epoch check, no lock_issued)"
            }
            Variant::NoHoldAfterStoreChange => {
                "no hold after a store change for other processes' forwards from before it"
            }
            Variant::LookupBeforeTransit => {
                "the rail's lookup forgets a record in doubt before its forward can no longer arrive"
            }
            Variant::NoFirstToken => "retries without Idempotency-First-Token",
            Variant::LostLookupBeforeHold => {
                "the rail's lookup for a record gone back with the store asked before the hold"
            }
        }
    }

    /// The property the variant is expected to break (it may break others too).
    pub fn breaks(self) -> &'static str {
        use crate::properties as p;
        match self {
            Variant::RereadTokenAtWrite => p::EQUAL_TOKEN_SAME_GRANT,
            Variant::CreateRevisionToken => p::EQUAL_TOKEN_SAME_GRANT,
            Variant::PerRowVersionToken => p::INV_04,
            Variant::LeaseIdToken => p::INV_04,
            Variant::WallClockToken => p::INV_04,
            Variant::NoTakeoverTokenGuard => p::INV_04,
            Variant::NoForwardOrder => p::INV_05_RAIL,
            Variant::TurnReleasedOnSend => p::INV_05_RAIL,
            Variant::TurnReleasedOnUpstreamTimeout => p::INV_05_RAIL,
            Variant::NoCrossProcessOrder => p::INV_05_RAIL,
            Variant::EntrySettledOnSend => p::INV_05_RAIL,
            Variant::EntryReplacesOthers => p::INV_05_RAIL,
            Variant::NoIdempotencyKeys => p::INV_02,
            Variant::NoStoreEpochCheck => p::INV_04,
            Variant::NoStoreEpochCheckOnEtcd => p::INV_04,
            Variant::NoHoldAfterStoreChange => p::INV_05_RAIL,
            Variant::LookupBeforeTransit => p::INV_02,
            Variant::NoFirstToken => p::INV_02,
            Variant::LostLookupBeforeHold => p::INV_02,
        }
    }

    /// Further properties the variant must break, each with a counterexample of its own (the
    /// tests assert them too).
    pub fn also_breaks(self) -> &'static [&'static str] {
        use crate::properties as p;
        match self {
            // Marks and records gone back let an old grant's retry through to the rail again;
            // a token handed out twice puts an old grant's forward after a new one's.
            Variant::NoStoreEpochCheck | Variant::NoStoreEpochCheckOnEtcd => {
                &[p::INV_02, p::INV_05_RAIL]
            }
            _ => &[],
        }
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}
