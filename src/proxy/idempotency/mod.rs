//! Idempotency keys at the proxy (C3 §3.1), below the fence and above the forward.
//!
//! The fence's compare-and-set has already tried to create the request's record, in the same
//! commit. So by the time a request gets here:
//! - it carries no key: it passes through;
//! - its record was created: the request carries the [`RecordGuard`] that owns the record
//!   ([`record`] says how a record ends). It is the first, and is forwarded; the rail's
//!   response is stored before it is returned — or, if the database cannot take it now, as
//!   soon as it can. A forward that fails drops the guard, which removes the record if the
//!   rail cannot have seen the request and declares it in doubt otherwise;
//! - its record already existed: it is a repeat, and never reaches the rail. The same key with
//!   a different request is 422; a repeat while the first is in flight is 409 `in_flight`; a
//!   record in doubt is 409 `in_doubt` (see [`store`]); a completed one is replayed, marked
//!   `Idempotency-Replayed: true` (`replay`).
//!
//! Where the records live is behind [`Records`], so that this layer's logic is unit-tested with
//! records in memory; the server's are PostgreSQL's ([`IdempotencyStore`]).

mod instance;
mod key;
pub mod record;
mod replay;
pub mod store;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower::{Layer, Service};

pub use self::instance::{InstanceId, hold_instance_lock};
pub use self::key::{fingerprint, new_owner, parse_key};
pub use self::record::{MaybeSent, NewRecord, RecordGuard, RecordId, Records};
pub use self::store::{
    Forgot, IdempotencyStore, OutcomeMetrics, Record, RecordState, StoredResponse, sweep_forever,
};

use super::forward::{Sent, UpstreamTimeout};
use super::{BoxError, FencedRequest, ProxyResponse};
use crate::db::DbError;

/// A repeat that must not be forwarded.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyConflict {
    #[error("a request with this idempotency key is still in flight; retry later")]
    InFlight,
    #[error(
        "a request with this idempotency key was forwarded, and its forward ended without the \
         rail's answer (a timeout, a broken connection, or a proxy that stopped): whether the \
         rail acted is unknown, so it will not be forwarded again. Ask the rail about this \
         idempotency key; an operator can then run `railguard idempotency-forget`"
    )]
    InDoubt,
    #[error("this idempotency key was used for a different request (method, path or body)")]
    Mismatch,
}

/// The idempotency record could not be read.
#[derive(Debug, thiserror::Error)]
#[error("the idempotency record could not be read: {0}")]
pub struct IdempotencyUnavailable(#[from] pub DbError);

/// Settings of the layer.
#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    pub max_response_bytes: usize,
}

/// Makes [`Idempotency`] services; see the module docs.
#[derive(Clone)]
pub struct IdempotencyLayer {
    records: Arc<dyn Records>,
    config: Arc<IdempotencyConfig>,
}

impl IdempotencyLayer {
    pub fn new(records: Arc<dyn Records>, config: IdempotencyConfig) -> Self {
        Self {
            records,
            config: Arc::new(config),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            records: self.records.clone(),
            config: self.config.clone(),
        }
    }
}

/// Forwards a request's first use of its key, replays or refuses the repeats.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    records: Arc<dyn Records>,
    config: Arc<IdempotencyConfig>,
}

impl<S> Service<FencedRequest> for Idempotency<S>
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

    fn call(&mut self, mut request: FencedRequest) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (records, config) = (self.records.clone(), self.config.clone());
        Box::pin(async move {
            let Some(key) = request.idempotency.as_ref() else {
                return inner.call(request).await;
            };
            let Some(record) = request.record.take() else {
                let (fingerprint, key) = (key.fingerprint.clone(), key.key.clone());
                return repeat(&*records, &request, &fingerprint, &key).await;
            };
            let deadline = request.deadline;
            // A failure drops `record`: forgotten if the rail cannot have seen the request, in
            // doubt if it may have.
            let response = inner.call(request).await?;
            // The rail has answered; its body must arrive within the deadline too, or the
            // record is in doubt (the rail acted, but its answer is not known).
            let (response, stored) = tokio::time::timeout_at(
                deadline,
                replay::capture(response, config.max_response_bytes),
            )
            .await
            .map_err(|_| -> BoxError { UpstreamTimeout::no_answer(Sent::Maybe).into() })??;
            record.complete(stored).await;
            Ok(response)
        })
    }
}

/// A repeat of a key whose record already exists.
async fn repeat(
    records: &dyn Records,
    request: &FencedRequest,
    fingerprint: &str,
    key: &str,
) -> Result<ProxyResponse, BoxError> {
    let record = records
        .find(&request.account, key)
        .await
        .map_err(IdempotencyUnavailable)?;
    // Gone since the compare-and-set saw it (retention, or an operator): ask for a retry
    // rather than forward on a guess.
    let Some(record) = record else {
        return Err(IdempotencyConflict::InFlight.into());
    };
    if record.fingerprint != fingerprint {
        return Err(IdempotencyConflict::Mismatch.into());
    }
    match record.state {
        RecordState::InDoubt => Err(IdempotencyConflict::InDoubt.into()),
        RecordState::InFlight => Err(IdempotencyConflict::InFlight.into()),
        RecordState::Done(stored) => Ok(replay::replay(stored)),
    }
}
