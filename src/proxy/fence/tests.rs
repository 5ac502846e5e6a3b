//! The fence layer with marks in memory and a function for a rail: its decisions, not
//! PostgreSQL's (the end-to-end tests in `tests/proxy/forward.rs` run it on real PostgreSQL).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::proxy::idempotency::record::tests::{Ended, MemoryRecords};
use crate::proxy::{Deadline, IdempotencyKey, StepFn};
use crate::store::records::RecordId;

/// Marks in memory: `>=` accepts and raises, `<` is stale; `current_mark` may be told to
/// report a higher mark, as if another railguard had accepted a newer grant.
#[derive(Default)]
struct MemoryMarks {
    marks: Mutex<HashMap<String, i64>>,
    elsewhere: Mutex<Option<i64>>,
    records: Arc<MemoryRecords>,
}

impl HighWater for Arc<MemoryMarks> {
    async fn advance(
        &self,
        account: &AccountId,
        token: FencingToken,
        record: Option<NewRecord>,
    ) -> Result<Verdict, StoreError> {
        let mut marks = self.marks.lock().unwrap();
        let mark = marks.entry(account.to_string()).or_insert(0);
        if token.get() < *mark {
            return Ok(Verdict::Stale);
        }
        *mark = token.get();
        let records: Arc<dyn crate::store::records::Records> = self.records.clone();
        Ok(Verdict::Accepted {
            record: record.map(|r| {
                let id = RecordId {
                    account: account.clone(),
                    key: r.key,
                    owner: r.owner,
                };
                crate::store::records::Created::new(records, id)
            }),
            entry: None,
            foreign: Foreign::default(),
        })
    }

    async fn current_mark(&self, account: &AccountId) -> Result<i64, StoreError> {
        let own = self.marks.lock().unwrap().get(account.as_str()).copied();
        Ok(self.elsewhere.lock().unwrap().or(own).unwrap_or(0))
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }
}

fn request(token: i64, key: Option<&str>) -> FencedRequest {
    FencedRequest {
        token: FencingToken::new(token).unwrap(),
        account: AccountId::parse("acct-1", 64).unwrap(),
        request: Box::new(http::Request::new(Bytes::from_static(b"{}"))),
        deadline: Deadline::at(Instant::now() + Duration::from_secs(5)),
        idempotency: key.map(|k| IdempotencyKey {
            first_token: None,
            key: k.into(),
            fingerprint: "f".into(),
            owner: "owner-1".into(),
        }),
    }
}

/// A fence over `marks` in front of a rail that counts what reached it.
fn fence(
    marks: &Arc<MemoryMarks>,
    enforce: bool,
    forwarded: &Arc<AtomicUsize>,
) -> impl Step<FencedRequest> {
    let point = Arc::new(FencePoint::new(
        marks.clone(),
        100,
        Arc::new(Metrics::new()),
        enforce,
    ));
    let forwarded = forwarded.clone();
    FenceLayer::new(point).layer(StepFn(move |_admitted: Admitted| {
        forwarded.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxError>(ProxyResponse::new(crate::http::full("ok"))) }
    }))
}

#[tokio::test]
async fn a_current_token_is_forwarded_and_raises_the_mark() {
    let marks = Arc::new(MemoryMarks::default());
    let forwarded = Arc::new(AtomicUsize::new(0));
    fence(&marks, true, &forwarded)
        .handle(request(7, None))
        .await
        .unwrap();
    assert_eq!(forwarded.load(Ordering::SeqCst), 1);
    assert_eq!(marks.marks.lock().unwrap()["acct-1"], 7);
}

#[tokio::test]
async fn a_stale_token_is_fenced_out_and_never_reaches_the_rail() {
    let marks = Arc::new(MemoryMarks::default());
    marks.marks.lock().unwrap().insert("acct-1".into(), 9);
    let forwarded = Arc::new(AtomicUsize::new(0));
    let error = fence(&marks, true, &forwarded)
        .handle(request(8, Some("pay-1")))
        .await
        .unwrap_err();
    assert!(error.downcast_ref::<FencedOut>().is_some(), "{error}");
    assert_eq!(forwarded.load(Ordering::SeqCst), 0);
    assert_eq!(
        marks.marks.lock().unwrap()["acct-1"],
        9,
        "the mark never goes down"
    );
    assert!(marks.records.ended().is_empty(), "no record was made");
}

/// A fence whose rail holds the first request it gets until `release` is notified, and
/// counts what reached it.
fn fence_with_held_rail(
    marks: &Arc<MemoryMarks>,
    forwarded: &Arc<AtomicUsize>,
    release: &Arc<tokio::sync::Notify>,
) -> Arc<impl Step<FencedRequest>> {
    let point = Arc::new(FencePoint::new(
        marks.clone(),
        100,
        Arc::new(Metrics::new()),
        true,
    ));
    let (forwarded, release) = (forwarded.clone(), release.clone());
    Arc::new(
        FenceLayer::new(point).layer(StepFn(move |admitted: Admitted| {
            let n = forwarded.fetch_add(1, Ordering::SeqCst);
            let release = release.clone();
            async move {
                // The request holds its account's turn until the rail has answered.
                let _turn = admitted.admission.turn;
                if n == 0 {
                    release.notified().await;
                }
                Ok::<_, BoxError>(ProxyResponse::new(crate::http::full("ok")))
            }
        })),
    )
}

#[tokio::test]
async fn a_token_superseded_elsewhere_while_it_waited_is_refused_and_its_record_forgotten() {
    let marks = Arc::new(MemoryMarks::default());
    let forwarded = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let service = fence_with_held_rail(&marks, &forwarded, &release);
    // 9's forward is held at the rail; 10 passes its compare-and-set and waits its turn.
    let first = tokio::spawn({
        let service = service.clone();
        async move { service.handle(request(9, None)).await }
    });
    while forwarded.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let second = tokio::spawn({
        let service = service.clone();
        async move { service.handle(request(10, Some("pay-1"))).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Meanwhile another railguard accepts 12.
    *marks.elsewhere.lock().unwrap() = Some(12);
    release.notify_one();
    first.await.unwrap().unwrap();
    let error = second.await.unwrap().unwrap_err();
    assert!(error.downcast_ref::<FencedOut>().is_some(), "{error}");
    assert_eq!(
        forwarded.load(Ordering::SeqCst),
        1,
        "10 never reached the rail"
    );
    let ended = marks.records.ended();
    assert!(
        matches!(ended.as_slice(), [Ended::Forgotten(id)] if id.key == "pay-1"),
        "{ended:?}"
    );
}

#[tokio::test]
async fn a_token_superseded_elsewhere_is_refused_even_when_it_did_not_wait() {
    let marks = Arc::new(MemoryMarks::default());
    // Another railguard accepted 12 after this request's compare-and-set committed, and
    // before its verdict reached it: nothing made it wait in this process.
    *marks.elsewhere.lock().unwrap() = Some(12);
    let forwarded = Arc::new(AtomicUsize::new(0));
    let error = fence(&marks, true, &forwarded)
        .handle(request(10, Some("pay-1")))
        .await
        .unwrap_err();
    assert!(error.downcast_ref::<FencedOut>().is_some(), "{error}");
    assert_eq!(forwarded.load(Ordering::SeqCst), 0);
    let ended = marks.records.ended();
    assert!(
        matches!(ended.as_slice(), [Ended::Forgotten(id)] if id.key == "pay-1"),
        "{ended:?}"
    );
}

#[tokio::test]
async fn with_the_kill_switch_a_stale_token_is_forwarded_without_its_key() {
    let marks = Arc::new(MemoryMarks::default());
    marks.marks.lock().unwrap().insert("acct-1".into(), 9);
    let forwarded = Arc::new(AtomicUsize::new(0));
    fence(&marks, false, &forwarded)
        .handle(request(8, Some("pay-1")))
        .await
        .unwrap();
    assert_eq!(forwarded.load(Ordering::SeqCst), 1);
    assert!(marks.records.ended().is_empty());
}
