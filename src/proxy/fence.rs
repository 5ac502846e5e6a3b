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
//! **Kill switch** (`fencing.enforce = false`, C5 §5.2): the compare-and-set still runs and
//! counts what it would have refused in `railguard_would_have_fenced_total`, but everything is
//! forwarded, even when the database is unreachable.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::time::Instant;
use tower::{Layer, Service};
use tracing::Instrument;

use super::mark_cache::MarkCache;
use super::ordering::ForwardOrder;
use super::{BoxError, FencedRequest, ProxyResponse};
use crate::high_water::{HighWaterStore, NewRecord, StoreError, Verdict};
use crate::metrics::{FencePath, Metrics};
use crate::token::{AccountId, FencingToken};

/// The token is below the account's mark. Deliberately holds no mark: the 409 body is built
/// from this and must never reveal one.
#[derive(Debug, thiserror::Error)]
#[error("fencing token {token} for account {account} is stale")]
pub struct FencedOut {
    pub account: AccountId,
    pub token: FencingToken,
}

/// No verdict could be had from the database; nothing was forwarded.
#[derive(Debug, thiserror::Error)]
#[error("the fence check could not be made: {0}")]
pub struct FenceUnavailable(#[from] pub StoreError);

/// Everything the fence check shares between requests.
pub struct Fence {
    store: HighWaterStore,
    cache: MarkCache,
    order: Arc<ForwardOrder>,
    metrics: Arc<Metrics>,
    enforce: bool,
}

impl Fence {
    pub fn new(
        store: HighWaterStore,
        cache_capacity: u64,
        metrics: Arc<Metrics>,
        enforce: bool,
    ) -> Self {
        metrics.fencing_enforced.set(i64::from(enforce));
        Self {
            store,
            cache: MarkCache::new(cache_capacity),
            order: ForwardOrder::new(),
            metrics,
            enforce,
        }
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
            .store
            .advance(
                &request.account,
                request.token,
                new_record(request, self.store.timeout()),
            )
            .instrument(span.clone())
            .await;
        self.metrics
            .observe_fence(FencePath::Database, started.elapsed().as_secs_f64());
        verdict
    }

    fn fenced_out(&self, account: AccountId, token: FencingToken, why: &'static str) -> BoxError {
        tracing::warn!(lock.token = token.get(), account = %account, why,
            "stale fencing token refused: a lease expired under a live holder");
        FencedOut { account, token }.into()
    }
}

#[derive(Clone)]
pub struct FenceLayer {
    fence: Arc<Fence>,
}

impl FenceLayer {
    pub fn new(fence: Arc<Fence>) -> Self {
        Self { fence }
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = FenceService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        FenceService {
            inner,
            fence: self.fence.clone(),
        }
    }
}

#[derive(Clone)]
pub struct FenceService<S> {
    inner: S,
    fence: Arc<Fence>,
}

impl<S> Service<FencedRequest> for FenceService<S>
where
    S: Service<FencedRequest, Response = ProxyResponse, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = ProxyResponse;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<ProxyResponse, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: FencedRequest) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let fence = self.fence.clone();
        let span = tracing::info_span!("fence.check",
            lock.token = request.token.get(), account = %request.account, verdict = tracing::field::Empty);
        Box::pin(async move {
            if fence.enforce {
                enforce(fence, inner, request, span).await
            } else {
                observe_only(fence, inner, request, span).await
            }
        })
    }
}

async fn enforce<S>(
    fence: Arc<Fence>,
    inner: S,
    mut request: FencedRequest,
    span: tracing::Span,
) -> Result<ProxyResponse, BoxError>
where
    S: Service<FencedRequest, Response = ProxyResponse, Error = BoxError> + Send + 'static,
    S::Future: Send,
{
    let (token, account) = (request.token, request.account.clone());
    let started = Instant::now();
    if fence.cache.is_definitely_stale(&account, token) {
        fence
            .metrics
            .observe_fence(FencePath::Cache, started.elapsed().as_secs_f64());
        span.record("verdict", "stale_cached");
        return Err(fence.fenced_out(account, token, "below a mark already seen"));
    }

    // Take our place before the compare-and-set, so that a higher token committed after ours
    // cannot lose track of us (see `ordering`).
    let ticket = fence.order.enter(&account);
    match fence
        .check(&request, started, &span)
        .await
        .map_err(FenceUnavailable)?
    {
        Verdict::Stale => {
            span.record("verdict", "stale");
            fence.cache.raise_past(&account, token);
            Err(fence.fenced_out(account, token, "below the mark"))
        }
        Verdict::Accepted { recorded } => {
            span.record("verdict", "accepted");
            fence.cache.raise(&account, token.get());
            if let Some(key) = request.idempotency.as_mut() {
                key.recorded = recorded;
            }
            // From here a request that created an idempotency record must end with that
            // record either forwarded or removed, even if its client goes away: it runs in a
            // task of its own, which a dropped connection does not cancel.
            let owner = request
                .idempotency
                .as_ref()
                .filter(|k| k.recorded)
                .map(|k| k.owner.clone());
            let proceed = admit_and_forward(fence.clone(), inner, request, ticket, account, token);
            match owner {
                None => proceed.await,
                Some(owner) => {
                    let store = fence.store.clone();
                    let task = tokio::spawn(
                        async move {
                            let result = proceed.await;
                            if let Err(e) = &result
                                && e.downcast_ref::<NotSent>().is_some()
                            {
                                store.forget_unsent(vec![owner]);
                            }
                            result
                        }
                        .instrument(tracing::Span::current()),
                    );
                    task.await.unwrap_or_else(|e| Err(e.into()))
                }
            }
            .map_err(|e| match e.downcast::<NotSent>() {
                Ok(not_sent) => not_sent.0,
                Err(e) => e,
            })
        }
    }
}

/// An error of a request that never left for the rail (its record may be removed).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct NotSent(BoxError);

async fn admit_and_forward<S>(
    fence: Arc<Fence>,
    mut inner: S,
    request: FencedRequest,
    mut ticket: super::ordering::Ticket,
    account: AccountId,
    token: FencingToken,
) -> Result<ProxyResponse, BoxError>
where
    S: Service<FencedRequest, Response = ProxyResponse, Error = BoxError>,
{
    match tokio::time::timeout_at(request.deadline, ticket.admit(token)).await {
        Ok(Ok(())) => {}
        Ok(Err(_superseded)) => {
            fence.cache.raise_past(&account, token);
            let error = fence.fenced_out(account, token, "a higher token was admitted meanwhile");
            return Err(NotSent(error).into());
        }
        Err(_) => {
            let error: BoxError = super::forward::UpstreamTimeout::waiting_for_turn().into();
            return Err(NotSent(error).into());
        }
    }
    // The last look: has another railguard accepted a higher token for this account since our
    // compare-and-set? Then ours must not reach the rail after it.
    match tokio::time::timeout_at(request.deadline, fence.store.current_mark(&account)).await {
        Ok(Ok(mark)) if mark > token.get() => {
            fence.cache.raise(&account, mark);
            tracing::warn!(lock.token = token.get(), account = %account, mark,
                "a token superseded in the database after its compare-and-set (another \
                 railguard accepted a newer grant) was refused before its forward started");
            let error = fence.fenced_out(account, token, "superseded before its forward started");
            return Err(NotSent(error).into());
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(NotSent(FenceUnavailable(e).into()).into()),
        Err(_) => {
            let error: BoxError = super::forward::UpstreamTimeout::waiting_for_turn().into();
            return Err(NotSent(error).into());
        }
    }
    // The ticket is held until the rail has answered: only then may a higher token for this
    // account start its forward.
    let response = inner.call(request).await;
    drop(ticket);
    response
}

async fn observe_only<S>(
    fence: Arc<Fence>,
    mut inner: S,
    mut request: FencedRequest,
    span: tracing::Span,
) -> Result<ProxyResponse, BoxError>
where
    S: Service<FencedRequest, Response = ProxyResponse, Error = BoxError>,
{
    let (token, account) = (request.token, request.account.clone());
    let verdict = fence.check(&request, Instant::now(), &span).await;
    match verdict {
        Ok(Verdict::Accepted { recorded }) => {
            span.record("verdict", "accepted");
            if let Some(key) = request.idempotency.as_mut() {
                key.recorded = recorded;
            }
        }
        Ok(Verdict::Stale) => {
            span.record("verdict", "stale_forwarded");
            fence.metrics.would_have_fenced.inc();
            tracing::warn!(lock.token = token.get(), account = %account,
                "FENCING IS OFF: forwarding a stale token that would have been fenced out");
            // No record was made for it: forward it as if it had no key.
            request.idempotency = None;
        }
        Err(e) => {
            span.record("verdict", "unknown");
            tracing::warn!(lock.token = token.get(), account = %account, error = %e,
                "FENCING IS OFF: forwarding without a fence check");
            request.idempotency = None;
        }
    }
    inner.call(request).await
}

/// The record a request creates with its compare-and-set. It is in doubt, unless completed,
/// once the request's own deadline and the time to store its outcome have passed.
fn new_record(request: &FencedRequest, database_timeout: std::time::Duration) -> Option<NewRecord> {
    let remaining = request.deadline.saturating_duration_since(Instant::now());
    request.idempotency.as_ref().map(|k| NewRecord {
        key: k.key.clone(),
        fingerprint: k.fingerprint.clone(),
        owner: k.owner.clone(),
        in_doubt_after: remaining + database_timeout + std::time::Duration::from_secs(1),
    })
}
