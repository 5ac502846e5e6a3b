//! Idempotency keys at the proxy (C3 §3.1), below the fence and above the forward.
//!
//! The fence's compare-and-set has already tried to create the request's record, in the same
//! commit. So by the time a request gets here:
//! - it carries no key: it passes through;
//! - its record was created: the request's admission (`proxy::admission`) carries the
//!   [`RecordGuard`] that owns the record ([`record`] says how a record ends). It is the first, and is forwarded; the rail's
//!   response is stored before it is returned (group-committed, without waiting for the WAL
//!   flush: `outcomes`) — or, if the database cannot take it now, as soon as it can. A forward that fails drops the guard, which removes the record if the
//!   rail cannot have seen the request and declares it in doubt otherwise; an answer that
//!   still comes, while the forward holds the connection past the deadline, completes the
//!   record all the same ([`LateAnswer`], which the request carries to the forward);
//! - its record already existed: it is a repeat, and never reaches the rail. The same key with
//!   a different request is 422; a repeat while the first is in flight is 409 `in_flight`; a
//!   record in doubt is 409 `in_doubt` (see [`crate::store::records`]); a completed one is replayed, marked
//!   `Idempotency-Replayed: true` (`replay`).
//!
//! With `[rail_lookup]` configured, a repeat of a record in doubt asks the rail first
//! ([`resolve`]): the rail's answer is replayed when it has the payment, and the record is
//! forgotten when it has not and `idempotency-forget` would forget it without an operator's word.
//!
//! Where the records live is behind [`Records`], so that this layer's logic is unit-tested with
//! records in memory; the server's are PostgreSQL's ([`IdempotencyStore`](crate::store::records::IdempotencyStore)).

mod key;
mod late;
pub mod record;
mod replay;
pub mod resolve;

use std::future::Future;
use std::sync::Arc;

use tower::Layer;

pub use self::key::{fingerprint, new_owner, parse_key};
pub use self::late::LateAnswer;
pub use self::record::{MaybeSent, RecordGuard};
#[cfg(test)]
pub(crate) use self::replay::BODY_OMITTED;
pub(crate) use self::replay::REPLAYED;
pub use self::resolve::{AskTheRail, Resolved, Resolver};
use crate::store::records::{Record, RecordState, Records};

use super::admission::{Admitted, Keyed};
use super::forward::{Sent, UpstreamTimeout};
use super::{BoxError, FencedRequest, ProxyResponse, Step};
use crate::db::DbError;

/// A repeat that must not be forwarded.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyConflict {
    #[error("a request with this idempotency key is still in flight; retry later")]
    InFlight,
    #[error(
        "a request with this idempotency key was forwarded, and its forward ended without the \
         rail's answer (a timeout, a broken connection, or a proxy that stopped): whether the \
         rail acted is unknown, so it will not be forwarded again. An operator resolves it with \
         the in-doubt procedure (`railguard idempotency-forget --help`): the rail is asked about \
         this idempotency key only once the railguard that sent it has stopped and nothing it \
         sent can still arrive"
    )]
    InDoubt,
    #[error("this idempotency key was used for a different request (method, path or body)")]
    Mismatch,
    #[error(
        "the request with this idempotency key was in doubt; the rail has no payment with this \
         key, and nothing railguard sent can still reach it, so its record is forgotten. This \
         request was not forwarded: send it again, and it will be"
    )]
    NotOnTheRail,
    #[error(
        "this idempotency key was first sent under a grant from before the fencing store last \
         went back (a failover, a restore), and its record did not survive it: whether the rail \
         acted on the first attempt is unknown, so it will not be forwarded again. With the \
         rail's lookup configured, a retry once nothing sent before the change can still reach \
         the rail is forwarded if the rail has no payment under the key; otherwise see \
         docs/operations.md, \"When a store goes back\""
    )]
    FirstAttemptLost,
    #[error(
        "this idempotency key was first sent under a grant from before the fencing store last \
         went back, and its record did not survive it; the rail, asked by this key once nothing \
         sent before the change could still reach it, has a payment under it: the first attempt \
         was paid. This request will not be forwarded; take the payment's outcome from the rail"
    )]
    FirstAttemptOnTheRail,
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
    resolver: Option<Arc<Resolver>>,
}

impl IdempotencyLayer {
    pub fn new(records: Arc<dyn Records>, config: IdempotencyConfig) -> Self {
        Self {
            records,
            config: Arc::new(config),
            resolver: None,
        }
    }

    /// Repeats of a record in doubt ask the rail first ([`resolve`]).
    pub fn resolving_with(mut self, resolver: Option<Arc<Resolver>>) -> Self {
        self.resolver = resolver;
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            records: self.records.clone(),
            config: self.config.clone(),
            resolver: self.resolver.clone(),
        }
    }
}

/// Forwards a request's first use of its key, replays or refuses the repeats.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    records: Arc<dyn Records>,
    config: Arc<IdempotencyConfig>,
    resolver: Option<Arc<Resolver>>,
}

impl<S> Step<Admitted> for Idempotency<S>
where
    S: Step<Admitted>,
{
    fn handle(
        &self,
        admitted: Admitted,
    ) -> impl Future<Output = Result<ProxyResponse, BoxError>> + Send {
        let (inner, records, config) = (&self.inner, &self.records, &self.config);
        let resolver = self.resolver.as_deref();
        async move {
            let Admitted {
                mut request,
                mut admission,
            } = admitted;
            let key = match (&request.idempotency, admission.keyed) {
                (Some(key), Keyed::AsItsKeySays) => key,
                _ => return inner.handle(Admitted { request, admission }).await,
            };
            let Some(record) = admission.record.take() else {
                let (fingerprint, key) = (key.fingerprint.clone(), key.key.clone());
                // Boxed: a repeat is the rare path, and its future would otherwise make every
                // keyed request's larger.
                return Box::pin(repeat(&**records, resolver, &request, &fingerprint, &key)).await;
            };
            // The request's timer goes down with it to the forward; the answer's body is read
            // within the same instant by a timer of its own.
            let deadline = request.deadline.instant();
            // Should the rail answer after the deadline, the forward hands the answer here.
            request.request.extensions_mut().insert(LateAnswer::new(
                records.clone(),
                record.id().clone(),
                config.max_response_bytes,
            ));
            // A failure drops `record`: forgotten if the rail cannot have seen the request, in
            // doubt if it may have.
            let response = inner.handle(Admitted { request, admission }).await?;
            // The rail has answered; its body must arrive within the deadline too, or the
            // client is told the outcome is unknown (504). The body is still read, and stored
            // as the record's answer once it has come (a repeat meanwhile: `in_flight`, then
            // `in_doubt` past the owner's deadline).
            let mut capture = Box::pin(replay::capture(response, config.max_response_bytes));
            match tokio::time::timeout_at(deadline, &mut capture).await {
                Ok(captured) => {
                    let (response, stored) = captured?;
                    record.complete(stored).await;
                    Ok(response)
                }
                Err(_) => {
                    tokio::spawn(async move {
                        // A body that breaks off drops `record`: in doubt.
                        if let Ok((_, stored)) = capture.await {
                            record.complete(stored).await;
                        }
                    });
                    Err(UpstreamTimeout::no_answer(Sent::Maybe).into())
                }
            }
        }
    }
}

/// A keyed request the fence refused may be a retry of one it let through before its grant was
/// superseded (or the store went back): that request's answer is its own, and fencing refuses
/// new payments of a superseded grant, not the replay of one it accepted. So a refusal looks
/// for the request's record first: made under this very token, it answers as any repeat would
/// (the stored answer, `in_flight`, `in_doubt`, or 422 for another request under the same key).
/// No record, or one made under another grant's token: `None`, and the refusal stands — a stale
/// grant never receives another grant's answer. A record that cannot be read leaves the refusal
/// standing too.
pub async fn own_answer(
    records: &dyn Records,
    request: &FencedRequest,
) -> Option<Result<ProxyResponse, BoxError>> {
    let key = request.idempotency.as_ref()?;
    let record = records.find(&request.account, &key.key).await.ok()??;
    if record.token != request.token.get() {
        return None;
    }
    Some(answer_repeat(record, &key.fingerprint))
}

/// A retry whose key was first sent before the store last went back, and whose record is not
/// there now, may be a payment the rail already has: `Ok(true)` then, and the fence answers it
/// `409 in_doubt` ([`IdempotencyConflict::FirstAttemptLost`]) — unless, with `[rail_lookup]`,
/// the rail says it has no payment under the key once nothing sent before the change can still
/// reach it ([`Resolver::ask_about_lost`]). `Ok(false)`: go on (no key or no first token, one
/// from after the floor, a record that survived — the repeat's own answer comes from it). A
/// store that cannot answer refuses the request: nothing is forwarded on a guess.
pub async fn lost_first_attempt(
    records: &dyn Records,
    request: &FencedRequest,
) -> Result<bool, BoxError> {
    let Some(key) = request.idempotency.as_ref() else {
        return Ok(false);
    };
    let Some(first) = key.first_token else {
        return Ok(false);
    };
    records
        .first_attempt_lost(&request.account, &key.key, first.get())
        .await
        .map_err(|e| IdempotencyUnavailable(e).into())
}

/// A repeat of a key whose record already exists. One in doubt asks the rail first, with a
/// lookup configured ([`resolve`]).
async fn repeat(
    records: &dyn Records,
    resolver: Option<&Resolver>,
    request: &FencedRequest,
    fingerprint: &str,
    key: &str,
) -> Result<ProxyResponse, BoxError> {
    let find = || async {
        records
            .find(&request.account, key)
            .await
            .map_err(IdempotencyUnavailable)
    };
    let record = find().await?;
    // Gone since the compare-and-set saw it (retention, or an operator): ask for a retry
    // rather than forward on a guess.
    let Some(record) = record else {
        return Err(IdempotencyConflict::InFlight.into());
    };
    // The rail is asked about the key whichever request under it asks: what it answers is the
    // record's outcome. Its answer is replayed only to the same request; another one under the
    // key is still 422.
    if let Some(resolver) = resolver
        && record.state == RecordState::InDoubt
    {
        match resolver
            .resolve(records, &request.account, key, request.deadline.instant())
            .await
        {
            Resolved::Paid(_) if record.fingerprint != fingerprint => {
                return Err(IdempotencyConflict::Mismatch.into());
            }
            Resolved::Paid(stored) => return Ok(replay::replay(stored)),
            Resolved::Forgotten => return Err(IdempotencyConflict::NotOnTheRail.into()),
            Resolved::InDoubt => {}
            Resolved::Changed => {
                let Some(record) = find().await? else {
                    return Err(IdempotencyConflict::InFlight.into());
                };
                return answer_repeat(record, fingerprint);
            }
        }
    }
    answer_repeat(record, fingerprint)
}

fn answer_repeat(record: Record, fingerprint: &str) -> Result<ProxyResponse, BoxError> {
    if record.fingerprint != fingerprint {
        return Err(IdempotencyConflict::Mismatch.into());
    }
    match record.state {
        RecordState::InDoubt => Err(IdempotencyConflict::InDoubt.into()),
        RecordState::InFlight => Err(IdempotencyConflict::InFlight.into()),
        RecordState::Done(stored) => Ok(replay::replay(stored)),
    }
}

#[cfg(test)]
mod tests {
    //! The layer with records in memory and a function for a rail.

    use std::time::Duration;

    use bytes::Bytes;
    use tokio::time::Instant;

    use super::record::tests::{Ended, MemoryRecords, record_id};
    use super::*;
    use crate::proxy::{Admission, Deadline, IdempotencyKey, StepFn};
    use crate::store::records::StoredResponse;
    use crate::token::{AccountId, FencingToken};

    /// A first request with key `pay-1` that owns its record, and the flag its forward sets.
    fn first(records: &Arc<MemoryRecords>) -> Admitted {
        let mut admitted = repeat_of("f");
        let sent = admitted.admission.sent.clone();
        admitted.admission.record = Some(RecordGuard::new(records.clone(), record_id(), sent));
        admitted
    }

    fn repeat_of(fingerprint: &str) -> Admitted {
        let request = FencedRequest {
            token: FencingToken::new(3).unwrap(),
            account: AccountId::parse("acct-1", 64).unwrap(),
            request: Box::new(http::Request::new(Bytes::from_static(b"{}"))),
            deadline: Deadline::at(Instant::now() + Duration::from_secs(5)),
            idempotency: Some(IdempotencyKey {
                first_token: None,
                key: "pay-1".into(),
                fingerprint: fingerprint.into(),
                owner: "owner-1".into(),
            }),
        };
        Admitted {
            request,
            admission: Admission::default(),
        }
    }

    fn layer(records: &Arc<MemoryRecords>) -> IdempotencyLayer {
        IdempotencyLayer::new(
            records.clone(),
            IdempotencyConfig {
                max_response_bytes: 1024,
            },
        )
    }

    #[tokio::test]
    async fn an_answered_first_request_completes_its_record() {
        let records = Arc::new(MemoryRecords::default());
        let rail = StepFn(|admitted: Admitted| async move {
            admitted.admission.sent.set();
            let mut response = ProxyResponse::new(crate::http::full("paid"));
            *response.status_mut() = http::StatusCode::CREATED;
            Ok::<_, BoxError>(response)
        });
        let response = layer(&records)
            .layer(rail)
            .handle(first(&records))
            .await
            .unwrap();
        assert_eq!(response.status(), http::StatusCode::CREATED);
        assert_eq!(records.ended(), [Ended::Completed(record_id(), 201)]);
    }

    /// The rail's head came in time and its body after the deadline: the client is told the
    /// outcome is unknown (504), and the body is still read and stored as the record's answer.
    #[tokio::test(start_paused = true)]
    async fn an_answer_whose_body_comes_after_the_deadline_still_completes_its_record() {
        use http_body_util::{BodyExt, StreamBody};

        let records = Arc::new(MemoryRecords::default());
        let rail = StepFn(|admitted: Admitted| async move {
            admitted.admission.sent.set();
            let body = futures_util::stream::once(async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, BoxError>(hyper::body::Frame::data(Bytes::from_static(b"paid")))
            });
            let mut response = ProxyResponse::new(StreamBody::new(body).boxed_unsync());
            *response.status_mut() = http::StatusCode::CREATED;
            Ok::<_, BoxError>(response)
        });
        let mut request = first(&records);
        request.request.deadline = Deadline::at(Instant::now() + Duration::from_millis(100));
        let error = layer(&records)
            .layer(rail)
            .handle(request)
            .await
            .unwrap_err();
        assert!(error.downcast_ref::<UpstreamTimeout>().is_some(), "{error}");
        assert!(records.ended().is_empty(), "the body is still coming");
        // The paused clock moves on to the body's arrival once everything else waits.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(records.ended(), [Ended::Completed(record_id(), 201)]);
    }

    #[tokio::test]
    async fn a_forward_that_failed_before_sending_forgets_the_record() {
        let records = Arc::new(MemoryRecords::default());
        let rail = StepFn(|_admitted: Admitted| async {
            Err::<ProxyResponse, BoxError>("connection refused".into())
        });
        let result = layer(&records).layer(rail).handle(first(&records)).await;
        assert!(result.is_err());
        assert_eq!(records.ended(), [Ended::Forgotten(record_id())]);
    }

    #[tokio::test]
    async fn a_forward_that_failed_after_sending_leaves_the_record_in_doubt() {
        let records = Arc::new(MemoryRecords::default());
        let rail = StepFn(|admitted: Admitted| async move {
            admitted.admission.sent.set();
            Err::<ProxyResponse, BoxError>("connection reset".into())
        });
        let result = layer(&records).layer(rail).handle(first(&records)).await;
        assert!(result.is_err());
        assert_eq!(records.ended(), [Ended::InDoubt(record_id())]);
    }

    #[tokio::test]
    async fn repeats_never_reach_the_rail() {
        let records = Arc::new(MemoryRecords::default());
        let rail = StepFn(|_admitted: Admitted| async {
            panic!("a repeat reached the rail");
            #[allow(unreachable_code)]
            Ok::<ProxyResponse, BoxError>(ProxyResponse::new(crate::http::full("")))
        });
        let service = layer(&records).layer(rail);
        *records.found.lock().unwrap() = Some(Record {
            fingerprint: "f".into(),
            token: 3,
            state: RecordState::Done(StoredResponse {
                status: 201,
                headers: vec![],
                body: Some(Bytes::from_static(b"paid")),
            }),
        });
        let replayed = service.handle(repeat_of("f")).await.unwrap();
        assert_eq!(replayed.status(), http::StatusCode::CREATED);
        assert_eq!(replayed.headers()["idempotency-replayed"], "true");
        let mismatch = service.handle(repeat_of("g")).await.unwrap_err();
        assert!(matches!(
            mismatch.downcast_ref::<IdempotencyConflict>(),
            Some(IdempotencyConflict::Mismatch)
        ));
        for (state, want) in [
            (RecordState::InFlight, "InFlight"),
            (RecordState::InDoubt, "InDoubt"),
        ] {
            *records.found.lock().unwrap() = Some(Record {
                fingerprint: "f".into(),
                token: 3,
                state,
            });
            let error = service.handle(repeat_of("f")).await.unwrap_err();
            let conflict = error.downcast_ref::<IdempotencyConflict>().unwrap();
            assert_eq!(format!("{conflict:?}"), want);
        }
        assert!(records.ended().is_empty());
    }
}
