//! The rail proxy: a tower stack on hyper that forwards a request to the rail only when its
//! fencing token passes the account's high-water mark.
//!
//! Request lifecycle, outermost first:
//!
//! | step | job | refuses with |
//! |---|---|---|
//! | [`respond`] | sets `x-request-id` if absent, echoes it on the response; the request span (`lock.token` and `account` are recorded on it); error → the one response for it; outcome metrics | |
//! | [`extract`] | deadline starts; caller ([`authorize`]); token + account headers; body read whole | 401, 403, 400, 413, 408 |
//! | [`fence`] | cache fast path; compare-and-set (+ idempotency record); per-account order; hands the request down with its [`Admission`] | 409, 503 |
//! | [`idempotency`] | forward a first request and store its answer; replay or refuse repeats | 409, 422 |
//! | [`forward`] | to the rail over pooled HTTP/1.1 | 502, 504 |
//!
//! ## A payment's path
//!
//! `http → proxy → store → proxy → http`, each step in one place:
//!
//! 1. **http**: `http::serve` accepts the connection and `http::connection` serves it (limits,
//!    TLS, the drain at shutdown), handing each request to [`stack`].
//! 2. **proxy**: the request id and span; [`extract`] reads the caller, token, account,
//!    idempotency key and body and starts the deadline; [`authorize`] checks the caller may
//!    use the account; [`fence`] refuses a token below a mark this process already knows and
//!    takes the request's place in the account's order.
//! 3. **store**: [`crate::store::marks`] runs the compare-and-set, creating the idempotency
//!    record in the same durable commit, grouped with other requests' by
//!    [`crate::store::batch`]. Back come plain values: a [`Verdict`](crate::store::marks::Verdict) holding the
//!    created record and the forward's entry among the account's forwarders.
//! 4. **proxy**: [`fence`] adopts the record into the request's [`Admission`] — the one value
//!    that owns the record, the send state and the account's turn until the forward ends —
//!    waits for the turn, asks the store for the mark once more (the last look, grouped by the
//!    same batcher) and lets the request go; [`idempotency`] replays or refuses a repeat; [`forward`] sends a first request to the
//!    rail; the rail's answer is handed to the store for the key's record (a completion,
//!    grouped by the same batcher) and [`respond`] makes the response.
//! 5. **http**: hyper writes the response.
//!
//! Calls go one way. The proxy asks the store with plain values — an account, a token, a record
//! id, a response's status, headers and body — and gets plain values back; nothing under
//! `store`, `db`, `http` or `lock` names a proxy type.

pub mod admission;
pub mod authorize;
pub mod error;
pub mod extract;
pub mod fence;
pub mod forward;
pub mod idempotency;
pub mod respond;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use tokio::time::Instant;
use tower::ServiceBuilder;

use crate::token::{AccountId, FencingToken};

pub use self::admission::{Admission, Admitted};
pub use crate::http::{BoxError, ResponseBody, full};

/// What every layer of the proxy answers with.
pub type ProxyResponse = Response<ResponseBody>;

/// One step of a request's way through the proxy ([`extract`], [`fence`], [`idempotency`],
/// [`forward`]), handed the request by the step above it.
///
/// A step is shared, not owned: it answers through `&self`, so a request's way down is one
/// future, which [`respond`] boxes once. A tower `Service` answers with a future that owns what
/// it needs, so each layer would box its own future and clone every layer below it for each
/// request — work that a step, always ready and never changed by a request, does not need.
pub trait Step<Request>: Send + Sync + 'static {
    fn handle(
        &self,
        request: Request,
    ) -> impl std::future::Future<Output = Result<ProxyResponse, BoxError>> + Send;
}

/// A step made of a function: what tests put below the step they check.
#[cfg(test)]
pub struct StepFn<F>(pub F);

#[cfg(test)]
impl<F, R, Fut> Step<R> for StepFn<F>
where
    F: Fn(R) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<ProxyResponse, BoxError>> + Send,
{
    fn handle(
        &self,
        request: R,
    ) -> impl std::future::Future<Output = Result<ProxyResponse, BoxError>> + Send {
        (self.0)(request)
    }
}

/// A request whose token and account were read and whose body was read whole. Below the fence
/// it travels with what the fence let it through with ([`Admitted`]).
pub struct FencedRequest {
    pub token: FencingToken,
    pub account: AccountId,
    /// Boxed: every step's future holds the request, some twice (what it was given and what
    /// it took apart), and each is moved into the step above's; a pointer keeps those futures
    /// kilobytes smaller and their moves short.
    pub request: Box<Request<Bytes>>,
    /// When the request's time is up, whatever phase it is in, and the one timer that
    /// watches it.
    pub deadline: Deadline,
    /// The request's idempotency key, if it has one.
    pub idempotency: Option<IdempotencyKey>,
}

/// When a request's time is up, and the one timer that watches it from the body's read to the
/// rail's answer: each phase that waits is bounded by [`Deadline::bound`], which polls the same
/// timer, so a request registers one timer with the runtime, not one a phase. It travels with
/// the request by value (it is the request's, never shared).
pub struct Deadline {
    at: Instant,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
}

/// The request's deadline passed while a phase waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadlinePassed;

impl Deadline {
    /// A deadline at `at`. Its timer is registered when a phase first waits on it.
    pub fn at(at: Instant) -> Self {
        Self {
            at,
            timer: Box::pin(tokio::time::sleep_until(at)),
        }
    }

    /// The instant itself, for what bounds its own waits (the store's).
    pub fn instant(&self) -> Instant {
        self.at
    }

    /// `work`'s output, or [`DeadlinePassed`] once the deadline has passed first. `work` is
    /// polled before the timer, as `tokio::time::timeout_at` does.
    pub async fn bound<F: std::future::Future>(
        &mut self,
        work: F,
    ) -> Result<F::Output, DeadlinePassed> {
        let timer = self.timer.as_mut();
        tokio::select! {
            biased;
            out = work => Ok(out),
            () = timer => Err(DeadlinePassed),
        }
    }
}

impl std::fmt::Debug for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Deadline").field(&self.at).finish()
    }
}

/// An idempotency key and what the fence did with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    pub key: String,
    /// Of method, path and query, and body: see `idempotency::fingerprint`.
    pub fingerprint: String,
    /// This request's own random id, stored with the record it creates.
    pub owner: String,
    /// The token this key was first sent under, when the client says (a retry's
    /// `Idempotency-First-Token`).
    pub first_token: Option<FencingToken>,
}

/// Request ids: a per-process random prefix and a counter — unique, cheap, and sortable
/// within a process.
#[derive(Clone)]
pub struct RequestIds {
    prefix: Arc<str>,
    next: Arc<AtomicU64>,
}

impl Default for RequestIds {
    fn default() -> Self {
        use std::hash::{BuildHasher, RandomState};
        let prefix = format!(
            "{:08x}",
            RandomState::new().hash_one(std::process::id()) as u32
        );
        Self {
            prefix: prefix.into(),
            next: Arc::new(AtomicU64::new(1)),
        }
    }
}

impl RequestIds {
    /// The next id: `<prefix>-<n>`.
    pub fn next(&self) -> Option<HeaderValue> {
        use std::fmt::Write as _;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut id = IdText {
            bytes: [0; ID_MAX],
            len: 0,
        };
        write!(id, "{}-{n}", self.prefix).ok()?;
        // One allocation, which the copies sent to the rail and back to the client share.
        HeaderValue::from_maybe_shared(Bytes::from_owner(id)).ok()
    }
}

/// The longest id: an 8-digit prefix, `-`, and a `u64` in decimal.
const ID_MAX: usize = 8 + 1 + 20;

/// A request id's text, held inline until `Bytes` owns it.
struct IdText {
    bytes: [u8; ID_MAX],
    len: usize,
}

impl std::fmt::Write for IdText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        self.bytes
            .get_mut(self.len..end)
            .ok_or(std::fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

impl AsRef<[u8]> for IdText {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Builds the whole proxy stack around `fence` and `forward`.
pub fn stack(
    extract: extract::ExtractLayer,
    fence: fence::FenceLayer,
    idempotency: idempotency::IdempotencyLayer,
    forward: forward::Forward,
    metrics: Arc<crate::metrics::Metrics>,
) -> impl tower::Service<
    Request<hyper::body::Incoming>,
    Response = Response<impl hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    ServiceBuilder::new()
        .layer(respond::RespondLayer::new(metrics))
        .layer(extract)
        .layer(fence)
        .layer(idempotency)
        .service(forward)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn each_phase_is_bounded_by_the_one_deadline_and_work_ready_at_it_wins() {
        let mut deadline = Deadline::at(Instant::now() + Duration::from_secs(5));
        // Work that ends in time gives its output, however many phases ask.
        assert_eq!(deadline.bound(async { 1 }).await, Ok(1));
        let slept = deadline
            .bound(tokio::time::sleep(Duration::from_secs(2)))
            .await;
        assert_eq!(slept, Ok(()));
        // A phase that outlasts it ends at the deadline, not at its own time.
        let started = Instant::now();
        let late = deadline
            .bound(tokio::time::sleep(Duration::from_secs(60)))
            .await;
        assert_eq!(late, Err(DeadlinePassed));
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        // Past it, a phase still waiting is refused at once; one ready is polled first, as
        // `tokio::time::timeout_at` does.
        assert_eq!(
            deadline.bound(std::future::pending::<()>()).await,
            Err(DeadlinePassed)
        );
        assert_eq!(deadline.bound(async { 2 }).await, Ok(2));
        assert_eq!(deadline.instant(), started + Duration::from_secs(3));
    }

    // Ids are the prefix and the counter, each one unique, up to the counter's last value; a
    // clone of one (the rail's copy, the client's) is the same text.
    #[test]
    fn request_ids_count_up_under_the_prefix_to_the_last_counter_value() {
        let ids = RequestIds::default();
        let (first, second) = (ids.next().unwrap(), ids.next().unwrap());
        let prefix = ids.prefix.to_string();
        assert_eq!(first.to_str().unwrap(), format!("{prefix}-1"));
        assert_eq!(second.to_str().unwrap(), format!("{prefix}-2"));
        assert_eq!(first.clone(), first);
        ids.next.store(u64::MAX, Ordering::Relaxed);
        let last = ids.next().unwrap();
        assert_eq!(last.to_str().unwrap(), format!("{prefix}-{}", u64::MAX));
        assert_eq!(last.len(), ID_MAX);
    }
}
