//! A store that goes back, and the store epoch that fences it (`src/store/epoch.rs`,
//! `migrations/0007_store_epoch.sql`).
//!
//! **What goes back.** PostgreSQL fails over to an asynchronous standby that missed the last
//! commits, or its data directory is put back to an earlier copy: the marks (with the handover
//! entries in their rows), the idempotency records, `railguard_store_epoch`, `lock_issued` and —
//! PostgreSQL backend — the lock rows and `fencing_token_seq` return *together* to an earlier
//! state, consistent in itself. etcd restored from an older snapshot: its revision and the lock
//! keys return, PostgreSQL does not. The model keeps one earlier copy of both stores, taken at
//! any moment (a standby's last replayed commit, a backup, a snapshot), and lets one store go
//! back to it, once per run. Nothing held in memory goes back: the proxy processes' caches,
//! forwarding order and pending forwards, the requests past their compare-and-set, the
//! workers' grants; nor does paydb (another database) or the rail. A grant the lock store no
//! longer names ends there and then ([`crate::lock::LockService::go_back`]); an acquire
//! statement on the old server dies with its session.
//!
//! **How it is noticed.** A rewind or a failover always means a restart or another server, so
//! the server's incarnation changes, while `railguard_store_epoch` went back with the data and
//! still names the old one. Every step that uses a PostgreSQL session — the lock service's
//! statements, the proxy's compare-and-set, its last look, the completion of a record, the
//! etcd backend's `lock_issued` write — first compares the two, in the same atomic step, so
//! no session is used before the check. On a mismatch, under the row's lock, it raises the
//! **floor** and acknowledges the server in one transaction:
//! - PostgreSQL backend: the floor is more than the run could ever draw above everything the
//!   database still knows (sequence, marks, floor, `lock_issued`), `fencing_token_seq` is set
//!   to it, and the grants below it are ended;
//! - etcd backend: etcd did not go back, so the floor is one above its revision now (and
//!   above everything known): every grant made before is below it. Those grants still hold
//!   their keys; they are fenced at the proxy.
//!
//! The compare-and-set refuses every token below the floor. So each holder from before the
//! change is fenced out once and takes a new grant.
//!
//! **etcd going back.** Before an etcd grant is handed out, its token is recorded per key in
//! `lock_issued`; a grant whose token is not above its key's record shows that etcd went back:
//! it is withdrawn (its holder never receives it), the floor is raised above every record and
//! etcd's revision is moved up to the floor before the next grant.
//!
//! **The hold after a store change.** The handover entries ([`crate::proxy`]) went back with the
//! mark rows; the proxy processes' pending forwards, in memory, did not. So, with the handover,
//! once the check has acknowledged a new server, a forward of a token at or above the floor it
//! raised starts — after its turn and its own handover wait, before its last look — only when both
//! hold:
//! - *the quiet bound*: the database's clock is past `changed_at` + `ALIVE` +
//!   `proxy.rail_transit_ms`, by when every process the new database does not know of (stopped,
//!   cut off, its `railguard_forwarder` row gone back) has stopped forwarding and what it sent has
//!   arrived. Here: no forward of a process instance that had stopped by the change is still in the
//!   network;
//! - *no pending forward from before*: no running process's row, which it rewrites from memory on
//!   the new database, lists a pending forward of the same account with a token below the floor —
//!   each has been answered, was never sent, or is past its transit time. Here: no such request of
//!   another instance waits to be sent and no such forward is in the network.
//!
//! A process's own forwards from before the change are behind its forwarding order already: the
//! hold concerns the other processes only. And the last look, on a checked session, also refuses a
//! token below the floor, so a request accepted before the change and not yet sent is never sent.
//! Switched off: [`crate::Variant::NoHoldAfterStoreChange`].
//!
//! **Switched off** (`guard.detect_store_changes = false`, the variants
//! [`crate::Variant::NoStoreEpochCheck`] and [`crate::Variant::NoStoreEpochCheckOnEtcd`]):
//! sessions are used whatever server they reach and nothing is recorded in `lock_issued`; the
//! store going back goes unnoticed.
//!
//! **What it cannot give back, and what stands in for it.** An idempotency record the store
//! lost is gone: nothing railguard keeps still knows whether its payment reached the rail. The
//! worker does: every submit carries the token of the grant that first claimed the payment
//! (`Idempotency-First-Token`, kept in paydb), and a submit whose first token is below the floor
//! and whose key has no record is answered `in_doubt` — unless the rail's lookup, asked once no
//! request of the account from before the change is held by a process or in the network (the
//! hold after a store change), finds no such payment: then it goes on as the key's first
//! request. Without the header ([`crate::Variant::NoFirstToken`]), or with the rail asked at
//! once ([`crate::Variant::LostLookupBeforeHold`]), the payment is paid again (INV-02).
//!
//! **Not modelled.** Both stores going back in one run, or one going back twice. An old
//! PostgreSQL primary that still takes writes after the failover (two primaries at once: that
//! is for the failover tooling to prevent; a session on it would pass the check). A proxy
//! process restarting with the store (its cache and forwarding order are kept). The
//! token-source guard's comparison of the marks with the source's position, which would also
//! stop some grants after etcd went back: `lock_issued` is checked alone here.

use crate::lock::{GrantId, Store, Token};
use crate::proxy::{Entry, Record, Seq};

/// What railguard keeps in PostgreSQL about the store itself: the `railguard_store_epoch` row
/// and `lock_issued`. It goes back with the rest of the database.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Epoch {
    /// The server incarnation the database was last acknowledged on.
    pub acknowledged: u8,
    /// Tokens below it are refused by the compare-and-set and by the last look.
    pub floor: Token,
    /// etcd backend: the highest token granted per key (`lock_issued`).
    pub issued: Vec<Token>,
    /// The server change last acknowledged, which the hold after a store change counts from.
    pub changed: Option<Change>,
}

impl Epoch {
    pub fn new(keys: u8) -> Self {
        Self {
            acknowledged: 0,
            floor: 0,
            issued: vec![0; keys as usize],
            changed: None,
        }
    }
}

/// A server change as the epoch row records it when the check acknowledges the new server: the
/// floor it raised, and `changed_at`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Change {
    /// The floor raised at the change: every token issued before it is below.
    pub floor: Token,
    /// `changed_at`, as the model tells time: per proxy process, the first seq of the instance
    /// running at that moment. An older instance had stopped by then; the new database need
    /// not know it (its row may have gone back), and the quiet bound is what covers it.
    pub running: Vec<Seq>,
}

/// Both stores as they were at one earlier moment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreCopy {
    /// The lock backend's store: PostgreSQL's rows and sequence, or etcd's revision and keys.
    pub lock: Store,
    pub marks: Vec<Token>,
    pub records: Vec<Vec<Record>>,
    /// The handover entries in the accounts' rows.
    pub entries: Vec<Vec<Entry>>,
    pub epoch: Epoch,
}

/// Which store went back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WentBack {
    /// PostgreSQL, to its copy: a failover to a standby that missed commits, or a rewind.
    Postgres,
    /// etcd, restored from its snapshot.
    Etcd,
}

/// The world outside railguard that can take a store back: the server PostgreSQL runs on, the
/// copies, and what going back did (ground truth for the properties).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Past {
    /// The PostgreSQL server's identity (system identifier, timeline, start time), as a number
    /// that changes with every restart or failover.
    pub incarnation: u8,
    /// The copy a store may go back to; none before it is taken and after it was used.
    pub copy: Option<StoreCopy>,
    /// Which store went back, and how many grants had been made by then: grants with a lower
    /// number were made before it.
    pub went_back: Option<(WentBack, GrantId)>,
    /// The (account, payment) whose idempotency record the store lost when it went back: there
    /// at that moment, absent in the copy.
    pub lost_records: Vec<(u8, u8)>,
}

impl Past {
    /// Whether `grant` was made after a store went back.
    pub fn after_going_back(&self, grant: GrantId) -> bool {
        self.went_back.is_some_and(|(_, made)| grant >= made)
    }
}

/// The PostgreSQL backend's floor: `gap` above the highest token the database still knows.
/// The real gap is a billion ("far more tokens than a standby could miss"); the model's is more
/// than the whole run can draw.
pub fn postgres_floor(known: Token, gap: Token) -> Token {
    known + gap
}

/// The etcd backend's floor after PostgreSQL went back: one above etcd's revision now and
/// above everything the database still knows.
pub fn etcd_floor(revision: Token, known: Token) -> Token {
    revision.max(known) + 1
}
