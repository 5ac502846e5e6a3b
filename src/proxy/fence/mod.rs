//! The fence check (FR-17): a request is forwarded only if its token is at least its account's
//! high-water mark, and forwarding it raises the mark to its token.
//!
//! Order of work for one request:
//! 1. A token below a mark this process already knows is refused at once (the cache holds
//!    lower bounds only, so this can never refuse a current token).
//! 2. The request takes its place in the account's forwarding order (see `ordering`).
//! 3. One compare-and-set in PostgreSQL decides. Stale: 409, nothing forwarded.
//! 4. Accepted: the request waits for its turn; a higher token admitted in the meantime in
//!    this process makes it stale after all (409).
//! 5. Just before the forward starts, the account's mark is read again (a read, grouped, no
//!    commit): if another railguard process has accepted a higher token since step 3, this
//!    one is stale now and is refused (409, counted in `lock_fenced_out_total`, logged with
//!    both tokens), instead of reaching the rail after the newer one. What remains is the
//!    moment between that read and the first byte on the wire; `ordering` explains why
//!    closing it completely would need a row lock held across the send.
//!    Before that read, a request whose compare-and-set found another railguard process's
//!    forward for the account waits until that forward can no longer reach the rail
//!    (`store::handover`), so that the rail receives the account's tokens in order whichever
//!    process each went through.
//!
//! **Why a mark advanced by a request whose forward then failed is safe.** The mark only says
//! "a grant with this token exists": tokens come from grants, and a grant is issued only after
//! every earlier grant of the key has ended (INV-04, INV-06). Every holder with a lower token
//! has therefore been superseded whether or not this particular request reached the rail, so
//! refusing them loses nothing that fencing should allow. The holder of the token itself is
//! not harmed: equal tokens are accepted, so it can retry (with its idempotency key). The same
//! argument covers a compare-and-set that committed but whose answer was lost to a timeout or
//! a dropped connection: the outcome is a mark at most as high as a real grant's token.
//!
//! **Where the marks live** is behind [`HighWater`], the way the lock service's backends are
//! behind `LockBackend`: the server's is PostgreSQL's [`HighWaterStore`] (one row per
//! account, group-committed compare-and-sets); the layer's unit tests use marks in memory.
//!
//! **Kill switch** (`fencing.enforce = false`, C5 §5.2): the compare-and-set still runs and
//! counts what it would have refused in `railguard_would_have_fenced_total`, but everything is
//! forwarded, even when the database is unreachable.

mod high_water;
mod lost_attempt;
mod mark_cache;
mod ordering;
mod refusal_log;
mod runs_on;
mod turn;

pub use self::high_water::HighWater;
use self::lost_attempt::LostAttempt;
pub use self::turn::Turn;

use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;
use tower::Layer;
use tracing::Instrument;

use crate::store::marks::{HighWaterStore, StoreError, Verdict};
use crate::store::records::{NewRecord, Records};

use self::mark_cache::MarkCache;
use self::ordering::{ForwardOrder, Ticket};
use self::refusal_log::RefusalLog;
use self::runs_on::RunsOn;
use super::admission::{Admission, Admitted, Keyed};
use super::forward::{LateForwards, UpstreamTimeout};
use super::idempotency::MaybeSent;
use super::idempotency::{
    IdempotencyConflict, RecordGuard, Resolver, lost_first_attempt, own_answer,
};
use super::{BoxError, FencedRequest, ProxyResponse, Step};
use crate::metrics::{FencePath, Metrics};
use crate::store::epoch::StoreEpoch;
use crate::store::handover::{Entry, Foreign, Handover, WaitError};
use crate::token::{AccountId, FencingToken};
use crate::work::Working;

/// The token is below the account's mark. Deliberately holds no mark: the 409 body is built
/// from this and must never reveal one.
#[derive(Debug, thiserror::Error)]
#[error("fencing token {token} for account {account} is stale")]
pub struct FencedOut {
    pub account: AccountId,
    pub token: FencingToken,
    /// Refused because it is below the fencing floor: its grant was made before the store
    /// last went back (`store::epoch`), not superseded by a later holder. Counted apart from
    /// `lock_fenced_out_total`, which pages on a lease lost under a live holder.
    pub below_floor: bool,
}

/// No verdict could be had from the database; nothing was forwarded.
#[derive(Debug, thiserror::Error)]
#[error("the fence check could not be made: {0}")]
pub struct FenceUnavailable(#[from] pub StoreError);

/// The proxy's fencing point: what every request's fence check shares — the marks, this
/// process's lower bounds of them, the per-account forwarding order, and the switch.
pub struct FencePoint<H = HighWaterStore> {
    marks: H,
    cache: MarkCache,
    order: Arc<ForwardOrder>,
    metrics: Arc<Metrics>,
    enforce: bool,
    refusals: RefusalLog,
    /// Where requests are counted from before their compare-and-set until their forward ends
    /// ([`LateForwards`]), so that a stop sees one whose record is made and whose forward is to
    /// come; `None` counts nothing (tests of this module alone).
    outstanding: Option<LateForwards>,
    /// The fencing floor this process knows (`store::epoch`): a token below it is refused
    /// without asking the database, whose compare-and-set refuses it anyway.
    epoch: Option<Arc<StoreEpoch>>,
    /// Where a refused keyed request looks for the record of its own earlier attempt
    /// (`idempotency::own_answer`); `None`: refusals stand.
    records: Option<Arc<dyn Records>>,
    /// This process's forwards as the other processes see them, and theirs as this one waits
    /// for them (`store::handover`); `None`: no waiting (one process, the tests of this
    /// module, or the negative control `fencing.order_across_processes = false`).
    handover: Option<Arc<Handover>>,
    /// The rail's lookup, for a retry whose first attempt's record went back with the store
    /// (`[rail_lookup]`); `None`: such a retry stays in doubt.
    resolver: Option<Arc<Resolver>>,
}

/// Accounts whose cache refusals' log lines are limited at once (see `refusal_log`).
const REFUSAL_LOG_ACCOUNTS: usize = 100_000;

impl<H: HighWater> FencePoint<H> {
    pub fn new(marks: H, cache_capacity: u64, metrics: Arc<Metrics>, enforce: bool) -> Self {
        metrics.fencing_enforced.set(i64::from(enforce));
        Self {
            marks,
            cache: MarkCache::new(cache_capacity),
            order: ForwardOrder::new(),
            metrics,
            enforce,
            refusals: RefusalLog::new(REFUSAL_LOG_ACCOUNTS),
            outstanding: None,
            epoch: None,
            records: None,
            handover: None,
            resolver: None,
        }
    }

    /// Waits, before a forward starts, for other processes' forwards for its account that may
    /// still reach the rail (`store::handover`).
    pub fn ordered_across_processes(mut self, handover: Option<Arc<Handover>>) -> Self {
        self.handover = handover;
        self
    }

    /// A refused keyed request made under the same token as a record of its key gets that
    /// record's answer instead of the refusal (`idempotency::own_answer`).
    pub fn answering_own_repeats(mut self, records: Arc<dyn Records>) -> Self {
        self.records = Some(records);
        self
    }

    /// `refusal`, unless the request is a repeat of one this token already made.
    async fn refuse(
        &self,
        request: &FencedRequest,
        refusal: impl FnOnce() -> BoxError,
    ) -> Result<ProxyResponse, BoxError> {
        if let Some(records) = &self.records
            && let Some(answer) = own_answer(&**records, request).await
        {
            return answer;
        }
        Err(refusal())
    }

    /// A retry whose first attempt's record went back with the store asks the rail about its
    /// key through `resolver` ([`Resolver::ask_about_lost`]); `None`: such a retry stays in
    /// doubt.
    pub fn asking_the_rail(mut self, resolver: Option<Arc<Resolver>>) -> Self {
        self.resolver = resolver;
        self
    }

    /// Refuses tokens below `epoch`'s floor before anything else.
    pub fn with_floor(mut self, epoch: Arc<StoreEpoch>) -> Self {
        self.epoch = Some(epoch);
        self
    }

    fn below_known_floor(&self, token: FencingToken) -> bool {
        self.epoch
            .as_ref()
            .is_some_and(|epoch| token.get() < epoch.floor())
    }

    /// Counts every request among `forwards` from before its compare-and-set until its forward
    /// ends.
    pub fn counting_into(mut self, forwards: LateForwards) -> Self {
        self.outstanding = Some(forwards);
        self
    }

    /// The compare-and-set for `request` (with its idempotency record, if any), timed from
    /// `started`.
    async fn check(
        &self,
        request: &FencedRequest,
        started: Instant,
        span: &tracing::Span,
    ) -> Result<Verdict, StoreError> {
        let verdict = self
            .marks
            .advance(
                &request.account,
                request.token,
                new_record(request, self.marks.timeout()),
            )
            .instrument(span.clone())
            .await;
        self.metrics
            .observe_fence(FencePath::Database, started.elapsed().as_secs_f64());
        verdict
    }

    /// A refusal decided by the database (the compare-and-set, the last look) or by this
    /// process's forwarding order: always logged, at most one per compare-and-set.
    fn fenced_out(&self, account: AccountId, token: FencingToken, why: &'static str) -> BoxError {
        tracing::warn!(lock.token = token.get(), account = %account, why,
            "stale fencing token refused: a lease expired under a live holder");
        FencedOut {
            account,
            token,
            below_floor: false,
        }
        .into()
    }

    /// A refusal because the token's grant was made before the store last went back: each
    /// holder from before meets it once, then takes a new grant.
    fn below_floor(&self, account: AccountId, token: FencingToken) -> BoxError {
        if let Some(left_out) = self.refusals.admit(&account) {
            tracing::warn!(lock.token = token.get(), account = %account, left_out,
                "fencing token refused: its grant was made before the store went back (a \
                 failover, a restart, a rewound data directory, a restored etcd); the holder \
                 must take a new grant (counted in railguard_fenced_below_floor_total)");
        }
        FencedOut {
            account,
            token,
            below_floor: true,
        }
        .into()
    }

    /// A refusal from the mark cache, with no database work: what a worker stuck on a
    /// superseded grant repeats as fast as it can. Logged at most once a second per account
    /// (`refusal_log`), the account's first refusal always.
    fn fenced_out_cached(&self, account: AccountId, token: FencingToken) -> BoxError {
        if let Some(left_out) = self.refusals.admit(&account) {
            tracing::warn!(lock.token = token.get(), account = %account,
                why = "below a mark already seen", left_out,
                "stale fencing token refused: a lease expired under a live holder \
                 (left_out: this account's refusals not logged since its last such line; all \
                 are counted in lock_fenced_out_total)");
        }
        FencedOut {
            account,
            token,
            below_floor: false,
        }
        .into()
    }
}

/// Makes [`Fence`] services around one [`FencePoint`].
pub struct FenceLayer<H = HighWaterStore> {
    point: Arc<FencePoint<H>>,
}

impl<H> Clone for FenceLayer<H> {
    fn clone(&self) -> Self {
        Self {
            point: self.point.clone(),
        }
    }
}

impl<H> FenceLayer<H> {
    pub fn new(point: Arc<FencePoint<H>>) -> Self {
        Self { point }
    }
}

impl<S, H> Layer<S> for FenceLayer<H> {
    type Service = Fence<S, H>;
    fn layer(&self, inner: S) -> Self::Service {
        Fence {
            inner: Arc::new(inner),
            point: self.point.clone(),
        }
    }
}

/// Forwards a request only if its token passes the account's mark; see the module docs.
pub struct Fence<S, H = HighWaterStore> {
    /// Shared, so that a forward that must run to its end (`RunsOn`) can own it.
    inner: Arc<S>,
    point: Arc<FencePoint<H>>,
}

impl<S, H> Step<FencedRequest> for Fence<S, H>
where
    S: Step<Admitted>,
    H: HighWater,
{
    fn handle(
        &self,
        request: FencedRequest,
    ) -> impl Future<Output = Result<ProxyResponse, BoxError>> + Send {
        // At debug: the request's span (`proxy.request`) carries the token and account at info,
        // and a span per step at info costs more than the check itself when nothing is logged.
        let span = tracing::debug_span!("fence.check",
            lock.token = request.token.get(), account = %request.account, verdict = tracing::field::Empty);
        async move {
            if self.point.enforce {
                enforce(&self.point, &self.inner, request, span).await
            } else {
                observe_only(&self.point, &*self.inner, request, span).await
            }
        }
    }
}

async fn enforce<S, H>(
    point: &Arc<FencePoint<H>>,
    inner: &Arc<S>,
    request: FencedRequest,
    span: tracing::Span,
) -> Result<ProxyResponse, BoxError>
where
    S: Step<Admitted>,
    H: HighWater,
{
    let (token, account) = (request.token, request.account.clone());
    let started = Instant::now();
    if point.below_known_floor(token) {
        span.record("verdict", "below_floor");
        return point
            .refuse(&request, || point.below_floor(account, token))
            .await;
    }
    if point.cache.is_definitely_stale(&account, token) {
        point
            .metrics
            .observe_fence(FencePath::Cache, started.elapsed().as_secs_f64());
        span.record("verdict", "stale_cached");
        return point
            .refuse(&request, || point.fenced_out_cached(account, token))
            .await;
    }

    // A retry whose key was first sent before the store last went back, and whose record did
    // not survive it, may already be paid: in doubt, never forwarded on a guess — unless the
    // rail, asked once nothing sent before the change can still reach it, has no payment
    // under the key: then it goes on as the key's first request.
    if let Some(records) = &point.records
        && lost_first_attempt(&**records, &request).await?
    {
        // Boxed: a rare path, whose future would otherwise make every request's larger.
        match Box::pin(point.ask_the_rail_about_a_lost_attempt(&request)).await {
            LostAttempt::NotOnTheRail => {
                span.record("verdict", "first_attempt_not_on_the_rail");
            }
            LostAttempt::OnTheRail => {
                span.record("verdict", "first_attempt_on_the_rail");
                return Err(IdempotencyConflict::FirstAttemptOnTheRail.into());
            }
            LostAttempt::NotYet(wait) => {
                span.record("verdict", "first_attempt_may_still_arrive");
                return Err(FenceUnavailable(StoreError::HeldAfterStoreChange(wait)).into());
            }
            LostAttempt::Unknown => {
                span.record("verdict", "first_attempt_lost");
                return Err(IdempotencyConflict::FirstAttemptLost.into());
            }
        }
    }

    // Counted before the compare-and-set: once it commits, a keyed request owns a record whose
    // forward is to come, and a stop must not say this process sends nothing more.
    let counted = point.outstanding.as_ref().map(LateForwards::start);
    // Take our place before the compare-and-set, so that a higher token committed after ours
    // cannot lose track of us (see `ordering`).
    let ticket = point.order.enter(&account);
    match point
        .check(&request, started, &span)
        .await
        .map_err(FenceUnavailable)?
    {
        Verdict::Stale if point.below_known_floor(token) => {
            span.record("verdict", "below_floor");
            point
                .refuse(&request, || point.below_floor(account, token))
                .await
        }
        Verdict::Stale => {
            span.record("verdict", "stale");
            point.cache.raise_past(&account, token);
            point
                .refuse(&request, || {
                    point.fenced_out(account, token, "below the mark")
                })
                .await
        }
        Verdict::Accepted {
            record,
            entry,
            foreign,
        } => {
            span.record("verdict", "accepted");
            point.cache.raise(&account, token.get());
            if let Some(epoch) = &point.epoch {
                epoch.observe(token.get());
            }
            let owns_record = record.is_some();
            let sent = MaybeSent::default();
            let admission = Admission {
                record: record.map(|r| RecordGuard::adopt(r, sent.clone())),
                sent,
                ..Admission::default()
            };
            let admitted = Admitted { request, admission };
            let placed = Placed {
                ticket,
                entry,
                foreign,
                counted,
            };
            if owns_record {
                // A request that owns a record keeps its turn until the rail has answered, and
                // has that answer stored, even if its client goes away: it runs in its
                // connection's task while that task waits for it, and on in a task of its own
                // if the connection lets it go (`RunsOn`), so a dropped connection does not
                // cancel it. (Before its forward may have reached the rail, its record guard
                // removes the record on any failure.)
                RunsOn::new(admitted_forward(
                    point.clone(),
                    inner.clone(),
                    admitted,
                    placed,
                    account,
                    token,
                ))
                .await
            } else {
                // Made where it is awaited, as above: the fence's own future then holds no
                // second copy of the forward's.
                admitted_forward(&**point, &**inner, admitted, placed, account, token).await
            }
        }
    }
}

/// What an accepted compare-and-set leaves a request with: its place in this process's order,
/// its forward's entry as other processes see it, their entries it must wait for, and its
/// count among the process's outstanding forwards, held until its forward ends.
struct Placed {
    ticket: Ticket,
    entry: Option<Entry>,
    foreign: Foreign,
    counted: Option<Working>,
}

/// Waits for the request's turn (in this process, then behind other processes' forwards),
/// takes the last look at the mark, and forwards. Every early return drops the request before
/// it was sent, so its record guard (if any) removes its record, and its entry is settled.
///
/// `point` and `inner` are borrowed where the request's own task runs it to its end, owned
/// (`Arc`) where it may go on in a task of its own (`RunsOn`).
async fn admitted_forward<S, H>(
    point: impl std::ops::Deref<Target = FencePoint<H>>,
    inner: impl std::ops::Deref<Target = S>,
    admitted: Admitted,
    placed: Placed,
    account: AccountId,
    token: FencingToken,
) -> Result<ProxyResponse, BoxError>
where
    S: Step<Admitted>,
    H: HighWater,
{
    let Placed {
        mut ticket,
        entry,
        foreign,
        counted: _counted,
    } = placed;
    let Admitted {
        mut request,
        mut admission,
    } = admitted;
    match request.deadline.bound(ticket.admit(token)).await {
        Ok(Ok(())) => {}
        Ok(Err(_superseded)) => {
            point.cache.raise_past(&account, token);
            return Err(point.fenced_out(account, token, "a higher token was admitted meanwhile"));
        }
        Err(_) => return Err(UpstreamTimeout::waiting_for_turn().into()),
    }
    // Another process's forward for this account may still be on its way: ours waits until it
    // can no longer reach the rail, so that it cannot arrive after ours. A keyed request whose
    // record existed before is answered from that record and never forwarded: it does not wait.
    let forwards = request.idempotency.is_none() || admission.record.is_some();
    if let Some(handover) = &point.handover
        && forwards
        && !foreign.is_empty()
    {
        tracing::debug!(lock.token = token.get(), account = %account, others = ?foreign.0,
            "waiting for another railguard's forward for this account");
        // Boxed, as the next wait: rare paths, whose futures would otherwise make every
        // request's larger (an allocation above the allocator's small sizes).
        let settled =
            Box::pin(handover.wait_settled(&account, &foreign, request.deadline.instant())).await;
        // Counted when it waited (an entry not settled at the first look) or gave up waiting.
        if !matches!(settled, Ok(false)) {
            point.metrics.handover_waits.inc();
        }
        settled.map_err(|e| waited(e, &account, token))?;
    }
    // The database changed server since this process last found every forward sent before
    // the change arrived or gone: one may still be on its way, and the data that named it may
    // be lost; ours waits until none can still arrive.
    if let (Some(handover), Some(epoch)) = (&point.handover, &point.epoch)
        && forwards
        && epoch.unsettled_change()
    {
        match Box::pin(handover.wait_store_change(&account, request.deadline.instant())).await {
            Ok(Some(settled)) => epoch.change_settled(settled),
            Ok(None) => {}
            Err(e) => return Err(waited(e, &account, token)),
        }
    }
    if let Some(handover) = &point.handover
        && forwards
    {
        handover
            .ready_to_send(request.deadline.instant())
            .await
            .map_err(|e| waited(e, &account, token))?;
    }
    // The last look: has another railguard accepted a higher token for this account since our
    // compare-and-set? Then ours must not reach the rail after it. Taken on every request, not
    // only after a wait for an earlier forward: the compare-and-set's verdict can take any time
    // to reach us after its commit (the network, a batch handing out its replies, a busy
    // scheduler), and no clock may decide that it is still fresh.
    let looked = request
        .deadline
        .bound(point.marks.current_mark(&account))
        .await;
    match looked {
        Ok(Ok(mark)) if mark > token.get() => {
            point.cache.raise(&account, mark);
            tracing::warn!(lock.token = token.get(), account = %account, mark,
                "a token superseded in the database after its compare-and-set (another \
                 railguard accepted a newer grant) was refused before its forward started");
            return Err(point.fenced_out(account, token, "superseded before its forward started"));
        }
        // The look ran on a session checked against the store's epoch: a change of server since
        // the compare-and-set raised the floor this process knows, and a token from before it
        // is not sent after it.
        Ok(Ok(_)) if point.below_known_floor(token) => {
            return Err(point.below_floor(account, token));
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(FenceUnavailable(e).into()),
        Err(_) => return Err(UpstreamTimeout::waiting_for_turn().into()),
    }
    // Other processes take this one as quiet once its row is old: it starts nothing past that,
    // and its last look must be taken while its row is fresh — a look taken before a wait for
    // the row would be out of date by the time the row says this process runs.
    if let Some(handover) = &point.handover
        && forwards
        && !handover.is_fresh()
    {
        return Err(waited(
            WaitError::Silent(handover.silent_for()),
            &account,
            token,
        ));
    }
    // The ticket travels with the request: the forward holds it until the rail has answered
    // (or it gave up waiting for a late answer); only then may a higher token for this
    // account start its forward.
    admission.turn = Some(Turn {
        _ticket: ticket,
        entry,
    });
    inner.handle(Admitted { request, admission }).await
}

/// A wait for the handover that did not end in a turn: nothing was sent.
fn waited(error: WaitError, account: &AccountId, token: FencingToken) -> BoxError {
    match error {
        WaitError::Deadline => {
            tracing::warn!(lock.token = token.get(), account = %account,
                "the request's deadline passed while another railguard's forward for its account \
                 could still reach the rail; not sent");
            UpstreamTimeout::waiting_for_turn().into()
        }
        WaitError::Silent(for_how_long) => {
            tracing::warn!(lock.token = token.get(), account = %account, ?for_how_long,
                "this railguard could not write which forwards it has on their way; not sent");
            UpstreamTimeout::waiting_for_turn().into()
        }
        WaitError::Held(for_how_long) => {
            tracing::warn!(lock.token = token.get(), account = %account, ?for_how_long,
                "the database changed server moments ago; a forward sent before may still be on \
                 its way to the rail; not sent");
            FenceUnavailable(StoreError::HeldAfterStoreChange(for_how_long)).into()
        }
        WaitError::Db(e) => FenceUnavailable(StoreError::Db(e)).into(),
    }
}

async fn observe_only<S, H>(
    point: &FencePoint<H>,
    inner: &S,
    request: FencedRequest,
    span: tracing::Span,
) -> Result<ProxyResponse, BoxError>
where
    S: Step<Admitted>,
    H: HighWater,
{
    let (token, account) = (request.token, request.account.clone());
    let verdict = point.check(&request, Instant::now(), &span).await;
    let mut admission = Admission::default();
    match verdict {
        Ok(Verdict::Accepted { record, .. }) => {
            span.record("verdict", "accepted");
            admission.record = record.map(|r| RecordGuard::adopt(r, admission.sent.clone()));
        }
        Ok(Verdict::Stale) => {
            span.record("verdict", "stale_forwarded");
            point.metrics.would_have_fenced.inc();
            tracing::warn!(lock.token = token.get(), account = %account,
                "FENCING IS OFF: forwarding a stale token that would have been fenced out");
            // No record was made for it: forward it as if it had no key.
            admission.keyed = Keyed::AsUnkeyed;
        }
        Err(e) => {
            span.record("verdict", "unknown");
            tracing::warn!(lock.token = token.get(), account = %account, error = %e,
                "FENCING IS OFF: forwarding without a fence check");
            admission.keyed = Keyed::AsUnkeyed;
        }
    }
    inner.handle(Admitted { request, admission }).await
}

/// The record a request creates with its compare-and-set. It is in doubt, unless completed,
/// once the request's own deadline and the time to store its outcome have passed.
fn new_record(request: &FencedRequest, store_timeout: std::time::Duration) -> Option<NewRecord> {
    let remaining = request
        .deadline
        .instant()
        .saturating_duration_since(Instant::now());
    request.idempotency.as_ref().map(|k| NewRecord {
        key: k.key.clone(),
        fingerprint: k.fingerprint.clone(),
        owner: k.owner.clone(),
        in_doubt_after: remaining + store_timeout + std::time::Duration::from_secs(1),
    })
}

#[cfg(test)]
mod tests;
