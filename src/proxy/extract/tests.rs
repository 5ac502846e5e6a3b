use super::*;

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use http_body_util::Full;

use crate::proof::ProofKey;
use crate::proxy::StepFn;

#[test]
fn a_first_token_is_a_token_at_most_the_presented_one_and_only_with_a_key() {
    let name = HeaderName::from_static("idempotency-first-token");
    let token = FencingToken::new(7).unwrap();
    let with = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert(name.clone(), value.parse().unwrap());
        headers
    };
    assert_eq!(
        first_token(&HeaderMap::new(), &name, true, token).unwrap(),
        None
    );
    assert_eq!(
        first_token(&with("5"), &name, true, token).unwrap(),
        FencingToken::new(5)
    );
    assert_eq!(
        first_token(&with("7"), &name, true, token).unwrap(),
        Some(token)
    );
    for (value, keyed) in [
        ("8", true),
        ("5", false),
        ("0", true),
        ("x", true),
        ("-1", true),
    ] {
        assert!(
            first_token(&with(value), &name, keyed, token).is_err(),
            "{value} keyed={keyed}"
        );
    }
}

const KEY: [u8; 32] = [7; 32];

fn config(required: bool) -> ExtractConfig {
    ExtractConfig {
        token_header: HeaderName::from_static("fencing-token"),
        account_header: HeaderName::from_static("fencing-account"),
        idempotency_header: HeaderName::from_static("idempotency-key"),
        first_token_header: HeaderName::from_static("idempotency-first-token"),
        proof_header: HeaderName::from_static("fencing-proof"),
        idempotency_required: false,
        max_account_len: 64,
        max_body_bytes: 16,
        request_timeout: Duration::from_secs(5),
        grants: GrantCheck {
            proofs: Arc::new(ProofKey::from_bytes(&KEY)),
            required,
            lock_key_prefix: String::new(),
            lock_key_suffix: String::new(),
            unproven: prometheus::IntCounter::new("u", "u").unwrap(),
            source: Arc::new(IssuedUpTo(1 << 40)),
        },
        auth: None,
        account_in_path: None,
    }
}

/// A token source that has issued every token up to its value.
#[derive(Debug)]
struct IssuedUpTo(i64);

impl crate::lock::guard::IssuedTokens for IssuedUpTo {
    fn issued(
        &self,
        token: i64,
    ) -> Pin<Box<dyn Future<Output = Result<bool, crate::lock::source::SourceError>> + Send + '_>>
    {
        Box::pin(std::future::ready(Ok(token <= self.0)))
    }
}

/// Runs `request` through the layer; returns the error, if any, and what reached the
/// inner service (token, account, idempotency key).
async fn extract(
    config: ExtractConfig,
    request: Request<Full<Bytes>>,
) -> (Option<BoxError>, Option<(i64, String, Option<String>)>) {
    let seen = Arc::new(Mutex::new(None));
    let inner = {
        let seen = seen.clone();
        StepFn(move |r: FencedRequest| {
            *seen.lock().unwrap() = Some((
                r.token.get(),
                r.account.to_string(),
                r.idempotency.map(|k| k.key),
            ));
            async { Ok::<_, BoxError>(ProxyResponse::new(crate::http::full(""))) }
        })
    };
    let error = ExtractLayer::new(config)
        .layer(inner)
        .handle(request)
        .await
        .err();
    let seen = seen.lock().unwrap().take();
    (error, seen)
}

fn payment(token: &str, proof: Option<String>, body: &'static [u8]) -> Request<Full<Bytes>> {
    let mut builder = Request::post("/pay")
        .header("host", "rail")
        .header("fencing-token", token)
        .header("fencing-account", "acct-1")
        .header("idempotency-key", "pay-1");
    if let Some(proof) = proof {
        builder = builder.header("fencing-proof", proof);
    }
    builder.body(Full::new(Bytes::from_static(body))).unwrap()
}

fn proof(token: i64) -> String {
    ProofKey::from_bytes(&KEY).sign("acct-1", FencingToken::new(token).unwrap())
}

#[tokio::test]
async fn a_proven_payment_reaches_the_fence_with_its_token_account_and_key() {
    let (error, seen) = extract(config(true), payment("5", Some(proof(5)), b"{}")).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(seen, Some((5, "acct-1".into(), Some("pay-1".into()))));
}

#[tokio::test]
async fn a_bad_token_header_is_refused_before_the_fence() {
    for token in ["", "0", "-1", "x", "99999999999999999999"] {
        let (error, seen) = extract(config(true), payment(token, Some(proof(5)), b"{}")).await;
        let error = error.expect("refused");
        assert!(
            error.downcast_ref::<BadRequest>().is_some(),
            "{token:?}: {error}"
        );
        assert!(seen.is_none());
    }
}

#[tokio::test]
async fn a_wrong_or_missing_proof_is_refused_and_only_the_switch_lets_a_missing_one_through() {
    let (error, seen) = extract(config(true), payment("6", Some(proof(5)), b"{}")).await;
    assert!(error.unwrap().downcast_ref::<BadProof>().is_some());
    assert!(seen.is_none());
    let (error, _) = extract(config(true), payment("6", None, b"{}")).await;
    assert!(error.unwrap().downcast_ref::<BadProof>().is_some());
    let lenient = config(false);
    let unproven = lenient.grants.unproven.clone();
    let (error, seen) = extract(lenient, payment("6", None, b"{}")).await;
    assert!(error.is_none(), "{error:?}");
    assert!(seen.is_some());
    assert_eq!(unproven.get(), 1);
    let (error, _) = extract(config(false), payment("6", Some(proof(5)), b"{}")).await;
    assert!(
        error.unwrap().downcast_ref::<BadProof>().is_some(),
        "wrong is wrong"
    );
}

#[tokio::test]
async fn an_oversized_body_is_refused_before_the_fence() {
    let body = b"0123456789abcdefXYZ";
    let (error, seen) = extract(config(true), payment("5", Some(proof(5)), body)).await;
    assert!(error.unwrap().downcast_ref::<BodyTooLarge>().is_some());
    assert!(seen.is_none());
}

#[test]
fn single_header_refuses_missing_and_repeated() {
    let name = HeaderName::from_static("fencing-token");
    let mut headers = HeaderMap::new();
    assert_eq!(single_header(&headers, &name), Err(HeaderError::Missing));
    headers.append(&name, "1".parse().unwrap());
    assert_eq!(single_header(&headers, &name), Ok("1"));
    headers.append(&name, "2".parse().unwrap());
    assert_eq!(single_header(&headers, &name), Err(HeaderError::Repeated));
}

/// What a JSON subscriber wrote of the `proxy.request` span's fields, for one event logged
/// after `record` ran inside a span made with `fields` (`true`: the request span's own).
fn recorded_on_the_span(with_the_fields: bool, record: impl FnOnce()) -> serde_json::Value {
    use tracing_subscriber::layer::SubscriberExt as _;
    let buffer = crate::telemetry::LogBuffer::default();
    let out = buffer.clone();
    let layer = tracing_subscriber::fmt::layer()
        .json()
        .with_writer(move || out.clone());
    tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
        let span = if with_the_fields {
            tracing::info_span!(
                "proxy.request",
                lock.token = tracing::field::Empty,
                account = tracing::field::Empty
            )
        } else {
            tracing::info_span!("proxy.request", path = "/payments")
        };
        let _entered = span.enter();
        record();
        tracing::info!("recorded");
    });
    let line = buffer.text();
    let event: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    event["span"].clone()
}

// The request's token and account land on the span it runs in; a span without those fields
// is left as it was, and with no span at all nothing happens.
#[test]
fn the_token_and_account_are_recorded_on_the_request_span() {
    let token = FencingToken::new(41).unwrap();
    let account = AccountId::parse("acct-7", 64).unwrap();
    let span = recorded_on_the_span(true, || record_on_request_span(token, &account));
    assert_eq!(span["lock.token"], 41, "{span}");
    assert_eq!(span["account"], "acct-7", "{span}");

    let other = recorded_on_the_span(false, || record_on_request_span(token, &account));
    assert_eq!(other["path"], "/payments", "{other}");
    assert!(other.get("lock.token").is_none(), "{other}");

    record_on_request_span(token, &account);
}

// With proofs required, an account whose lock key could never be granted is refused for what
// it is (no grant, so no proof, could ever be made); without them it goes on to the source's
// check like any other.
#[test]
fn an_account_whose_lock_key_cannot_be_granted_is_refused_only_with_proofs_required() {
    let header = HeaderName::from_static("fencing-account");
    let odd = AccountId::parse("acct/1", 64).unwrap();
    let refused = config(true).grants.grantable(&header, &odd).unwrap_err();
    let reason = refused.to_string();
    assert!(
        reason.contains("\"acct/1\" is not a valid lock key"),
        "{reason}"
    );
    assert!(reason.contains("A-Z a-z 0-9 . _ : -"), "{reason}");
    assert_eq!(
        config(false).grants.grantable(&header, &odd).unwrap(),
        "acct/1"
    );
    let plain = AccountId::parse("acct-1", 64).unwrap();
    assert_eq!(
        config(true).grants.grantable(&header, &plain).unwrap(),
        "acct-1"
    );
}
