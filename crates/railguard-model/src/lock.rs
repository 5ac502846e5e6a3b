//! The lock service: the two backends' token semantics, and the ledger of every grant.
//!
//! The ledger is the model's ground truth, not part of either backend: grants in the order
//! they were made, each with the token its holder received and whether its lease is still
//! live. The properties judge tokens and the rail's arrivals against it ("newer grant" means
//! made later for the same key, whatever its token says).
//!
//! **PostgreSQL** (`src/lock/postgres.rs`): one global sequence; an acquire draws its token
//! (`nextval`) *before* the statement locks the row, so a draw can go stale; the row is
//! inserted, or an ended row (expired or released) is taken over only if
//! `e.token < EXCLUDED.token`; rows are never deleted.
//!
//! **etcd** (`src/lock/etcd.rs`): one cluster-global revision, bumped by every write (puts,
//! deletes, lease-expiry deletes). Acquire is one txn: create the key if absent; the token is
//! the revision in the txn's response header (the key's new ModRevision). A key whose lease is
//! gone but which etcd has not yet deleted is taken over *in place*: it keeps its
//! CreateRevision and gets a new ModRevision. Release deletes the key.
//!
//! Expiry is an action of its own, enabled whenever a grant is live: there is no clock, so a
//! lease may run out at any moment (INV-07).
//!
//! A store that goes back ([`crate::epoch`]) forgets the grants its rows or keys no longer name:
//! they end there and then, and their holders learn it at their next renewal.

use crate::Backend;
use crate::variants::Variant;

/// A fencing token as the model's small numbers carry it (0 is "none").
pub type Token = u8;
/// Index of a grant in the [`LockService::grants`] ledger: its place in the order of grants.
pub type GrantId = u8;
/// A lock key; key `k` locks account `k`.
pub type Key = u8;

/// Lease IDs as etcd hands them out: unique, and in no particular order.
const LEASE_IDS: [Token; 8] = [9, 4, 12, 2, 7, 5, 11, 3];
/// The wall clock's reading at the start, for [`Variant::WallClockToken`].
const CLOCK_START: Token = 4;
/// How far the NTP step sets the clock back.
const CLOCK_STEP_BACK: Token = 3;

/// Whether a grant still holds its key in the lock service's own view (INV-06).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrantStatus {
    Live,
    /// Its lease ran out (nobody renewed it in time).
    Expired,
    Released,
    /// Ended by the lock service, not by its holder: the store went back and no longer names
    /// it, or its token is below the fencing floor (`src/store/epoch.rs`).
    Ended,
}

/// One grant, as made: who got it, for which key, with which token.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Grant {
    pub key: Key,
    pub worker: u8,
    pub token: Token,
    pub status: GrantStatus,
    /// It took the key over from a grant whose lease had expired (not released).
    pub took_over: bool,
}

/// A `lock_entry` row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PgRow {
    pub token: Token,
    pub grant: GrantId,
    /// Only for [`Variant::PerRowVersionToken`]: the per-row counter.
    pub version: Token,
}

/// An etcd lock key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EtcdEntry {
    pub create_revision: Token,
    pub mod_revision: Token,
    pub grant: GrantId,
}

/// The backend's own state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Store {
    Postgres {
        /// The last value `nextval('fencing_token_seq')` returned.
        last_value: Token,
        rows: Vec<Option<PgRow>>,
    },
    Etcd {
        revision: Token,
        entries: Vec<Option<EtcdEntry>>,
        /// Leases granted so far (for [`Variant::LeaseIdToken`]).
        leases: u8,
        /// The wall clock (for [`Variant::WallClockToken`]).
        clock: Token,
        clock_stepped_back: bool,
    },
}

/// The lock service: its backend and the ledger of grants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LockService {
    pub grants: Vec<Grant>,
    pub store: Store,
}

impl LockService {
    pub fn new(backend: Backend, keys: u8) -> Self {
        let store = match backend {
            Backend::Postgres => Store::Postgres {
                last_value: 0,
                rows: vec![None; keys as usize],
            },
            Backend::Etcd => Store::Etcd {
                revision: 1,
                entries: vec![None; keys as usize],
                leases: 0,
                clock: CLOCK_START,
                clock_stepped_back: false,
            },
        };
        Self {
            grants: Vec::new(),
            store,
        }
    }

    pub fn is_live(&self, grant: GrantId) -> bool {
        self.grants[grant as usize].status == GrantStatus::Live
    }

    /// Whether the key is held by a live grant in the backend's view.
    pub fn is_held(&self, key: Key) -> bool {
        let holder = match &self.store {
            Store::Postgres { rows, .. } => rows[key as usize].as_ref().map(|r| r.grant),
            Store::Etcd { entries, .. } => entries[key as usize].as_ref().map(|e| e.grant),
        };
        holder.is_some_and(|g| self.is_live(g))
    }

    /// PostgreSQL: `nextval('fencing_token_seq')`.
    pub fn draw(&mut self) -> Token {
        match &mut self.store {
            Store::Postgres { last_value, .. } => {
                *last_value += 1;
                *last_value
            }
            Store::Etcd { .. } => unreachable!("etcd has no sequence"),
        }
    }

    fn record(&mut self, key: Key, worker: u8, token: Token, took_over: bool) -> GrantId {
        self.grants.push(Grant {
            key,
            worker,
            token,
            status: GrantStatus::Live,
            took_over,
        });
        (self.grants.len() - 1) as GrantId
    }

    fn expired(&self, grant: GrantId) -> bool {
        self.grants[grant as usize].status == GrantStatus::Expired
    }

    /// PostgreSQL: the acquire statement with an already drawn token (C1 §1.3). `None` when
    /// the key is held, or the draw is stale (the guard refused it): the caller draws again.
    pub fn pg_lock(
        &mut self,
        key: Key,
        worker: u8,
        drawn: Token,
        variant: Option<Variant>,
    ) -> Option<GrantId> {
        let Store::Postgres { rows, .. } = &self.store else {
            unreachable!("a postgres statement on etcd")
        };
        let taking_over = match &rows[key as usize] {
            None => false,
            Some(row) if self.is_live(row.grant) => return None,
            Some(row) => {
                let guard = row.token < drawn || variant == Some(Variant::NoTakeoverTokenGuard);
                if !guard {
                    return None;
                }
                self.expired(row.grant)
            }
        };
        let grant = self.record(key, worker, drawn, taking_over);
        let Store::Postgres { rows, .. } = &mut self.store else {
            unreachable!()
        };
        rows[key as usize] = Some(PgRow {
            token: drawn,
            grant,
            version: 0,
        });
        Some(grant)
    }

    /// PostgreSQL with [`Variant::PerRowVersionToken`]: the token is the row's version + 1,
    /// a released row is gone, so the count restarts. `None` when the key is held.
    pub fn pg_lock_per_row_version(&mut self, key: Key, worker: u8) -> Option<GrantId> {
        let Store::Postgres { rows, .. } = &self.store else {
            unreachable!("a postgres statement on etcd")
        };
        let (version, taking_over) = match &rows[key as usize] {
            None => (1, false),
            Some(row) if self.is_live(row.grant) => return None,
            Some(row) => (row.version + 1, self.expired(row.grant)),
        };
        let grant = self.record(key, worker, version, taking_over);
        let Store::Postgres { rows, .. } = &mut self.store else {
            unreachable!()
        };
        rows[key as usize] = Some(PgRow {
            token: version,
            grant,
            version,
        });
        Some(grant)
    }

    /// etcd: the acquire txn, and the in-place takeover of a key whose lease is gone. `None`
    /// when the key is held by a live lease.
    pub fn etcd_acquire(
        &mut self,
        key: Key,
        worker: u8,
        variant: Option<Variant>,
    ) -> Option<GrantId> {
        if self.is_held(key) {
            return None;
        }
        let Store::Etcd {
            revision, entries, ..
        } = &self.store
        else {
            unreachable!("an etcd txn on postgres")
        };
        let previous = entries[key as usize].clone();
        let new_revision = *revision + 1;
        let (create_revision, taking_over) = match &previous {
            None => (new_revision, false),
            Some(e) => (e.create_revision, self.expired(e.grant)),
        };
        let token = match variant {
            Some(Variant::CreateRevisionToken) => create_revision,
            Some(Variant::LeaseIdToken) => {
                let Store::Etcd { leases, .. } = &self.store else {
                    unreachable!()
                };
                LEASE_IDS[*leases as usize % LEASE_IDS.len()]
            }
            Some(Variant::WallClockToken) => {
                let Store::Etcd { clock, .. } = &self.store else {
                    unreachable!()
                };
                *clock
            }
            _ => new_revision,
        };
        let grant = self.record(key, worker, token, taking_over);
        let Store::Etcd {
            revision,
            entries,
            leases,
            clock,
            ..
        } = &mut self.store
        else {
            unreachable!()
        };
        *revision = new_revision;
        *leases += 1;
        *clock += 1;
        entries[key as usize] = Some(EtcdEntry {
            create_revision,
            mod_revision: new_revision,
            grant,
        });
        Some(grant)
    }

    /// The lease of `grant` runs out. In etcd the key stays until [`Self::reap`] deletes it.
    pub fn expire(&mut self, grant: GrantId) {
        self.grants[grant as usize].status = GrantStatus::Expired;
    }

    /// etcd deletes the key of an expired lease (a write: the revision moves on). Keys that
    /// can be reaped.
    pub fn reapable(&self) -> Vec<Key> {
        match &self.store {
            Store::Etcd { entries, .. } => entries
                .iter()
                .enumerate()
                .filter_map(|(k, e)| {
                    e.as_ref()
                        .filter(|e| !self.is_live(e.grant))
                        .map(|_| k as Key)
                })
                .collect(),
            Store::Postgres { .. } => Vec::new(),
        }
    }

    pub fn reap(&mut self, key: Key) {
        if let Store::Etcd {
            revision, entries, ..
        } = &mut self.store
        {
            *revision += 1;
            entries[key as usize] = None;
        }
    }

    /// Release (FR-04): ends the grant only if it still holds the key. True when it did.
    pub fn release(&mut self, grant: GrantId, variant: Option<Variant>) -> bool {
        if !self.is_live(grant) {
            return false;
        }
        let key = self.grants[grant as usize].key;
        self.grants[grant as usize].status = GrantStatus::Released;
        match &mut self.store {
            Store::Postgres { rows, .. } => {
                if variant == Some(Variant::PerRowVersionToken) {
                    rows[key as usize] = None;
                }
            }
            Store::Etcd {
                revision, entries, ..
            } => {
                *revision += 1;
                entries[key as usize] = None;
            }
        }
        true
    }

    /// Takes back the grant just made, before its holder received it: the etcd backend's
    /// issued-token check found its token not above the key's recorded one. etcd deletes the
    /// key again (a write: the revision moves on).
    pub fn withdraw_last(&mut self) {
        let grant = self.grants.pop().expect("a grant to withdraw");
        if let Store::Etcd {
            revision, entries, ..
        } = &mut self.store
        {
            *revision += 1;
            entries[grant.key as usize] = None;
        }
    }

    /// etcd's revision now (0 on PostgreSQL).
    pub fn revision(&self) -> Token {
        match &self.store {
            Store::Etcd { revision, .. } => *revision,
            Store::Postgres { .. } => 0,
        }
    }

    /// PostgreSQL: `fencing_token_seq`'s last value (0 on etcd).
    pub fn sequence(&self) -> Token {
        match &self.store {
            Store::Postgres { last_value, .. } => *last_value,
            Store::Etcd { .. } => 0,
        }
    }

    /// Moves the token source up to `floor`, so that no token drawn from now on is below it.
    /// PostgreSQL: `setval('fencing_token_seq', floor, false)`, the next `nextval` is `floor`;
    /// etcd: writes to a scratch key until the revision is `floor`, the next grant's is above.
    pub fn fast_forward(&mut self, floor: Token) {
        match &mut self.store {
            Store::Postgres { last_value, .. } => *last_value = (*last_value).max(floor - 1),
            Store::Etcd { revision, .. } => *revision = (*revision).max(floor),
        }
    }

    /// Ends every live grant whose token is below `floor`.
    pub fn end_below(&mut self, floor: Token) {
        for grant in &mut self.grants {
            if grant.status == GrantStatus::Live && grant.token < floor {
                grant.status = GrantStatus::Ended;
            }
        }
    }

    /// The store goes back to `earlier` (a copy of [`Self::store`]): PostgreSQL's rows and
    /// sequence, or etcd's revision and keys (the variants' lease and clock counters stay). A
    /// live grant its key's row or entry no longer names is ended.
    pub fn go_back(&mut self, earlier: &Store) {
        match (&mut self.store, earlier) {
            (
                Store::Postgres { last_value, rows },
                Store::Postgres {
                    last_value: then,
                    rows: rows_then,
                },
            ) => {
                *last_value = *then;
                rows.clone_from(rows_then);
            }
            (
                Store::Etcd {
                    revision, entries, ..
                },
                Store::Etcd {
                    revision: then,
                    entries: entries_then,
                    ..
                },
            ) => {
                *revision = *then;
                entries.clone_from(entries_then);
            }
            _ => unreachable!("a copy of the other backend"),
        }
        let named: Vec<Option<GrantId>> = match &self.store {
            Store::Postgres { rows, .. } => {
                rows.iter().map(|r| r.as_ref().map(|r| r.grant)).collect()
            }
            Store::Etcd { entries, .. } => entries
                .iter()
                .map(|e| e.as_ref().map(|e| e.grant))
                .collect(),
        };
        for (g, grant) in self.grants.iter_mut().enumerate() {
            if grant.status == GrantStatus::Live && named[grant.key as usize] != Some(g as GrantId)
            {
                grant.status = GrantStatus::Ended;
            }
        }
    }

    /// What the §A2.3 trap reads at write time: the key's token *now* (ModRevision, or the
    /// row's token), whoever's grant that is. `None` when the key has no entry.
    pub fn current_token(&self, key: Key) -> Option<Token> {
        match &self.store {
            Store::Postgres { rows, .. } => rows[key as usize].as_ref().map(|r| r.token),
            Store::Etcd { entries, .. } => entries[key as usize].as_ref().map(|e| e.mod_revision),
        }
    }

    /// Whether the wall clock may still step back ([`Variant::WallClockToken`]): once, after
    /// it has been read.
    pub fn clock_may_step_back(&self) -> bool {
        matches!(&self.store, Store::Etcd { clock, clock_stepped_back: false, .. } if *clock > CLOCK_START)
    }

    pub fn step_clock_back(&mut self) {
        if let Store::Etcd {
            clock,
            clock_stepped_back,
            ..
        } = &mut self.store
        {
            *clock = clock.saturating_sub(CLOCK_STEP_BACK).max(1);
            *clock_stepped_back = true;
        }
    }
}
