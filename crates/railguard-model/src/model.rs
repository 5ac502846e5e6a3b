//! The [`stateright::Model`]: the whole system's state, the actions that may happen next in
//! it, and what each one does.
//!
//! Every action is one atomic step of one component: a worker's step, a lock service event
//! (a lease expiring, etcd deleting an expired key, the wall clock stepping back), the network
//! delivering or dropping one message, a proxy taking the next step of one request, or a store
//! being copied and later going back to the copy. The checker tries every order of them.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};

use stateright::{Model, Property};

use crate::Backend;
use crate::epoch::{self, Change, Epoch, Past, StoreCopy, WentBack};
use crate::lock::{GrantId, Key, LockService, Token};
use crate::network::{Arrival, Msg, Network, Rail, Reply};
use crate::paydb::{FencedWrite, PayDb, PaymentState};
use crate::properties::{self, Observations};
use crate::proxy::{Checked, Fence, FenceRules, Record, Seq, Stage, Started, Task};
use crate::variants::Variant;
use crate::worker::{Phase, Worker};

/// How big the system is: what keeps the state space finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    pub workers: u8,
    /// Worker `w` works for account `w % accounts`; account `a`'s lock key is `a`.
    pub accounts: u8,
    /// Acquire attempts per worker (PostgreSQL: `nextval` draws; etcd: grants).
    pub acquires_per_worker: u8,
    /// Grants in the whole run (an acquire that would make one more does not happen).
    pub max_grants: u8,
    pub payments_per_account: u8,
    /// Submits repeated after giving up waiting for an answer, by all workers together.
    pub retries: u8,
    /// Proxy processes on the one database; a worker sends each submit (and each retry) to any
    /// of them: nothing routes an account to one process.
    pub proxies: u8,
    /// Proxy process restarts in the whole run: the process dies, losing its memory, and comes
    /// back as a new instance; what it sent may still be in the network.
    pub restarts: u8,
    /// Whether the network may drop messages (it always delays and reorders them).
    pub lossy: bool,
    /// Whether PostgreSQL may go back to an earlier copy (a failover to a standby that missed
    /// commits, a rewound data directory). At most one store goes back per run.
    pub postgres_goes_back: bool,
    /// etcd backend: whether etcd may be restored from an earlier snapshot.
    pub etcd_goes_back: bool,
}

impl Bounds {
    /// Where every variant is caught: two workers of one account, one grant each, two
    /// payments, one retry. Small enough to explore completely without the variant too.
    pub const VARIANTS: Bounds = Bounds {
        workers: 2,
        accounts: 1,
        acquires_per_worker: 1,
        max_grants: 2,
        payments_per_account: 2,
        retries: 1,
        proxies: 1,
        restarts: 0,
        lossy: false,
        postgres_goes_back: false,
        etcd_goes_back: false,
    };

    /// CI's check of the protocol as designed: three workers contending for one account, a
    /// retry, a lossy network.
    pub const THREE_WORKERS: Bounds = Bounds {
        workers: 3,
        accounts: 1,
        acquires_per_worker: 1,
        max_grants: 3,
        payments_per_account: 2,
        retries: 1,
        proxies: 1,
        restarts: 0,
        lossy: true,
        postgres_goes_back: false,
        etcd_goes_back: false,
    };

    /// CI's check with workers that acquire again after they released or lost their grant.
    pub const REACQUIRE: Bounds = Bounds {
        workers: 2,
        accounts: 1,
        acquires_per_worker: 2,
        max_grants: 3,
        payments_per_account: 2,
        retries: 0,
        proxies: 1,
        restarts: 0,
        lossy: false,
        postgres_goes_back: false,
        etcd_goes_back: false,
    };

    /// CI's check with two accounts (two keys: tokens jump by the other key's grants).
    pub const TWO_ACCOUNTS: Bounds = Bounds {
        workers: 3,
        accounts: 2,
        acquires_per_worker: 1,
        max_grants: 3,
        payments_per_account: 1,
        retries: 1,
        proxies: 1,
        restarts: 0,
        lossy: false,
        postgres_goes_back: false,
        etcd_goes_back: false,
    };

    /// The variants' bounds with two proxy processes: the handover's check (CI).
    pub const TWO_PROXIES: Bounds = Bounds {
        proxies: 2,
        ..Bounds::VARIANTS
    };

    /// The variants' bounds with one proxy process that may restart once: the instance after
    /// the restart is ordered behind the one before by the handover (CI).
    pub const RESTART: Bounds = Bounds {
        restarts: 1,
        ..Bounds::VARIANTS
    };

    /// The two proxy processes' bounds with PostgreSQL going back: the hold after a store
    /// change (CI).
    pub const GOING_BACK_TWO_PROXIES: Bounds = Bounds {
        postgres_goes_back: true,
        ..Bounds::TWO_PROXIES
    };

    /// One proxy process that may restart, with PostgreSQL going back: the hold after a store
    /// change across a restart (CI).
    pub const GOING_BACK_RESTART: Bounds = Bounds {
        postgres_goes_back: true,
        ..Bounds::RESTART
    };

    /// Bigger than CI can afford, explored by the ignored test (and the binary) in a release
    /// build: three workers that may each acquire twice, three grants in all, a retry.
    pub const LARGE: Bounds = Bounds {
        workers: 3,
        accounts: 1,
        acquires_per_worker: 2,
        max_grants: 3,
        payments_per_account: 2,
        retries: 1,
        proxies: 1,
        restarts: 0,
        lossy: false,
        postgres_goes_back: false,
        etcd_goes_back: false,
    };

    /// The variants' bounds with a store that may go back: PostgreSQL (both backends) or, on
    /// etcd, etcd itself — once, to a copy taken at any moment before.
    pub const GOING_BACK: Bounds = Bounds {
        postgres_goes_back: true,
        etcd_goes_back: true,
        ..Bounds::VARIANTS
    };

    /// CI's check of a store going back with workers that acquire again: a worker whose grant
    /// was fenced out may take a new one (two grants in all).
    pub const GOING_BACK_REACQUIRE: Bounds = Bounds {
        workers: 2,
        accounts: 1,
        acquires_per_worker: 2,
        max_grants: 2,
        payments_per_account: 2,
        retries: 0,
        proxies: 1,
        restarts: 0,
        lossy: false,
        postgres_goes_back: true,
        etcd_goes_back: true,
    };

    /// Three grants with a store that may go back (one before the copy, one between the copy
    /// and the event, one after): explored by the ignored test.
    pub const GOING_BACK_THREE_GRANTS: Bounds = Bounds {
        max_grants: 3,
        payments_per_account: 1,
        ..Bounds::GOING_BACK_REACQUIRE
    };

    /// [`Bounds::REACQUIRE`] with a store that may go back: explored by the ignored test.
    pub const GOING_BACK_LARGE: Bounds = Bounds {
        postgres_goes_back: true,
        etcd_goes_back: true,
        ..Bounds::REACQUIRE
    };
}

impl fmt::Display for Bounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} workers, {} account(s), {} acquire(s) per worker, {} grants in all, \
             {} payment(s) per account, {} retr{} in all, {} prox{}{}, {} network",
            self.workers,
            self.accounts,
            self.acquires_per_worker,
            self.max_grants,
            self.payments_per_account,
            self.retries,
            if self.retries == 1 { "y" } else { "ies" },
            self.proxies,
            if self.proxies == 1 { "y" } else { "ies" },
            match self.restarts {
                0 => String::new(),
                1 => " (one restart)".to_string(),
                n => format!(" ({n} restarts)"),
            },
            if self.lossy {
                "lossy, reordering"
            } else {
                "reordering"
            }
        )?;
        match (self.postgres_goes_back, self.etcd_goes_back) {
            (true, true) => write!(f, ", PostgreSQL or etcd may go back once"),
            (true, false) => write!(f, ", PostgreSQL may go back once"),
            (false, true) => write!(f, ", etcd may go back once"),
            (false, false) => Ok(()),
        }
    }
}

/// The protocol at some size, as designed or with one [`Variant`].
#[derive(Debug, Clone)]
pub struct FencingModel {
    pub backend: Backend,
    pub variant: Option<Variant>,
    pub bounds: Bounds,
    /// Workers are interchangeable: states that differ only by a renaming of workers (of the
    /// same account) are explored once. Off when a trace is to be read.
    pub symmetry: bool,
    /// The `always` properties already reported violated in this run: each is reported once,
    /// at the first violating state the search visits. stateright would otherwise replace a
    /// discovery with every later one, and breadth-first order's first is a shortest.
    reported: Arc<Mutex<BTreeSet<&'static str>>>,
}

/// The whole system at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProtocolState {
    pub lock: LockService,
    pub workers: Vec<Worker>,
    pub paydb: PayDb,
    pub fence: Fence,
    pub network: Network,
    pub rail: Rail,
    pub seen: Observations,
    /// Retries the workers may still make.
    pub retries_left: u8,
    /// Proxy restarts that may still happen.
    pub restarts_left: u8,
    /// The store epoch, in PostgreSQL beside the marks.
    pub epoch: Epoch,
    /// The server, the stores' earlier copy, and what going back did.
    pub past: Past,
}

/// One step.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// PostgreSQL: the worker's acquire draws `nextval`.
    Draw(u8),
    /// PostgreSQL: the acquire statement runs with the drawn token.
    Lock(u8),
    /// etcd (or the per-row-version variant): the acquire, one transaction.
    Acquire(u8),
    Expire(GrantId),
    /// etcd deletes the key of an expired lease.
    Reap(Key),
    ClockStepsBack,
    /// A renewal answers "lost": the worker stops.
    NoticeLost(u8),
    Claim {
        worker: u8,
        payment: u8,
    },
    Submit {
        worker: u8,
        proxy: u8,
    },
    Retry {
        worker: u8,
        proxy: u8,
    },
    Complete(u8),
    Release(u8),
    Deliver(Msg),
    Drop(Msg),
    /// A proxy asks for the request's turn, looks at the mark once more, and forwards.
    Start(Task),
    /// A proxy stops waiting for the rail's answer (504).
    GiveUp(Task),
    /// A proxy process dies and starts again as a new instance.
    Restart(u8),
    /// The stores as they are now become the copy they may go back to: a standby's last
    /// replayed commit, a backup, an etcd snapshot.
    CopyStores,
    /// PostgreSQL comes back on another server (or restarted) with the data of the copy.
    PostgresGoesBack,
    /// etcd is restored from the copy's snapshot.
    EtcdRestored,
    /// The rail's lookup by idempotency key resolves a record in doubt (on a retry of its key,
    /// `idempotency::resolve`): completed if the rail has the payment, forgotten if not.
    Resolve {
        account: u8,
        payment: u8,
    },
}

fn worker_name(w: u8) -> String {
    format!("W{}", w + 1)
}

fn account_name(a: u8) -> char {
    (b'A' + a) as char
}

/// `, entry P1.2` for forward 2 of P1's sequence; nothing where no handover entry is kept.
fn entry_name(proxy: u8, seq: Seq) -> String {
    if seq == 0 {
        String::new()
    } else {
        format!(", entry P{}.{seq}", proxy + 1)
    }
}

impl fmt::Display for Msg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Msg::Submit {
                worker,
                proxy,
                account,
                token,
                grant,
                payment,
                first,
            } => {
                write!(
                    f,
                    "submit {}→P{}: account {} payment {} token {} (grant g{})",
                    worker_name(worker),
                    proxy + 1,
                    account_name(account),
                    payment + 1,
                    token,
                    grant + 1
                )?;
                if first != 0 && first != token {
                    write!(f, ", first token {first}")?;
                }
                Ok(())
            }
            Msg::Forward {
                proxy,
                account,
                token,
                grant,
                payment,
                seq,
            } => write!(
                f,
                "forward P{}→rail: account {} payment {} token {} (grant g{}){}",
                proxy + 1,
                account_name(account),
                payment + 1,
                token,
                grant + 1,
                entry_name(proxy, seq)
            ),
            Msg::RailAnswer {
                proxy,
                account,
                token,
                payment,
                ..
            } => write!(
                f,
                "rail answer →P{}: account {} payment {} token {} paid",
                proxy + 1,
                account_name(account),
                payment + 1,
                token
            ),
            Msg::Reply {
                worker,
                payment,
                reply,
                ..
            } => write!(
                f,
                "reply →{}: payment {} {}",
                worker_name(worker),
                payment + 1,
                match reply {
                    Reply::Paid => "200 paid",
                    Reply::FencedOut => "409 fenced_out",
                    Reply::InFlight => "409 in_flight",
                    Reply::InDoubt => "409 in_doubt",
                    Reply::UpstreamTimeout => "504 upstream timeout",
                }
            ),
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "P{}'s request of {} (account {} payment {} token {}, grant g{}{})",
            self.proxy + 1,
            worker_name(self.worker),
            account_name(self.account),
            self.payment + 1,
            self.token,
            self.grant + 1,
            entry_name(self.proxy, self.seq)
        )
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Draw(w) => write!(f, "{} draws nextval('fencing_token_seq')", worker_name(*w)),
            Action::Lock(w) => write!(f, "{} runs the acquire statement", worker_name(*w)),
            Action::Acquire(w) => write!(f, "{} acquires", worker_name(*w)),
            Action::Expire(g) => write!(f, "the lease of g{} expires", g + 1),
            Action::Reap(k) => write!(f, "etcd deletes account {}'s expired key", account_name(*k)),
            Action::ClockStepsBack => write!(f, "the wall clock steps back (NTP)"),
            Action::NoticeLost(w) => write!(f, "{}'s renewal answers lost", worker_name(*w)),
            Action::Claim { worker, payment } => write!(
                f,
                "{} claims payment {} (paydb fenced UPDATE)",
                worker_name(*worker),
                payment + 1
            ),
            Action::Submit { worker, proxy } => {
                write!(f, "{} submits through P{}", worker_name(*worker), proxy + 1)
            }
            Action::Retry { worker, proxy } => write!(
                f,
                "{} times out and retries through P{}",
                worker_name(*worker),
                proxy + 1
            ),
            Action::Complete(w) => write!(
                f,
                "{} completes the payment (paydb fenced UPDATE)",
                worker_name(*w)
            ),
            Action::Release(w) => write!(f, "{} releases", worker_name(*w)),
            Action::Deliver(m) => write!(f, "deliver {m}"),
            Action::Drop(m) => write!(f, "lose {m}"),
            Action::Start(t) if t.stage == Stage::HandingOver => write!(
                f,
                "start {t}: nothing it waits for can reach the rail any more; last look, forward"
            ),
            Action::Start(t) if t.seq > 0 => {
                write!(f, "start {t}: turn, handover, last look, forward")
            }
            Action::Start(t) => write!(f, "start {t}: turn, last look, forward"),
            Action::GiveUp(t) => write!(f, "give up waiting for the rail: {t}"),
            Action::Resolve { account, payment } => write!(
                f,
                "the rail's lookup resolves account {}'s payment {} in doubt",
                account_name(*account),
                payment + 1
            ),
            Action::Restart(p) => write!(
                f,
                "P{} DIES and starts again as a new instance (its memory lost, its forwards still \
                 in the network)",
                p + 1
            ),
            Action::CopyStores => write!(f, "the stores are copied (standby, backup, snapshot)"),
            Action::PostgresGoesBack => write!(
                f,
                "PostgreSQL GOES BACK to the copy (failover to a standby that missed commits)"
            ),
            Action::EtcdRestored => write!(f, "etcd IS RESTORED from the copy's snapshot"),
        }
    }
}

impl FencingModel {
    /// The protocol as designed.
    pub fn correct(backend: Backend, bounds: Bounds) -> Self {
        Self {
            backend,
            variant: None,
            bounds,
            symmetry: false,
            reported: Arc::default(),
        }
    }

    /// The protocol with one variant, on the backend the variant concerns.
    pub fn with_variant(variant: Variant, bounds: Bounds) -> Self {
        let bounds = match variant {
            // Two instances: two processes, or one that restarts.
            Variant::NoCrossProcessOrder
            | Variant::EntrySettledOnSend
            | Variant::EntryReplacesOthers
                if bounds.restarts == 0 =>
            {
                Bounds {
                    proxies: bounds.proxies.max(2),
                    ..bounds
                }
            }
            Variant::NoStoreEpochCheck | Variant::NoStoreEpochCheckOnEtcd => Bounds {
                postgres_goes_back: true,
                etcd_goes_back: true,
                ..bounds
            },
            // A record in doubt whose owner is gone: a process that restarts.
            Variant::LookupBeforeTransit => Bounds {
                restarts: bounds.restarts.max(1),
                ..bounds
            },
            // PostgreSQL going back, and two instances (two processes, or one that restarts).
            // PostgreSQL going back, taking a record with it.
            Variant::NoFirstToken | Variant::LostLookupBeforeHold => Bounds {
                postgres_goes_back: true,
                ..bounds
            },
            Variant::NoHoldAfterStoreChange => Bounds {
                proxies: if bounds.restarts == 0 {
                    bounds.proxies.max(2)
                } else {
                    bounds.proxies
                },
                postgres_goes_back: true,
                ..bounds
            },
            _ => bounds,
        };
        Self {
            backend: variant.backend(),
            variant: Some(variant),
            bounds,
            symmetry: false,
            reported: Arc::default(),
        }
    }

    /// The same model, exploring states up to a renaming of workers.
    pub fn with_symmetry(self) -> Self {
        Self {
            symmetry: true,
            ..self
        }
    }

    /// The same model, with no violation reported yet: for a new run of the checker.
    pub(crate) fn for_new_run(self) -> Self {
        Self {
            reported: Arc::default(),
            ..self
        }
    }

    /// The verdict of `always` property `name` on a state where its condition is `holds`:
    /// false only for the first violating state of the run (see `reported`).
    pub fn judge(&self, name: &'static str, holds: bool) -> bool {
        holds
            || !self
                .reported
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(name)
    }

    fn is(&self, variant: Variant) -> bool {
        self.variant == Some(variant)
    }

    /// The proxy's rules in force (all of them but the one the variant switches off).
    pub fn rules(&self) -> FenceRules {
        FenceRules {
            ordering: !self.is(Variant::NoForwardOrder),
            turn_until_answer: !self.is(Variant::TurnReleasedOnSend),
            idempotency: !self.is(Variant::NoIdempotencyKeys),
            handover: self.handover(),
            keep_other_entries: !self.is(Variant::EntryReplacesOthers),
            settle_after_transit: !self.is(Variant::EntrySettledOnSend),
            hold_after_store_change: !self.is(Variant::NoHoldAfterStoreChange),
        }
    }

    /// Whether the handover orders forwards across processes: with more than one process
    /// instance (two processes, or one that restarts), unless switched off. (With one that
    /// never restarts, the row only ever holds the process's own entry.)
    pub fn handover(&self) -> bool {
        (self.bounds.proxies > 1 || self.bounds.restarts > 0)
            && !self.is(Variant::NoCrossProcessOrder)
    }

    /// Whether forwards of tokens at or above the floor are held after a store change until the
    /// quiet bound has passed and the other processes' forwards from before are settled: with
    /// the handover, unless switched off.
    pub fn holds_after_store_change(&self) -> bool {
        self.handover() && !self.is(Variant::NoHoldAfterStoreChange)
    }

    /// Whether a store going back is noticed (`guard.detect_store_changes`).
    fn detects(&self) -> bool {
        !self.is(Variant::NoStoreEpochCheck) && !self.is(Variant::NoStoreEpochCheckOnEtcd)
    }

    /// Whether a store may go back in this run.
    pub fn store_may_go_back(&self) -> bool {
        self.bounds.postgres_goes_back || self.etcd_may_go_back()
    }

    /// Whether etcd may be restored in this run.
    pub fn etcd_may_go_back(&self) -> bool {
        self.backend == Backend::Etcd && self.bounds.etcd_goes_back
    }

    /// The check every PostgreSQL session passes before it is used (`StoreEpoch::check_session`):
    /// on a server other than the acknowledged one, the token source is moved past everything
    /// issued before, the floor raised to it and the server acknowledged with `changed_at`, in
    /// one transaction.
    fn session(&self, s: &mut ProtocolState) {
        if !self.detects() || s.epoch.acknowledged == s.past.incarnation {
            return;
        }
        let known = [
            s.lock.sequence(),
            s.epoch.floor,
            s.fence.marks.iter().copied().max().unwrap_or(0),
            s.epoch.issued.iter().copied().max().unwrap_or(0),
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let floor = match self.backend {
            Backend::Postgres => {
                // More than the whole run can draw: no token issued before is at or above it.
                let gap = self.bounds.workers * self.bounds.acquires_per_worker + 1;
                let floor = epoch::postgres_floor(known, gap);
                s.lock.fast_forward(floor);
                s.lock.end_below(floor);
                floor
            }
            Backend::Etcd => epoch::etcd_floor(s.lock.revision(), known),
        };
        s.epoch.floor = s.epoch.floor.max(floor);
        s.epoch.acknowledged = s.past.incarnation;
        s.epoch.changed = Some(Change {
            floor: s.epoch.floor,
            running: s
                .fence
                .processes
                .iter()
                .map(|p| *p.instances.last().expect("a process has an instance"))
                .collect(),
        });
    }

    /// The etcd backend's `lock_issued` check of the grant just made for `key`: true if it may
    /// be handed out. If not, etcd went back: the grant is withdrawn, the floor raised above
    /// every recorded token and the revision moved up to it.
    ///
    /// The variants that replace ModRevision by another token source are checked bare, without
    /// it: `lock_issued` would withdraw their grants that do not increase (and never hand out
    /// another while the source stays below the record), which hides a wrong source behind lost
    /// grants instead of making it right.
    fn issued_check(&self, s: &mut ProtocolState, key: Key, token: Token) -> bool {
        let other_source = matches!(
            self.variant,
            Some(Variant::CreateRevisionToken | Variant::LeaseIdToken | Variant::WallClockToken)
        );
        if self.backend != Backend::Etcd || !self.detects() || other_source {
            return true;
        }
        let recorded = &mut s.epoch.issued[key as usize];
        if token > *recorded {
            *recorded = token;
            return true;
        }
        s.lock.withdraw_last();
        let above = s.epoch.issued.iter().copied().max().unwrap_or(0) + 1;
        s.epoch.floor = s.epoch.floor.max(above);
        s.lock.fast_forward(s.epoch.floor);
        s.seen.withdrawn = true;
        false
    }

    /// The store goes back to the copy.
    fn go_back(&self, s: &mut ProtocolState, which: WentBack) {
        let copy = s
            .past
            .copy
            .take()
            .expect("a store goes back only to a copy");
        s.past.went_back = Some((which, s.lock.grants.len() as GrantId));
        match which {
            WentBack::Postgres => {
                s.past.incarnation += 1;
                for (a, (now, then)) in s.fence.records.iter().zip(&copy.records).enumerate() {
                    for (p, (now, then)) in now.iter().zip(then).enumerate() {
                        if *now != Record::Absent && *then == Record::Absent {
                            s.past.lost_records.push((a as u8, p as u8));
                        }
                    }
                }
                s.fence.marks = copy.marks;
                s.fence.records = copy.records;
                s.fence.entries = copy.entries;
                s.epoch = copy.epoch;
                if self.backend == Backend::Postgres {
                    s.lock.go_back(&copy.lock);
                    // An acquire statement between its `nextval` and its row lock dies with
                    // its session on the old server.
                    for worker in &mut s.workers {
                        if matches!(worker.phase, Phase::Drawn { .. }) {
                            worker.phase = Phase::Idle;
                        }
                    }
                }
            }
            WentBack::Etcd => s.lock.go_back(&copy.lock),
        }
    }

    /// PostgreSQL with `nextval` drawn before the row lock (every PostgreSQL model but the
    /// per-row-version variant).
    fn draws(&self) -> bool {
        self.backend == Backend::Postgres && !self.is(Variant::PerRowVersionToken)
    }

    /// The token a worker presents when it writes: its grant's, or under the §A2.3 trap the
    /// key's token now.
    fn presented(&self, s: &ProtocolState, account: u8, own: Token) -> Token {
        if self.is(Variant::RereadTokenAtWrite) {
            s.lock.current_token(account).unwrap_or(own)
        } else {
            own
        }
    }

    /// The proxy refused a request of `grant`: note the fencing, and T-042 if a newer grant
    /// of the account has already reached the rail.
    fn fenced_at_proxy(s: &mut ProtocolState, account: u8, grant: GrantId) {
        s.seen.fenced_at_proxy = true;
        if s.rail
            .arrivals
            .iter()
            .any(|a| a.account == account && a.grant > grant)
        {
            s.seen.t042 = true;
        }
    }

    fn paydb_write(
        &self,
        s: &mut ProtocolState,
        worker: u8,
        grant: GrantId,
        token: Token,
        payment: u8,
        to: PaymentState,
    ) -> bool {
        let account = s.workers[worker as usize].account;
        let presented = self.presented(s, account, token);
        match s
            .paydb
            .fenced_update(account, presented, grant, payment, to)
        {
            FencedWrite::FencedOut => {
                s.seen.fenced_at_paydb = true;
                s.workers[worker as usize].phase = Phase::Idle;
                false
            }
            FencedWrite::Updated {
                stale,
                token_shared,
            } => {
                s.seen.stale_paydb_write |= stale;
                s.seen.paydb_token_shared |= token_shared;
                true
            }
        }
    }

    fn worker_actions(&self, s: &ProtocolState, w: u8, actions: &mut Vec<Action>) {
        let worker = &s.workers[w as usize];
        if let Some((grant, _)) = worker.phase.grant()
            && !s.lock.is_live(grant)
            && !matches!(worker.phase, Phase::Completed { .. })
            && worker.acquires_left > 0
        {
            // A worker that can acquire no more and stops is the same, for every property,
            // as one that pauses for ever: only one that may acquire again needs this step.
            actions.push(Action::NoticeLost(w));
        }
        match worker.phase {
            Phase::Idle if worker.acquires_left > 0 => {
                let room = s.lock.grants.len() < self.bounds.max_grants as usize;
                if self.draws() {
                    actions.push(Action::Draw(w));
                } else if room && !s.lock.is_held(worker.account) {
                    actions.push(Action::Acquire(w));
                }
            }
            Phase::Idle => {}
            Phase::Drawn { .. } => {
                if s.lock.grants.len() < self.bounds.max_grants as usize {
                    actions.push(Action::Lock(w));
                }
            }
            Phase::Holding { .. } => {
                let claimable = s.paydb.claimable(worker.account);
                if claimable.is_empty() {
                    actions.push(Action::Release(w));
                }
                for payment in claimable {
                    actions.push(Action::Claim { worker: w, payment });
                }
            }
            Phase::Claimed { .. } => {
                for proxy in 0..self.bounds.proxies {
                    actions.push(Action::Submit { worker: w, proxy });
                }
            }
            Phase::Awaiting { .. } if s.retries_left > 0 => {
                for proxy in 0..self.bounds.proxies {
                    actions.push(Action::Retry { worker: w, proxy });
                }
            }
            Phase::Awaiting { .. } => {}
            Phase::Paid { .. } => actions.push(Action::Complete(w)),
            Phase::Completed { .. } => actions.push(Action::Release(w)),
        }
    }

    fn submit(&self, s: &mut ProtocolState, w: u8, proxy: u8) {
        let worker = &s.workers[w as usize];
        let (Phase::Claimed {
            grant,
            token,
            payment,
        }
        | Phase::Awaiting {
            grant,
            token,
            payment,
        }) = worker.phase
        else {
            unreachable!("only a claimed payment is submitted")
        };
        let account = worker.account;
        let presented = self.presented(s, account, token);
        let first = if self.is(Variant::NoFirstToken) {
            0
        } else {
            s.paydb.accounts[account as usize].first[payment as usize]
        };
        s.network.send(Msg::Submit {
            worker: w,
            proxy,
            account,
            token: presented,
            grant,
            payment,
            first,
        });
        s.workers[w as usize].phase = Phase::Awaiting {
            grant,
            token,
            payment,
        };
    }

    /// `idempotency::lost_first_attempt`, after the floor and the cache let the submit through:
    /// its first token is below the floor and its key has no record — made before the store
    /// went back, the record may have gone with it.
    fn first_attempt_lost(
        &self,
        s: &ProtocolState,
        proxy: u8,
        account: u8,
        token: Token,
        payment: u8,
        first: Token,
    ) -> bool {
        let floor = s.epoch.floor;
        self.rules().idempotency
            && first != 0
            && first < floor
            && token >= floor
            && token >= s.fence.processes[proxy as usize].cache[account as usize]
            && s.fence.records[account as usize][payment as usize] == Record::Absent
    }

    /// The rail's lookup for a submit whose first attempt's record may have gone back
    /// (`FencePoint::lost_attempt_not_on_the_rail`): asked only once nothing sent before the
    /// change can still reach the rail — no request of the account below the floor is held by
    /// a process (waiting to be sent, or sent and waiting for its answer: the processes' rows,
    /// and the running one's own forwards) and none is in the network (the quiet bound) —
    /// unless the variant asks at once. True if the rail has no such payment: the submit goes on
    /// as the key's first request.
    fn lost_attempt_not_on_the_rail(
        &self,
        s: &mut ProtocolState,
        account: u8,
        payment: u8,
    ) -> bool {
        let floor = s.epoch.floor;
        let held = s
            .fence
            .tasks
            .iter()
            .any(|t| t.account == account && t.token < floor);
        let on_its_way = s.network.in_flight.iter().any(|m| {
            matches!(m, Msg::Forward { account: a, token, .. } if *a == account && *token < floor)
        });
        let after_the_hold = !held && !on_its_way;
        if !(after_the_hold || self.is(Variant::LostLookupBeforeHold)) {
            return false;
        }
        let not_on_the_rail = !s.rail.has(account, payment);
        s.seen.lost_attempt_not_on_the_rail |= not_on_the_rail;
        not_on_the_rail
    }

    fn deliver(&self, s: &mut ProtocolState, msg: Msg) {
        let rules = self.rules();
        match msg {
            Msg::Submit {
                worker,
                proxy,
                account,
                token,
                grant,
                payment,
                first,
            } => {
                self.session(s);
                let floor = s.epoch.floor;
                if self.first_attempt_lost(s, proxy, account, token, payment, first)
                    && !self.lost_attempt_not_on_the_rail(s, account, payment)
                {
                    s.network.send(Msg::Reply {
                        worker,
                        grant,
                        payment,
                        reply: Reply::InDoubt,
                    });
                    return;
                }
                let reply = match s
                    .fence
                    .check(rules, floor, proxy, account, token, grant, payment, worker)
                {
                    Checked::Accepted => None,
                    Checked::BelowFloor => {
                        s.seen.fenced_by_floor = true;
                        Self::fenced_at_proxy(s, account, grant);
                        Some(Reply::FencedOut)
                    }
                    Checked::FencedOut => {
                        Self::fenced_at_proxy(s, account, grant);
                        Some(Reply::FencedOut)
                    }
                    Checked::Answered(reply) => Some(reply),
                };
                if let Some(reply) = reply {
                    s.network.send(Msg::Reply {
                        worker,
                        grant,
                        payment,
                        reply,
                    });
                }
            }
            Msg::Forward {
                proxy,
                account,
                token,
                grant,
                payment,
                seq,
            } => {
                s.rail.arrivals.push(Arrival {
                    account,
                    payment,
                    token,
                    grant,
                });
                s.network.send(Msg::RailAnswer {
                    proxy,
                    account,
                    token,
                    grant,
                    payment,
                    seq,
                });
            }
            Msg::RailAnswer {
                proxy,
                account,
                token,
                grant,
                payment,
                seq,
            } => {
                self.session(s);
                let task = Task {
                    proxy,
                    account,
                    token,
                    grant,
                    payment,
                    worker: s.lock.grants[grant as usize].worker,
                    stage: Stage::Forwarded,
                    seq,
                    awaits: Vec::new(),
                };
                if let Some(task) = s.fence.answered(rules, &task) {
                    s.network.send(Msg::Reply {
                        worker: task.worker,
                        grant,
                        payment,
                        reply: Reply::Paid,
                    });
                }
            }
            Msg::Reply {
                worker,
                grant,
                payment,
                reply,
            } => {
                let w = &mut s.workers[worker as usize];
                if let Phase::Awaiting {
                    grant: g,
                    token,
                    payment: p,
                } = w.phase
                    && (g, p) == (grant, payment)
                {
                    w.phase = match reply {
                        Reply::Paid => Phase::Paid {
                            grant,
                            token,
                            payment,
                        },
                        Reply::FencedOut
                        | Reply::InFlight
                        | Reply::InDoubt
                        | Reply::UpstreamTimeout => Phase::Idle,
                    };
                }
            }
        }
    }
}

impl ProtocolState {
    /// Renames workers so that they are in sorted order of their own state (workers of one
    /// account are interchangeable; grants, messages and requests name workers by number and
    /// are renamed with them). Two states that differ only by such a renaming become one.
    fn rename_workers_canonically(&mut self) {
        let mut order: Vec<u8> = (0..self.workers.len() as u8).collect();
        order.sort_by(|a, b| self.workers[*a as usize].cmp(&self.workers[*b as usize]));
        if order.iter().enumerate().all(|(i, w)| i as u8 == *w) {
            return;
        }
        let mut renamed = vec![0u8; order.len()];
        for (new, old) in order.iter().enumerate() {
            renamed[*old as usize] = new as u8;
        }
        self.workers = order
            .iter()
            .map(|old| self.workers[*old as usize].clone())
            .collect();
        for grant in &mut self.lock.grants {
            grant.worker = renamed[grant.worker as usize];
        }
        for task in &mut self.fence.tasks {
            task.worker = renamed[task.worker as usize];
        }
        self.fence.tasks.sort();
        for msg in &mut self.network.in_flight {
            if let Msg::Submit { worker, .. } | Msg::Reply { worker, .. } = msg {
                *worker = renamed[*worker as usize];
            }
        }
        self.network.in_flight.sort();
    }
}

impl Model for FencingModel {
    type State = ProtocolState;
    type Action = Action;

    fn init_states(&self) -> Vec<ProtocolState> {
        let b = self.bounds;
        vec![ProtocolState {
            lock: LockService::new(self.backend, b.accounts),
            workers: (0..b.workers)
                .map(|w| Worker {
                    account: w % b.accounts,
                    phase: Phase::Idle,
                    acquires_left: b.acquires_per_worker,
                })
                .collect(),
            paydb: PayDb::new(b.accounts, b.payments_per_account),
            fence: Fence::new(b.proxies, b.accounts, b.payments_per_account),
            network: Network::default(),
            rail: Rail::default(),
            seen: Observations::default(),
            retries_left: b.retries,
            restarts_left: b.restarts,
            epoch: Epoch::new(b.accounts),
            past: Past::default(),
        }]
    }

    fn actions(&self, s: &ProtocolState, actions: &mut Vec<Action>) {
        for w in 0..self.bounds.workers {
            self.worker_actions(s, w, actions);
        }
        for (g, grant) in s.lock.grants.iter().enumerate() {
            if grant.status == crate::lock::GrantStatus::Live {
                actions.push(Action::Expire(g as GrantId));
            }
        }
        for key in s.lock.reapable() {
            actions.push(Action::Reap(key));
        }
        if self.is(Variant::WallClockToken) && s.lock.clock_may_step_back() {
            actions.push(Action::ClockStepsBack);
        }
        let rules = self.rules();
        for task in &s.fence.tasks {
            if s.fence.can_start(rules, &s.network, &s.epoch, task) {
                actions.push(Action::Start(task.clone()));
            }
            if task.stage == Stage::Forwarded && self.is(Variant::TurnReleasedOnUpstreamTimeout) {
                actions.push(Action::GiveUp(task.clone()));
            }
        }
        for msg in s.network.deliverable() {
            actions.push(Action::Deliver(msg.clone()));
            if self.bounds.lossy {
                actions.push(Action::Drop(msg.clone()));
            }
        }
        if rules.idempotency {
            let after_transit = !self.is(Variant::LookupBeforeTransit);
            for account in 0..self.bounds.accounts {
                for payment in 0..self.bounds.payments_per_account {
                    if s.fence.lookup_may_resolve(
                        account,
                        payment,
                        &s.network,
                        &s.rail,
                        after_transit,
                    ) {
                        actions.push(Action::Resolve { account, payment });
                    }
                }
            }
        }
        if s.restarts_left > 0 {
            for p in 0..self.bounds.proxies {
                actions.push(Action::Restart(p));
            }
        }
        if self.store_may_go_back() && s.past.went_back.is_none() {
            if s.past.copy.is_none() {
                actions.push(Action::CopyStores);
            } else {
                if self.bounds.postgres_goes_back {
                    actions.push(Action::PostgresGoesBack);
                }
                if self.etcd_may_go_back() {
                    actions.push(Action::EtcdRestored);
                }
            }
        }
    }

    fn next_state(&self, last: &ProtocolState, action: Action) -> Option<ProtocolState> {
        let mut s = last.clone();
        match action {
            Action::Draw(w) => {
                self.session(&mut s);
                let token = s.lock.draw();
                let worker = &mut s.workers[w as usize];
                worker.acquires_left -= 1;
                worker.phase = Phase::Drawn { token };
            }
            Action::Lock(w) => {
                let worker = &s.workers[w as usize];
                let Phase::Drawn { token } = worker.phase else {
                    unreachable!("only a drawn token locks")
                };
                let account = worker.account;
                self.session(&mut s);
                let granted = s.lock.pg_lock(account, w, token, self.variant);
                s.workers[w as usize].phase = match granted {
                    Some(grant) => Phase::Holding { grant, token },
                    None => Phase::Idle,
                };
            }
            Action::Acquire(w) => {
                let account = s.workers[w as usize].account;
                // The acquire reads the marks before its txn (the token-source guard), and
                // the etcd backend writes `lock_issued` after it: a PostgreSQL session either
                // way.
                self.session(&mut s);
                let granted = if self.backend == Backend::Etcd {
                    s.lock.etcd_acquire(account, w, self.variant)
                } else {
                    s.lock.pg_lock_per_row_version(account, w)
                };
                let grant = granted.expect("acquire is offered only for a free key");
                let token = s.lock.grants[grant as usize].token;
                // A withdrawn grant never reached its worker: it may try again.
                if self.issued_check(&mut s, account, token) {
                    let worker = &mut s.workers[w as usize];
                    worker.acquires_left -= 1;
                    worker.phase = Phase::Holding { grant, token };
                }
            }
            Action::Expire(g) => s.lock.expire(g),
            Action::Reap(k) => s.lock.reap(k),
            Action::ClockStepsBack => s.lock.step_clock_back(),
            Action::NoticeLost(w) => s.workers[w as usize].phase = Phase::Idle,
            Action::Claim { worker: w, payment } => {
                let Phase::Holding { grant, token } = s.workers[w as usize].phase else {
                    unreachable!("only a holder claims")
                };
                if self.paydb_write(&mut s, w, grant, token, payment, PaymentState::Submitting) {
                    // Only a floor makes it count: kept where a store may go back.
                    let first = &mut s.paydb.accounts[s.workers[w as usize].account as usize].first
                        [payment as usize];
                    if *first == 0 && self.store_may_go_back() {
                        *first = token;
                    }
                    s.workers[w as usize].phase = Phase::Claimed {
                        grant,
                        token,
                        payment,
                    };
                }
            }
            Action::Submit { worker, proxy } => self.submit(&mut s, worker, proxy),
            Action::Retry { worker, proxy } => {
                s.retries_left -= 1;
                self.submit(&mut s, worker, proxy);
            }
            Action::Complete(w) => {
                let Phase::Paid {
                    grant,
                    token,
                    payment,
                } = s.workers[w as usize].phase
                else {
                    unreachable!("only a paid payment completes")
                };
                if self.paydb_write(&mut s, w, grant, token, payment, PaymentState::Done) {
                    s.workers[w as usize].phase = Phase::Completed { grant, token };
                }
            }
            Action::Release(w) => {
                let (grant, _) = s.workers[w as usize]
                    .phase
                    .grant()
                    .expect("only a holder releases");
                if self.backend == Backend::Postgres {
                    self.session(&mut s);
                }
                s.lock.release(grant, self.variant);
                s.workers[w as usize].phase = Phase::Idle;
            }
            Action::Deliver(msg) => {
                if !s.network.take(&msg) {
                    return None;
                }
                let forward = matches!(msg, Msg::Forward { .. });
                self.deliver(&mut s, msg);
                if forward && self.handover() {
                    let rules = self.rules();
                    s.seen.handed_over |= s.fence.tasks.iter().any(|t| {
                        t.stage == Stage::HandingOver
                            && !last.fence.handed_over(rules, &last.network, t)
                            && s.fence.handed_over(rules, &s.network, t)
                    });
                    let changed = s.epoch.changed.as_ref();
                    s.seen.held_after_change |= s.fence.tasks.iter().any(|t| {
                        t.stage == Stage::HandingOver
                            && last.fence.held(rules, &last.network, changed, t)
                            && !s.fence.held(rules, &s.network, changed, t)
                    });
                }
            }
            Action::Drop(msg) => {
                if !s.network.take(&msg) {
                    return None;
                }
            }
            Action::Start(task) => {
                // The last look reads the mark on a checked session.
                self.session(&mut s);
                match s.fence.start(self.rules(), &s.network, &s.epoch, &task) {
                    refused @ (Started::FencedOut | Started::BelowFloor) => {
                        s.seen.fenced_by_floor |= refused == Started::BelowFloor;
                        Self::fenced_at_proxy(&mut s, task.account, task.grant);
                        s.network.send(Msg::Reply {
                            worker: task.worker,
                            grant: task.grant,
                            payment: task.payment,
                            reply: Reply::FencedOut,
                        });
                    }
                    Started::Waiting | Started::HandingOver => {}
                    Started::Forwarded => {
                        s.network.send(Msg::Forward {
                            proxy: task.proxy,
                            account: task.account,
                            token: task.token,
                            grant: task.grant,
                            payment: task.payment,
                            seq: task.seq,
                        });
                    }
                }
            }
            Action::CopyStores => {
                s.past.copy = Some(StoreCopy {
                    lock: s.lock.store.clone(),
                    marks: s.fence.marks.clone(),
                    records: s.fence.records.clone(),
                    entries: s.fence.entries.clone(),
                    epoch: s.epoch.clone(),
                });
            }
            Action::PostgresGoesBack => self.go_back(&mut s, WentBack::Postgres),
            Action::EtcdRestored => self.go_back(&mut s, WentBack::Etcd),
            Action::Restart(p) => {
                s.restarts_left -= 1;
                s.fence.restart(p);
            }
            Action::Resolve { account, payment } => {
                s.fence.resolve(account, payment, &s.rail);
            }
            Action::GiveUp(task) => {
                s.fence.give_up(self.rules(), &task);
                s.network.send(Msg::Reply {
                    worker: task.worker,
                    grant: task.grant,
                    payment: task.payment,
                    reply: Reply::UpstreamTimeout,
                });
            }
        }
        if self.symmetry {
            s.rename_workers_canonically();
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all(self)
    }
}
