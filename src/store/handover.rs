//! Several railguard processes on one database: the rail receives an account's tokens in order
//! whichever process each request went through.
//!
//! The compare-and-set decides whether a token may pass, and each process's forwarding order
//! keeps its own forwards for an account in order; neither sees a forward *another* process
//! has on its way to the rail. Without more, process A forwards token 41, the request is held
//! in the network, the grant expires, process B accepts token 42 and forwards it, and the rail
//! receives 42 and then 41 — each process correct on its own.
//!
//! **What each process keeps.** Every compare-and-set this process sends is registered first,
//! in memory, as *pending* under a sequence number (one per statement) with its account
//! ([`Handover::register`]); the entry ([`Entry`]) stays pending until its forward can no
//! longer reach the rail — the rail answered, it was never sent, or it was written and its
//! answer never came and `proxy.rail_transit_ms` has passed since ([`Entry::unanswered`]).
//! The process rewrites its row of `railguard_forwarder` every few milliseconds while that
//! changes, on a connection of its own (a stalled one is replaced at the database timeout): the
//! next sequence number (`horizon`) and the pending entries with their accounts' hashes,
//! snapshotted at once.
//! An entry `(process, seq)` of an account is *settled* when a row of that process has `seq`
//! below its horizon and no pending entry of the account at or below `seq`; settled stays
//! settled.
//!
//! **What the compare-and-set records.** The account's mark row names, beside the mark, each
//! process that forwarded for it and the sequence number of its latest compare-and-set there
//! (`rail_high_water.forwarders`, `forward_seqs`): the statement replaces the caller's entry,
//! keeps the others', and answers them ([`Foreign`]).
//!
//! **The wait.** A request whose compare-and-set answered another process's entry waits, after
//! its turn in this process and before its last look and its forward, until each such entry is
//! settled ([`Handover::wait_settled`]); its own entry stays pending meanwhile, so that waits
//! chain (C behind B behind A). Why that is enough: the row lock orders the two
//! compare-and-sets. If A's came first, B's finds A's entry and B waits until A's forward can
//! no longer arrive. If B's came first, the mark is B's token when A's compare-and-set or A's
//! last look (taken after A's compare-and-set committed) reads it, and A's lower token is
//! refused before anything is sent.
//!
//! **A process that stops writing its row** (killed, paused, cut off from the database) starts
//! no forward once its last write began more than [`ALIVE`] ago ([`Handover::ready_to_send`]),
//! and what it sent arrives within the transit time it states; its row says so in `quiet_ms`,
//! and once that long has passed since the row's `published_at` (the database's clock) its
//! entries count as settled. A killed process's entries neither block an account for ever nor
//! are they dropped while its request may still arrive.
//!
//! **When the store goes back** (a failover to a standby that missed the last commits, a
//! rewind: `store::epoch`), the mark rows' entries go back with the data, and a forward on its
//! way from one process is no longer named where another's compare-and-set looks. What each
//! process has on its way does not go back: it is in the process, which writes it again on
//! the new server, each pending entry with its token. The change raised a floor above every
//! token accepted before it, so after it a forward of a newer grant waits
//! ([`Handover::wait_store_change`]) until (1) the database's clock is [`ALIVE`] + the
//! longest transit time past the change (`railguard_store_epoch.went_back_at`): a process the
//! new server does not know of — its row lost with the data, or it killed or cut off — has by
//! then started nothing for [`ALIVE`], and what it sent has arrived; every process still
//! running has written its row on the new server; and (2) no such row names a pending entry of
//! the account with a token below the floor. No forward of a token below the floor starts once
//! its process has seen the change: the compare-and-set refuses it, and so does the last look
//! of a request accepted before (`proxy::fence`); one whose last look came just before stays
//! pending in its process's row. So every forward sent before the change has reached the rail, or
//! never will, before a newer grant's forward starts. Once a look finds no process with such an
//! entry for any account, the process stops looking until the next change. The embedded server
//! is a database of one process, started and stopped with it: no process it does not know of
//! can have forwarded through it, so (1) is not waited for there — a restart of the default
//! deployment does not pause its payments — while (2) still covers an earlier run of the
//! process killed with forwards on their way.
//!
//! **Cost.** With one process, or accounts each forwarded through one process, the
//! compare-and-set finds only the caller's own entry and answers nothing: no wait and no extra
//! statement; what remains is two small arrays in the mark row and a row rewrite every
//! heartbeat (every [`PUBLISH_EVERY`] while forwards change and another process runs).
//!
//! With several processes and an account's requests spread over them, most compare-and-sets
//! find another process's entry. Each process keeps the other processes' rows as last read
//! (for [`REREAD_AFTER`]): an entry below a row's horizon that the row does not show pending
//! was answered, never sent, or given up before that write, and stays so, so a request waiting
//! for one asks the row as read, not the database. Only an entry handed out after that write
//! (another process forwarding the account right now), or one the row showed pending, reads
//! again. A row's being quiet is taken only from a read made after the request's own
//! compare-and-set: a quiet process may write again and send what it has pending. A running
//! process's entry stays in the row — its next compare-and-set for the account replaces it, and
//! while it stays it costs a look in memory, and a read a second — where removing it would cost
//! a statement for every request that changes process; the entries of a process read quiet
//! (stopped or killed), or without a row, which nothing would replace, are removed from the
//! row once found settled. So an account forwarded through one process after another finds the
//! other's entry until that process forwards it again or stops.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::db::DbError;
use crate::token::AccountId;

mod sql;

use self::sql::{HOLD_SQL, PRUNE_SQL, PUBLISH_SQL, READ_SQL};

/// Shortest time between two writes of this process's row.
pub const PUBLISH_EVERY: Duration = Duration::from_millis(10);
/// Time between two tries to write this process's row while writes fail.
const RETRY_EVERY: Duration = Duration::from_millis(50);
/// Longest time between two writes when nothing changed: how a running process shows it runs.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// A process starts no forward once its last write of its row began longer ago than this.
pub const ALIVE: Duration = Duration::from_secs(3);
/// A forward still waiting for the rail's answer closes its connection once this process's
/// last confirmed write of its row began this long ago (before [`ALIVE`]).
pub const ABORT_AFTER: Duration = Duration::from_millis(2500);
/// What a request held after a change of server must have left of its deadline when the hold
/// ends, for its forward; one that would have less is answered at once instead.
const LEFT_TO_FORWARD: Duration = Duration::from_secs(1);
/// Other processes' rows [`Handover::wait_settled`] keeps as read, at most.
const REMEMBERED_ROWS: usize = 64;
/// How long a row read is asked instead of the database: after that a wait reads the row
/// again, so that a process that stopped is seen quiet and its entries are removed.
pub const REREAD_AFTER: Duration = Duration::from_secs(1);
/// Rows of processes quiet for longer than this are removed at start.
const FORGET_ROWS_AFTER: &str = "1 day";

/// Other processes' entries a compare-and-set found in the account's row: `(instance, seq)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Foreign(pub Vec<(i64, i64)>);

impl Foreign {
    /// The entries of `instances`/`seqs` (a mark row's arrays) that are not `own`'s.
    pub fn from_row(own: i64, instances: &[i64], seqs: &[i64]) -> Self {
        Self(
            instances
                .iter()
                .zip(seqs)
                .filter(|(i, _)| **i != own)
                .map(|(i, s)| (*i, *s))
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Why a forward may not start yet.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error(
        "the request's deadline passed while another railguard's forward for its account could still reach the rail"
    )]
    Deadline,
    #[error(
        "this railguard could not tell the database, for {0:?}, which forwards it has on their way"
    )]
    Silent(Duration),
    #[error(
        "the database changed server moments ago: forwards of newer grants wait {0:?} more, \
         until nothing sent before the change can still reach the rail"
    )]
    Held(Duration),
    #[error(transparent)]
    Db(#[from] DbError),
}

/// This process's forwards, as the other processes see them; see the module docs.
pub struct Handover {
    instance: i64,
    transit: Duration,
    /// The database is this process's own (the embedded server, stopped and started with it):
    /// every process that forwarded through it is this one or an earlier run of it, each with
    /// its row.
    own_database: bool,
    /// Reads of other processes' rows and pruning.
    pool: Pool,
    /// Where this process's row is written from, on a connection of its own.
    url: String,
    connection: tokio::sync::Mutex<Option<(tokio_postgres::Client, tokio_postgres::Statement)>>,
    timeout: Duration,
    state: Mutex<State>,
    changed: Notify,
    /// When the last write of this process's row that the database confirmed began.
    published: watch::Sender<Option<Instant>>,
    /// Until when, as last read, no forward may start after a change of server
    /// ([`Handover::wait_store_change`]): requests meanwhile do not ask the database again.
    held_until: Mutex<Option<Instant>>,
    /// The latest row read of each other process ([`Handover::wait_settled`]). An entry a row
    /// shows settled is settled for good, so a later wait for an entry below that row's
    /// horizon asks the row as read then, not the database again.
    read: Mutex<Remembered>,
}

#[derive(Default)]
struct State {
    next_seq: i64,
    next_id: u64,
    /// Each entry's sequence number, account hash and token.
    pending: HashMap<u64, (i64, i64, i64)>,
}

/// The 64-bit FNV-1a hash of an account id: what a process's row names a pending entry's
/// account by. Two accounts with one hash only make one wait for the other's forward.
fn account_hash(account: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in account.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

async fn connect(url: &str, timeout: Duration) -> Result<tokio_postgres::Client, DbError> {
    let crate::tls::postgres::PgConnect { config, tls, .. } =
        crate::db::pg_config(url, timeout).map_err(|e| DbError::Pool(e.to_string()))?;
    let (client, connection) = crate::db::establish(&config, tls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// One registered compare-and-set's forward: pending until dropped.
pub struct Entry {
    handover: Arc<Handover>,
    id: u64,
}

impl Handover {
    /// Writes this process's first row (durably: a process that forwards has a row) and starts
    /// rewriting it; `instance` is this process's id, `transit` is `proxy.rail_transit_ms`,
    /// `own_database`: the database is the embedded server, this process's alone.
    pub async fn start(
        pool: Pool,
        url: String,
        instance: i64,
        transit: Duration,
        timeout: Duration,
        own_database: bool,
    ) -> Result<Arc<Self>, DbError> {
        let handover = Arc::new(Self {
            instance,
            transit,
            own_database,
            pool,
            url,
            connection: tokio::sync::Mutex::new(None),
            timeout,
            state: Mutex::new(State {
                next_seq: 1,
                ..State::default()
            }),
            changed: Notify::new(),
            published: watch::Sender::new(None),
            held_until: Mutex::new(None),
            read: Mutex::new(Remembered::default()),
        });
        let alone = !handover.publish_with(true).await?;
        let client = handover.pool.get().await?;
        let forget = format!(
            "DELETE FROM railguard_forwarder
             WHERE published_at + quiet_ms * interval '1 millisecond' < now() - interval '{FORGET_ROWS_AFTER}'"
        );
        client.execute(forget.as_str(), &[]).await?;
        drop(client);
        tokio::spawn(handover.clone().keep_publishing(alone));
        Ok(handover)
    }

    pub fn instance(&self) -> i64 {
        self.instance
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update is a few inserts and removals; a panic cannot leave one half-made in a
        // way that hides a pending entry.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers one compare-and-set statement for `requests`' accounts and tokens (one entry
    /// each, in order), to run before it is sent: returns its sequence number and the entries.
    pub fn register<'a>(
        self: &Arc<Self>,
        requests: impl IntoIterator<Item = (&'a AccountId, i64)>,
    ) -> (i64, Vec<Entry>) {
        let mut state = self.state();
        let seq = state.next_seq;
        state.next_seq += 1;
        let mut entries = Vec::new();
        for (account, token) in requests {
            let id = state.next_id;
            state.next_id += 1;
            state
                .pending
                .insert(id, (seq, account_hash(account.as_str()), token));
            entries.push(Entry {
                handover: self.clone(),
                id,
            });
        }
        drop(state);
        self.changed.notify_one();
        (seq, entries)
    }

    /// Whether this process has a forward for `account` that is not settled: about to be sent,
    /// waiting for the rail's answer, or unanswered and within `proxy.rail_transit_ms`. (Two
    /// accounts with one hash only make this say yes more often.)
    pub fn has_pending(&self, account: &AccountId) -> bool {
        let hash = account_hash(account.as_str());
        self.state().pending.values().any(|(_, a, _)| *a == hash)
    }

    /// How long this process says nothing of it can arrive after its last write.
    fn quiet(&self) -> Duration {
        ALIVE + self.transit
    }

    /// Writes this process's row; `durable`: waits for the commit's WAL flush. Returns whether
    /// another process wrote its row within [`ALIVE`]: only another process reads this one,
    /// so while there is none the row is rewritten at the heartbeat only. The rewrites
    /// do not: one lost with a crash leaves an older row, whose horizon is lower and whose
    /// settled entries were settled then — it says less, never something false — and a
    /// database that lost commits fences every grant from before (`store::epoch`).
    async fn publish_with(&self, durable: bool) -> Result<bool, DbError> {
        let began = Instant::now();
        let (horizon, seqs, accounts, tokens) = {
            let state = self.state();
            let mut seqs = Vec::with_capacity(state.pending.len());
            let mut accounts = Vec::with_capacity(state.pending.len());
            let mut tokens = Vec::with_capacity(state.pending.len());
            for (seq, account, token) in state.pending.values() {
                seqs.push(*seq);
                accounts.push(*account);
                tokens.push(*token);
            }
            (state.next_seq, seqs, accounts, tokens)
        };
        let quiet_ms = i64::try_from(self.quiet().as_millis()).unwrap_or(i64::MAX);
        let mut connection = self.connection.lock().await;
        let write = async {
            if connection.is_none() {
                let client = connect(&self.url, self.timeout).await?;
                let statement = client.prepare(PUBLISH_SQL).await?;
                *connection = Some((client, statement));
            }
            let (client, statement) = connection.as_mut().expect("connected just now");
            let transaction = client.transaction().await?;
            if !durable {
                transaction
                    .batch_execute("SET LOCAL synchronous_commit = off")
                    .await?;
            }
            let row = transaction
                .query_opt(
                    &*statement,
                    &[
                        &self.instance,
                        &horizon,
                        &seqs,
                        &accounts,
                        &tokens,
                        &quiet_ms,
                    ],
                )
                .await?;
            transaction.commit().await?;
            // No row: a newer write of this process's row went first; others may be reading it.
            Ok::<_, DbError>(row.is_none_or(|row| row.get::<_, bool>(0)))
        };
        let written = tokio::time::timeout(self.timeout, write)
            .await
            .unwrap_or(Err(DbError::Timeout(self.timeout)));
        if written.is_err() {
            // A connection that failed or stalled is not used again.
            *connection = None;
        }
        let others = written?;
        self.published.send_replace(Some(began));
        Ok(others)
    }

    /// Rewrites this process's row: every [`PUBLISH_EVERY`] while its forwards change and
    /// another process runs (a process that finds this one's entry reads the row until it says
    /// the forward is settled), every [`HEARTBEAT`] otherwise. A process that starts beside
    /// this one waits at most a heartbeat longer, once: a row written less often says less,
    /// never something false.
    async fn keep_publishing(self: Arc<Self>, mut alone: bool) {
        let mut failing = false;
        loop {
            // While writes fail, every moment counts against ALIVE: the next try goes at once.
            if !failing {
                if alone {
                    tokio::time::sleep(HEARTBEAT).await;
                } else {
                    let _ = tokio::time::timeout(HEARTBEAT, self.changed.notified()).await;
                }
            }
            match self.publish_with(false).await.map(|others| {
                alone = !others;
            }) {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!(
                        "this railguard writes which forwards it has on their way again"
                    );
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e,
                        "cannot write which forwards this railguard has on their way; past {ALIVE:?} \
                         without it no forward starts (504, not sent)");
                }
                Err(_) => {}
            }
            tokio::time::sleep(if failing { RETRY_EVERY } else { PUBLISH_EVERY }).await;
        }
    }

    /// Writes this process's row once more as it stops, so that the forwards answered by now
    /// are settled for the other processes at once.
    pub async fn publish_last(&self) {
        if let Err(e) = self.publish_with(true).await.map(|_| ()) {
            tracing::warn!(error = %e,
                "could not write which forwards this railguard still has on their way as it \
                 stops; other railguards hold its accounts' newer tokens until its row is quiet \
                 (proxy.rail_transit_ms after its last write)");
        }
    }

    /// Resolves once this process's last confirmed write of its row began [`ABORT_AFTER`]
    /// ago: a forward still waiting for the rail's answer then closes its connection, so that
    /// what it wrote arrives, if at all, within `proxy.rail_transit_ms` of that — before the
    /// other processes take this one as quiet. A process too paused to run this is beyond any
    /// timer of its own (docs/contract.md, "Ordering of overlapping requests").
    pub async fn silenced(&self) {
        let mut published = self.published.subscribe();
        loop {
            let Some(began) = *published.borrow_and_update() else {
                return;
            };
            tokio::select! {
                () = tokio::time::sleep_until(began + ABORT_AFTER) => return,
                changed = published.changed() => {
                    if changed.is_err() {
                        return std::future::pending().await;
                    }
                }
            }
        }
    }

    /// Whether this process's last confirmed write of its row began less than [`ALIVE`] ago:
    /// checked just before a forward starts, with nothing awaited in between.
    pub fn is_fresh(&self) -> bool {
        self.published
            .borrow()
            .is_some_and(|began| began.elapsed() < ALIVE)
    }

    /// How long ago this process's last confirmed write of its row began.
    pub fn silent_for(&self) -> Duration {
        self.published
            .borrow()
            .map_or(Duration::MAX, |began| began.elapsed())
    }

    /// Waits, until `deadline`, for a write of this process's row that began less than
    /// [`ALIVE`] ago: other processes take this one as quiet once its row is old enough, so it
    /// must not start a forward past that.
    pub async fn ready_to_send(&self, deadline: Instant) -> Result<(), WaitError> {
        let mut published = self.published.subscribe();
        loop {
            let last = *published.borrow_and_update();
            if last.is_some_and(|began| began.elapsed() < ALIVE) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, published.changed()).await {
                Ok(Ok(())) => continue,
                _ => {
                    return Err(WaitError::Silent(
                        last.map_or(Duration::MAX, |began| began.elapsed()),
                    ));
                }
            }
        }
    }

    /// Waits until every entry of `foreign` is settled for `account`, or `deadline`; then
    /// removes those of processes read quiet or without a row from the account's row (in the
    /// background: a removal lost costs a read). Whether it waited: `true` when some entry was
    /// not settled at the first look (another process's forward for the account was still on
    /// its way, or its row not written since it was handed out), `false` when the rows as read
    /// before, or the first read, showed every entry settled.
    pub async fn wait_settled(
        &self,
        account: &AccountId,
        foreign: &Foreign,
        deadline: Instant,
    ) -> Result<bool, WaitError> {
        if self.read.lock().unwrap_or_else(|p| p.into_inner()).settled(
            account.as_str(),
            foreign,
            Instant::now(),
        ) {
            return Ok(false);
        }
        let instances: Vec<i64> = foreign.0.iter().map(|(i, _)| *i).collect();
        let mut pause = Duration::from_millis(2);
        let mut waited = false;
        loop {
            let read = async {
                let client = self.pool.get().await?;
                let statement = client.prepare_cached(READ_SQL).await?;
                Ok::<_, DbError>(client.query(&statement, &[&instances]).await?)
            };
            let rows = match tokio::time::timeout_at(deadline, read).await {
                Ok(rows) => rows?,
                Err(_) => return Err(WaitError::Deadline),
            };
            let rows: HashMap<i64, Published> = rows
                .into_iter()
                .map(|row| {
                    (
                        row.get::<_, i64>(0),
                        Published {
                            horizon: row.get(1),
                            seqs: row.get(2),
                            accounts: row.get(3),
                            quiet: row.get(4),
                        },
                    )
                })
                .collect();
            let settled = foreign.0.iter().all(|(instance, seq)| {
                rows.get(instance)
                    .is_none_or(|row| row.settled(account.as_str(), *seq))
            });
            // Entries of processes without a row, or quiet: none will be replaced by its
            // process's next compare-and-set for the account.
            let gone = Foreign(
                foreign
                    .0
                    .iter()
                    .filter(|(instance, _)| rows.get(instance).is_none_or(|row| row.quiet))
                    .copied()
                    .collect(),
            );
            self.read
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .keep(rows, Instant::now());
            if settled {
                self.prune(account, &gone);
                return Ok(waited);
            }
            if Instant::now() + pause >= deadline {
                return Err(WaitError::Deadline);
            }
            waited = true;
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// After the database changed server (`store::epoch`): waits until no forward of a token
    /// below the new floor can still reach the rail ahead of `account`'s next one (the module
    /// docs, "When the store goes back"), or fails at once with [`WaitError::Held`] when that
    /// leaves less than a second of `deadline` for the forward. Returns the store's
    /// epoch once no process has such a forward for any account: nothing more to wait for until
    /// the next change.
    pub async fn wait_store_change(
        &self,
        account: &AccountId,
        deadline: Instant,
    ) -> Result<Option<i64>, WaitError> {
        self.wait_for_the_change(account, deadline, self.own_database)
            .await
    }

    /// [`Handover::wait_store_change`] with (1) waited for on the embedded server too: what an
    /// earlier run of this process sent is known only through its row, which goes back with the
    /// data when the data directory is restored. For asking the rail about a request sent
    /// before the change (`proxy::fence`), where a "not found" while one may still arrive would
    /// be acted on: a newer grant's forward keeps the embedded server's shorter wait.
    pub async fn wait_until_nothing_from_before_can_arrive(
        &self,
        account: &AccountId,
        deadline: Instant,
    ) -> Result<Option<i64>, WaitError> {
        self.wait_for_the_change(account, deadline, false).await
    }

    async fn wait_for_the_change(
        &self,
        account: &AccountId,
        deadline: Instant,
        own_database: bool,
    ) -> Result<Option<i64>, WaitError> {
        let quiet_ms = i64::try_from(self.quiet().as_millis()).unwrap_or(i64::MAX);
        let hash = account_hash(account.as_str());
        let mut pause = Duration::from_millis(2);
        // The shared bound is for newer grants' forwards; a wait of another kind keeps its own.
        let shared = own_database == self.own_database;
        let mut own_until: Option<Instant> = None;
        loop {
            let held_until = if shared {
                *self.held_until.lock().unwrap_or_else(|p| p.into_inner())
            } else {
                own_until
            };
            if let Some(until) = held_until.filter(|until| *until > Instant::now()) {
                if until + LEFT_TO_FORWARD >= deadline {
                    return Err(WaitError::Held(until - Instant::now()));
                }
                tokio::time::sleep_until(until).await;
            }
            let read = async {
                let client = self.pool.get().await?;
                let statement = client.prepare_cached(HOLD_SQL).await?;
                Ok::<_, DbError>(
                    client
                        .query_one(
                            &statement,
                            &[&self.instance, &hash, &quiet_ms, &own_database],
                        )
                        .await?,
                )
            };
            let row = match tokio::time::timeout_at(deadline, read).await {
                Ok(row) => row?,
                Err(_) => return Err(WaitError::Deadline),
            };
            let (epoch, wait_ms, here, anywhere): (i64, i64, bool, bool) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            if wait_ms > 0 {
                let wait = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(u64::MAX));
                let until = Instant::now() + wait;
                if !shared {
                    own_until = Some(until);
                    continue;
                }
                let mut held = self.held_until.lock().unwrap_or_else(|p| p.into_inner());
                if held.is_none_or(|known| known + Duration::from_secs(1) < until) {
                    tracing::warn!(
                        ?wait,
                        "the database changed server: no forward of a newer grant starts for \
                         {wait:?}, while one sent before the change may still be on its way to \
                         the rail (docs/operations.md, \"When a store goes back\")"
                    );
                }
                *held = Some(until);
                drop(held);
                continue;
            }
            if !anywhere {
                return Ok(Some(epoch));
            }
            if !here {
                return Ok(None);
            }
            if Instant::now() + pause >= deadline {
                return Err(WaitError::Deadline);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Removes `foreign`'s entries from the account's row (nothing when it is empty), in the
    /// background.
    fn prune(&self, account: &AccountId, foreign: &Foreign) {
        if foreign.is_empty() {
            return;
        }
        let (pool, timeout, account) = (self.pool.clone(), self.timeout, account.to_string());
        let (instances, seqs): (Vec<i64>, Vec<i64>) = foreign.0.iter().copied().unzip();
        tokio::spawn(async move {
            let prune = async {
                let client = pool.get().await?;
                let statement = client.prepare_cached(PRUNE_SQL).await?;
                client
                    .execute(&statement, &[&account, &instances, &seqs])
                    .await?;
                Ok::<_, DbError>(())
            };
            if let Ok(Err(e)) = tokio::time::timeout(timeout, prune).await {
                tracing::debug!(error = %e, "could not remove settled forward entries");
            }
        });
    }
}

/// Other processes' rows as last read ([`Handover::wait_settled`]), each with when it was
/// read.
#[derive(Default)]
struct Remembered(HashMap<i64, (Published, Instant)>);

impl Remembered {
    /// Whether the rows read within [`REREAD_AFTER`] of `now` show every entry of `foreign`
    /// answered for `account` ([`Published::answered`]): each entry below its process's horizon
    /// as read, so that the row was written after the entry was handed out, and not pending in
    /// it. That stays true once written, whenever the row was read. Its being quiet does not:
    /// a quiet process may write its row again and send what it has pending, so it is not
    /// taken from here. An entry at or above the horizon read, pending in the row, or of a
    /// process not read lately, needs a read.
    fn settled(&self, account: &str, foreign: &Foreign, now: Instant) -> bool {
        foreign.0.iter().all(|(instance, seq)| {
            self.0
                .get(instance)
                .filter(|(_, at)| now.saturating_duration_since(*at) < REREAD_AFTER)
                .is_some_and(|(row, _)| row.answered(account, *seq))
        })
    }

    /// Keeps `rows`, read at `at`, each in place of the earlier read of its process's row
    /// unless that one has a higher horizon (a later write, read by a read that ended first).
    fn keep(&mut self, rows: HashMap<i64, Published>, at: Instant) {
        if self.0.len() + rows.len() > REMEMBERED_ROWS {
            // Rows of processes long gone: forgetting costs a read each.
            self.0.clear();
        }
        for (instance, row) in rows {
            match self.0.get(&instance) {
                Some((known, _)) if known.horizon > row.horizon => {}
                _ => {
                    self.0.insert(instance, (row, at));
                }
            }
        }
    }
}

/// One process's row as read.
struct Published {
    horizon: i64,
    seqs: Vec<i64>,
    accounts: Vec<i64>,
    quiet: bool,
}

impl Published {
    /// Whether `seq` of `account` is settled as of this read: answered, or the process quiet.
    fn settled(&self, account: &str, seq: i64) -> bool {
        self.quiet || self.answered(account, seq)
    }

    /// Whether `seq` had been handed out when the row was written and no entry of `account` at
    /// or below it was pending then: each of them answered, never sent, or given up, for good.
    fn answered(&self, account: &str, seq: i64) -> bool {
        let account = account_hash(account);
        seq < self.horizon
            && !self
                .seqs
                .iter()
                .zip(&self.accounts)
                .any(|(s, a)| *s <= seq && *a == account)
    }
}

impl Entry {
    /// [`Handover::silenced`] of this entry's process.
    pub async fn silenced(&self) {
        self.handover.silenced().await
    }

    /// The forward was written and its answer never came (the connection failed, or it was
    /// let go waiting): it counts as on its way for `proxy.rail_transit_ms` more.
    pub fn unanswered(self) {
        let transit = self.handover.transit;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    tokio::time::sleep(transit).await;
                    drop(self);
                });
            }
            // A runtime shutting down: the process is ending, and its row's quiet time covers
            // what it sent.
            Err(_) => std::mem::forget(self),
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.handover.state().pending.remove(&self.id);
        self.handover.changed.notify_one();
    }
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry").field("id", &self.id).finish()
    }
}

#[cfg(test)]
mod tests;
