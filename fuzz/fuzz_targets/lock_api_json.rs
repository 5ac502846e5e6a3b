//! The lock API's request bodies: acquire (`holder`, `ttl_ms`, `wait_ms`) and renew/release
//! (`token`, `lease_secret`), parsed by the API's own functions.
//!
//! The input is a body. Checked: nothing panics; an accepted body is a JSON object; what is
//! accepted is within the service's limits and re-encodes to a body that parses to the same
//! request; the same body with one unknown field more is refused.
#![no_main]

use libfuzzer_sys::fuzz_target;
use railguard::lock::api::{parse_acquire, parse_token_body};
use railguard::lock::service::LockLimits;
use railguard::lock::{LeaseSecret, LockKey, parse_holder};
use railguard_sdk::wire::{AcquireRequest, TokenRequest};
use serde_json::Value;

/// `body` with one field no request type has.
fn with_unknown_field(body: &[u8]) -> Vec<u8> {
    let mut value: Value = serde_json::from_slice(body).expect("accepted, so JSON");
    value
        .as_object_mut()
        .expect("accepted, so an object")
        .insert("not_a_field".into(), Value::from(1));
    serde_json::to_vec(&value).unwrap()
}

fn check_acquire(body: &[u8], limits: &LockLimits) {
    let Ok(asked) = parse_acquire(body, limits) else {
        return;
    };
    assert!(serde_json::from_slice::<Value>(body).is_ok_and(|v| v.is_object()));
    if let Some(holder) = &asked.holder {
        assert_eq!(parse_holder(holder).as_ref(), Ok(holder));
    }
    assert!(limits.min_ttl <= asked.ttl && asked.ttl <= limits.max_ttl);
    assert!(asked.wait <= limits.max_wait);
    let again = serde_json::to_vec(&AcquireRequest {
        holder: asked.holder.clone().unwrap_or_default(),
        ttl_ms: asked.ttl.as_millis() as u64,
        wait_ms: asked.wait.as_millis() as u64,
    })
    .unwrap();
    assert_eq!(
        parse_acquire(&again, limits).ok(),
        Some(asked),
        "round trip"
    );
    assert!(parse_acquire(&with_unknown_field(body), limits).is_err());
}

fn check_token(body: &[u8]) {
    let Ok((token, secret)) = parse_token_body(body) else {
        return;
    };
    assert!(serde_json::from_slice::<Value>(body).is_ok_and(|v| v.is_object()));
    assert!(token.get() > 0);
    assert_eq!(LeaseSecret::parse(&secret.to_wire()), Ok(secret.clone()));
    let again = serde_json::to_vec(&TokenRequest {
        token: token.get(),
        lease_secret: Some(secret.to_wire()),
    })
    .unwrap();
    let reparsed = parse_token_body(&again).ok();
    assert!(reparsed == Some((token, secret)), "round trip");
    assert!(parse_token_body(&with_unknown_field(body)).is_err());
}

fuzz_target!(|body: &[u8]| {
    let limits = LockLimits::default();
    check_acquire(body, &limits);
    check_token(body);
    // The same bytes as a path's key or a bare holder name.
    if let Ok(text) = std::str::from_utf8(body) {
        if let Ok(key) = LockKey::parse(text) {
            assert_eq!(key.as_str(), text);
            assert_eq!(LockKey::parse(&key.to_string()), Ok(key));
        }
        if let Ok(holder) = parse_holder(text) {
            assert_eq!(holder, text);
        }
    }
});
