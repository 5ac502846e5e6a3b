//! The rail proxy's fencing point (`src/proxy/fence/`): one or more proxy processes sharing
//! one PostgreSQL database.
//!
//! In the database: `rail_high_water` (one mark per account) and the idempotency records
//! (C3 §3.1), written in the same commit as the compare-and-set. In each process: the mark
//! cache (lower bounds of the marks, used only to refuse) and the per-account forwarding order
//! (`ordering.rs`): a slot per account with the tickets alive, the highest token admitted or
//! asking, the token whose forwards are in flight and how many there are; the slot is
//! forgotten when its last ticket is dropped.
//!
//! One request goes through the steps of `fence::enforce`:
//! 1. **check** (on arrival): refused at once if below the fencing floor (`src/store/epoch.rs`:
//!    the store went back, see [`crate::epoch`]) or the cached mark; otherwise it takes its
//!    ticket and runs the compare-and-set `token >= mark ⇒ mark := token`, creating its
//!    idempotency record in the same commit;
//! 2. **start** (later, as its own step): `Ticket::admit` — raise the slot's highest; refused
//!    if below it; admitted if no forward of another token is in flight, else it waits — then
//!    the last look at the mark in the database (refused below the mark, or below the floor
//!    after a store change), then the forward is sent, holding the ticket;
//! 3. **answered**: the rail's answer drops the ticket (passing the turn on) and completes the
//!    record (an UPDATE: a record the store lost by going back stays lost). A refusal after the
//!    compare-and-set forgets the record: nothing was sent.
//!
//! With more than one process, the **handover** (`store/handover.rs`) orders an account's
//! forwards across processes (and across the instances of one process that restarts: each
//! instance is another process to the handover):
//! - each process numbers its forwards (its sequence, from 1); the compare-and-set records the
//!   request's entry (process, seq) in the account's row, replacing the process's previous
//!   entry there and keeping the other processes', and returns those others;
//! - an entry (X, s) of an account is *settled* once no forward of X for the account with a seq
//!   up to s can still reach the rail: none is waiting to be sent, none is in the network. The
//!   real processes publish their horizon and pending forwards to tell; here the waiter
//!   observes X's state directly, which is what a publication shows, only sooner (settled is
//!   permanent, so looking later changes nothing). A forward whose answer was lost, or whose
//!   process died, stays unsettled until the network delivered or dropped it: what
//!   `proxy.rail_transit_ms` stands for;
//! - in its start step, after its turn in its own process, a request waits (holding the turn,
//!   its own entry pending) until every entry its compare-and-set returned is settled, removes
//!   those of instances no longer running from the row (a running instance's entry stays, for
//!   its next compare-and-set for the account to replace), and only then takes its last look
//!   and forwards;
//! - after a store change, which takes the entries back with the mark rows, a request of a token
//!   at or above the floor also waits there for the hold after a store change
//!   ([`crate::epoch`]): the quiet bound, and the other processes' forwards of the account below
//!   the floor.
//!
//! With one process that never restarts the row only ever holds the process's own entry, which
//! nobody waits for: the model keeps no entries then (every seq is 0), and its states are those
//! of the proxy without the handover.

use crate::epoch::{Change, Epoch};
use crate::lock::{GrantId, Token};
use crate::network::{Msg, Network, Rail, Reply};

/// An idempotency record of one (account, payment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Record {
    Absent,
    InFlight,
    Completed,
}

/// A forward's number in its process's sequence (1, 2, …); 0 where no handover is kept.
pub type Seq = u8;

/// A handover entry in an account's row: forward `seq` of process `proxy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub proxy: u8,
    pub seq: Seq,
}

/// One account's slot in one process's forwarding order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Slot {
    pub tickets: u8,
    pub highest: Token,
    pub epoch: Token,
    pub in_flight: u8,
}

/// What one proxy process keeps in memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProxyProcess {
    pub slots: Vec<Slot>,
    pub cache: Vec<Token>,
    /// The last seq handed out (the handover's sequence).
    pub last_seq: Seq,
    /// The first seq of each instance the process has been, oldest first. The model numbers
    /// one sequence across the process's restarts; each instance is its own process to the
    /// handover (the real instance id is new at every start).
    pub instances: Vec<Seq>,
}

impl ProxyProcess {
    /// The first seq of the instance that handed out `seq`.
    fn instance_of(&self, seq: Seq) -> Seq {
        self.instances
            .iter()
            .copied()
            .filter(|first| *first <= seq)
            .max()
            .unwrap_or(0)
    }

    /// Whether `entry` (of this process) is the running instance's.
    fn owns(&self, entry: Entry) -> bool {
        entry.seq >= *self.instances.last().expect("a process has an instance")
    }
}

/// Where an accepted request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Its compare-and-set committed; it has not asked for its turn yet.
    Accepted,
    /// It asked for its turn; a forward of a lower token is still in flight.
    Waiting,
    /// It has its turn; an entry of another process its compare-and-set returned is not
    /// settled yet, or the hold after a store change holds it back.
    HandingOver,
    /// Its forward was sent; it holds its turn until the rail answers.
    Forwarded,
}

/// A request inside a proxy, past its compare-and-set.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Task {
    pub proxy: u8,
    pub account: u8,
    pub token: Token,
    pub grant: GrantId,
    pub payment: u8,
    pub worker: u8,
    pub stage: Stage,
    /// Its handover entry's seq (0: none).
    pub seq: Seq,
    /// The other processes' entries its compare-and-set returned, to wait for (emptied once it
    /// forwards).
    pub awaits: Vec<Entry>,
}

/// Which of the proxy's rules are in force (the variants switch them off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceRules {
    /// The per-account forwarding order.
    pub ordering: bool,
    /// The turn is held until the rail answers (else: passed on when the forward is sent).
    pub turn_until_answer: bool,
    /// Submits carry `Idempotency-Key`.
    pub idempotency: bool,
    /// The handover across processes (`fencing.order_across_processes`); only kept with more
    /// than one process instance.
    pub handover: bool,
    /// The compare-and-set keeps the other processes' entries in the row (else: its entry
    /// replaces the row's).
    pub keep_other_entries: bool,
    /// An entry settles once its forward can no longer reach the rail (else: once it is sent).
    pub settle_after_transit: bool,
    /// After a store change, a forward of a token at or above its floor waits for the quiet
    /// bound and for the other processes' forwards of lower tokens ([`crate::epoch`]); kept
    /// with the handover.
    pub hold_after_store_change: bool,
}

/// What the check step decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// 409: below the fencing floor: its grant was made before the store went back.
    BelowFloor,
    /// 409: below the cached mark, or the compare-and-set refused it.
    FencedOut,
    /// Not forwarded, answered from the idempotency record.
    Answered(Reply),
    Accepted,
}

/// What the start step decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// A higher token was admitted meanwhile, or the last look found a higher mark: 409.
    FencedOut,
    /// 409: the last look found the token below the floor: the store changed since its
    /// compare-and-set.
    BelowFloor,
    Waiting,
    /// It has its turn and waits for another process's entry to settle, or is held after a
    /// store change.
    HandingOver,
    Forwarded,
}

/// The proxies and their shared database.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence {
    pub marks: Vec<Token>,
    pub records: Vec<Vec<Record>>,
    /// Per account, the handover entries in its row (sorted).
    pub entries: Vec<Vec<Entry>>,
    pub processes: Vec<ProxyProcess>,
    /// Requests past their compare-and-set, sorted.
    pub tasks: Vec<Task>,
}

impl Fence {
    pub fn new(proxies: u8, accounts: u8, payments: u8) -> Self {
        Self {
            marks: vec![0; accounts as usize],
            records: vec![vec![Record::Absent; payments as usize]; accounts as usize],
            entries: vec![Vec::new(); accounts as usize],
            processes: (0..proxies)
                .map(|_| ProxyProcess {
                    slots: vec![Slot::default(); accounts as usize],
                    cache: vec![0; accounts as usize],
                    last_seq: 0,
                    instances: vec![1],
                })
                .collect(),
            tasks: Vec::new(),
        }
    }

    fn raise_cache(&mut self, proxy: u8, account: u8, lower_bound: Token) {
        let cached = &mut self.processes[proxy as usize].cache[account as usize];
        *cached = (*cached).max(lower_bound);
    }

    fn slot(&mut self, proxy: u8, account: u8) -> &mut Slot {
        &mut self.processes[proxy as usize].slots[account as usize]
    }

    /// `Drop for Ticket`: the last ticket of an account forgets its slot.
    fn drop_ticket(&mut self, proxy: u8, account: u8, admitted: bool) {
        let slot = self.slot(proxy, account);
        slot.tickets -= 1;
        if admitted {
            slot.in_flight -= 1;
        }
        if slot.tickets == 0 {
            *slot = Slot::default();
        }
    }

    fn add_task(&mut self, task: Task) {
        let at = self.tasks.partition_point(|t| *t < task);
        self.tasks.insert(at, task);
    }

    fn take_task(&mut self, task: &Task) -> Option<Task> {
        let at = self.tasks.iter().position(|t| t == task)?;
        Some(self.tasks.remove(at))
    }

    /// Step 1: the floor, the cache, the ticket, the compare-and-set with its handover entry,
    /// and the idempotency record.
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &mut self,
        rules: FenceRules,
        floor: Token,
        proxy: u8,
        account: u8,
        token: Token,
        grant: GrantId,
        payment: u8,
        worker: u8,
    ) -> Checked {
        if token < floor {
            return Checked::BelowFloor;
        }
        if token < self.processes[proxy as usize].cache[account as usize] {
            return Checked::FencedOut;
        }
        if rules.ordering {
            self.slot(proxy, account).tickets += 1;
        }
        if token < self.marks[account as usize] {
            self.raise_cache(proxy, account, token + 1);
            if rules.ordering {
                self.drop_ticket(proxy, account, false);
            }
            return Checked::FencedOut;
        }
        self.marks[account as usize] = token;
        self.raise_cache(proxy, account, token);
        let (seq, awaits) = if rules.handover {
            self.record_entry(rules, proxy, account)
        } else {
            (0, Vec::new())
        };
        if rules.idempotency {
            let record = &mut self.records[account as usize][payment as usize];
            let answer = match *record {
                Record::Absent => None,
                Record::InFlight => Some(Reply::InFlight),
                Record::Completed => Some(Reply::Paid),
            };
            if let Some(answer) = answer {
                if rules.ordering {
                    self.drop_ticket(proxy, account, false);
                }
                return Checked::Answered(answer);
            }
            *record = Record::InFlight;
        }
        self.add_task(Task {
            proxy,
            account,
            token,
            grant,
            payment,
            worker,
            stage: Stage::Accepted,
            seq,
            awaits,
        });
        Checked::Accepted
    }

    /// The handover's part of the compare-and-set: the next seq of `proxy`'s sequence becomes
    /// its entry in `account`'s row, replacing its previous entry there (and, unless
    /// `keep_other_entries` is off, only that one). Returns the seq and the other processes'
    /// entries the row held.
    ///
    /// The real process registers the seq as pending *before* the statement; here the two are
    /// one step, as nobody waits for an entry before it is in a row. A refused compare-and-set
    /// takes no seq: its registration ends unsent, which only renumbers the rest.
    fn record_entry(&mut self, rules: FenceRules, proxy: u8, account: u8) -> (Seq, Vec<Entry>) {
        let process = &mut self.processes[proxy as usize];
        process.last_seq += 1;
        let seq = process.last_seq;
        let process = &self.processes[proxy as usize];
        let own = |e: &Entry| e.proxy == proxy && process.owns(*e);
        let row = &mut self.entries[account as usize];
        let others: Vec<Entry> = row.iter().filter(|e| !own(e)).copied().collect();
        if rules.keep_other_entries {
            row.retain(|e| !own(e));
        } else {
            row.clear();
        }
        row.push(Entry { proxy, seq });
        row.sort();
        (seq, others)
    }

    /// Whether `entry` of `account`'s row is settled: no forward of its process instance for
    /// the account with a seq up to the entry's can still reach the rail — none waits to be
    /// sent (a request past its compare-and-set, not forwarded yet) and, unless entries settle
    /// on send, none is in the network.
    pub fn settled(&self, rules: FenceRules, network: &Network, account: u8, entry: Entry) -> bool {
        let first = self.processes[entry.proxy as usize].instance_of(entry.seq);
        let mine = |proxy: u8, a: u8, seq: Seq| {
            proxy == entry.proxy && a == account && (first..=entry.seq).contains(&seq)
        };
        let unsent = self
            .tasks
            .iter()
            .any(|t| mine(t.proxy, t.account, t.seq) && t.stage != Stage::Forwarded);
        let on_its_way = rules.settle_after_transit
            && network.in_flight.iter().any(|m| {
                matches!(*m, Msg::Forward { proxy, account: a, seq, .. } if mine(proxy, a, seq))
            });
        !unsent && !on_its_way
    }

    /// Whether every entry `task` awaits is settled.
    pub fn handed_over(&self, rules: FenceRules, network: &Network, task: &Task) -> bool {
        task.awaits
            .iter()
            .all(|e| self.settled(rules, network, task.account, *e))
    }

    /// Whether the hold after the store change `changed` holds `task` back: its token is at or
    /// above the change's floor, and a forward of a token below it may still reach the rail
    /// that is either of a process instance that had stopped by the change (the quiet bound
    /// has not passed), or of another running instance, for the same account (listed pending
    /// in that instance's row). The task's own instance's forwards are behind its turn.
    pub fn held(
        &self,
        rules: FenceRules,
        network: &Network,
        changed: Option<&Change>,
        task: &Task,
    ) -> bool {
        let Some(change) = changed else {
            return false;
        };
        if !(rules.handover && rules.hold_after_store_change) || task.token < change.floor {
            return false;
        }
        let own = &self.processes[task.proxy as usize];
        let mine = |proxy: u8, seq: Seq| proxy == task.proxy && own.owns(Entry { proxy, seq });
        let stopped = |proxy: u8, seq: Seq| seq < change.running[proxy as usize];
        let unsent = self.tasks.iter().any(|t| {
            t.account == task.account
                && t.token < change.floor
                && t.stage != Stage::Forwarded
                && !mine(t.proxy, t.seq)
        });
        let on_its_way = rules.settle_after_transit
            && network.in_flight.iter().any(|m| {
                matches!(*m, Msg::Forward { proxy, account, token, seq, .. }
                    if token < change.floor
                        && !mine(proxy, seq)
                        && (account == task.account || stopped(proxy, seq)))
            });
        unsent || on_its_way
    }

    /// Whether `task`, having its turn, may go on to its last look: every entry it awaits is
    /// settled and the hold after a store change does not hold it back.
    fn may_go_on(&self, rules: FenceRules, network: &Network, epoch: &Epoch, task: &Task) -> bool {
        self.handed_over(rules, network, task)
            && !self.held(rules, network, epoch.changed.as_ref(), task)
    }

    /// Whether `task` can take its start step now (a waiting one only when it would be
    /// admitted or refused; a handing-over one only when every entry it awaits is settled).
    pub fn can_start(
        &self,
        rules: FenceRules,
        network: &Network,
        epoch: &Epoch,
        task: &Task,
    ) -> bool {
        match task.stage {
            Stage::Accepted => true,
            Stage::Forwarded => false,
            Stage::HandingOver => self.may_go_on(rules, network, epoch, task),
            Stage::Waiting => {
                let slot = &self.processes[task.proxy as usize].slots[task.account as usize];
                !rules.ordering
                    || task.token < slot.highest
                    || task.token == slot.epoch
                    || slot.in_flight == 0
            }
        }
    }

    /// Step 2: `Ticket::admit`, the wait for the entries of other processes and the hold after a
    /// store change, the last look at the floor and the mark, and the forward.
    pub fn start(
        &mut self,
        rules: FenceRules,
        network: &Network,
        epoch: &Epoch,
        task: &Task,
    ) -> Started {
        let mut task = self.take_task(task).expect("a task to start exists");
        let (proxy, account, token) = (task.proxy, task.account, task.token);
        let admitted = task.stage == Stage::HandingOver;
        if rules.ordering && !admitted {
            let slot = self.slot(proxy, account);
            slot.highest = slot.highest.max(token);
            if token < slot.highest {
                self.refuse(rules, &task, false, token + 1);
                return Started::FencedOut;
            }
            if token == slot.epoch || slot.in_flight == 0 {
                slot.epoch = token;
                slot.in_flight += 1;
            } else {
                task.stage = Stage::Waiting;
                self.add_task(task);
                return Started::Waiting;
            }
        }
        if rules.handover {
            if !self.may_go_on(rules, network, epoch, &task) {
                task.stage = Stage::HandingOver;
                self.add_task(task);
                return Started::HandingOver;
            }
            // Pruning: the entries waited for are settled for good. Those of a running
            // instance stay, for its next compare-and-set for the account to replace.
            let processes = &self.processes;
            let row = &mut self.entries[account as usize];
            row.retain(|e| !task.awaits.contains(e) || processes[e.proxy as usize].owns(*e));
            task.awaits.clear();
        }
        if token < epoch.floor {
            self.refuse(rules, &task, true, 0);
            return Started::BelowFloor;
        }
        let mark = self.marks[account as usize];
        if mark > token {
            self.refuse(rules, &task, true, mark);
            return Started::FencedOut;
        }
        if rules.ordering && !rules.turn_until_answer {
            self.drop_ticket(proxy, account, true);
        }
        task.stage = Stage::Forwarded;
        self.add_task(task);
        Started::Forwarded
    }

    /// A refusal after the compare-and-set: nothing was sent, the record is forgotten.
    fn refuse(&mut self, rules: FenceRules, task: &Task, admitted: bool, cache_to: Token) {
        self.raise_cache(task.proxy, task.account, cache_to);
        if rules.ordering {
            self.drop_ticket(task.proxy, task.account, admitted);
        }
        if rules.idempotency {
            self.records[task.account as usize][task.payment as usize] = Record::Absent;
        }
    }

    /// Step 3: the rail's answer to `task`'s forward. `None` when nobody waits for it any more.
    pub fn answered(&mut self, rules: FenceRules, task: &Task) -> Option<Task> {
        let task = self.take_task(task)?;
        if rules.ordering && rules.turn_until_answer {
            self.drop_ticket(task.proxy, task.account, true);
        }
        let record = &mut self.records[task.account as usize][task.payment as usize];
        if rules.idempotency && *record != Record::Absent {
            *record = Record::Completed;
        }
        Some(task)
    }

    /// The process dies and starts again as a new instance: its requests, forwarding order and
    /// cache are lost. What it had not sent is never sent (its records stay in flight: in
    /// doubt); what it sent may still reach the rail, and its answer finds nobody.
    pub fn restart(&mut self, proxy: u8) {
        self.tasks.retain(|t| t.proxy != proxy);
        let accounts = self.marks.len();
        let process = &mut self.processes[proxy as usize];
        process.slots = vec![Slot::default(); accounts];
        process.cache = vec![0; accounts];
        process.instances.push(process.last_seq + 1);
    }

    /// Whether the rail's lookup by idempotency key (`idempotency::resolve`) may resolve the
    /// record of `payment` of `account`, in flight (in doubt, once nobody waits for it): the
    /// rail has the payment — always; or it has not, and no live process holds a request of it
    /// (its owner can no longer send it: stopped, which the real owner's clean stop or the
    /// operator's word says) and, `after_transit`, no forward of it is still in the network
    /// (`proxy.rail_transit_ms` has passed).
    pub fn lookup_may_resolve(
        &self,
        account: u8,
        payment: u8,
        network: &Network,
        rail: &Rail,
        after_transit: bool,
    ) -> bool {
        if self.records[account as usize][payment as usize] != Record::InFlight {
            return false;
        }
        if rail.has(account, payment) {
            return true;
        }
        let owner_gone = !self
            .tasks
            .iter()
            .any(|t| t.account == account && t.payment == payment);
        let arrived_or_lost = !network.in_flight.iter().any(|m| {
            matches!(m, Msg::Forward { account: a, payment: q, .. } if *a == account && *q == payment)
        });
        owner_gone && (arrived_or_lost || !after_transit)
    }

    /// The lookup's answer: the record completed when the rail has the payment, forgotten
    /// otherwise (a retry is then forwarded). Returns whether the rail had it.
    pub fn resolve(&mut self, account: u8, payment: u8, rail: &Rail) -> bool {
        let paid = rail.has(account, payment);
        self.records[account as usize][payment as usize] = if paid {
            Record::Completed
        } else {
            Record::Absent
        };
        paid
    }

    /// The upstream timeout: the proxy stops waiting for the rail and drops its ticket; the
    /// record stays in flight (in doubt).
    pub fn give_up(&mut self, rules: FenceRules, task: &Task) {
        let task = self.take_task(task).expect("a task to give up exists");
        if rules.ordering && rules.turn_until_answer {
            self.drop_ticket(task.proxy, task.account, true);
        }
    }
}
