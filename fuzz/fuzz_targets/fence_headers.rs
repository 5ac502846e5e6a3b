//! The proxy's fencing headers: token, account, idempotency key and grant proof, as a client
//! can send them.
//!
//! The input is a list of headers, each `[name selector, value length, value...]`; values
//! that `http` would not carry (CR, LF, NUL...) are dropped, as hyper would refuse them. The
//! first byte sets the account length limit. Checked: nothing panics; whatever is accepted
//! was sent exactly once and reads back as the same value (a token prints back as its digits,
//! an account and a key as the text sent); a proof verifies exactly when it is the grant's
//! signature (hex in either case).
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;
use railguard::proof::ProofKey;
use railguard::proxy::extract::{BadRequest, fencing_headers, idempotency_key, single_header};
use railguard::proxy::idempotency::parse_key;
use railguard_sdk::token::{AccountId, FencingToken, TokenError};

const NAMES: [&str; 5] = [
    "fencing-token",
    "fencing-account",
    "idempotency-key",
    "fencing-proof",
    "x-other",
];

fn name(i: usize) -> HeaderName {
    HeaderName::from_static(NAMES[i])
}

/// The headers the input describes.
fn headers(mut data: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    while let [selector, len, rest @ ..] = data {
        let len = usize::from(*len).min(rest.len());
        let (value, rest) = rest.split_at(len);
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.append(name(usize::from(*selector) % NAMES.len()), value);
        }
        data = rest;
    }
    headers
}

/// The wire-form rules of C2 §2.2, checked on any text.
fn check_token_text(text: &str) {
    match FencingToken::parse(text) {
        Ok(token) => {
            assert!(token.get() > 0);
            let printed = token.to_string();
            assert_eq!(FencingToken::parse(&printed), Ok(token), "round trip");
            // Accepted text is digits only; leading zeros are the only difference.
            assert_eq!(text.trim_start_matches('0'), printed);
        }
        Err(TokenError::Empty) => assert!(text.is_empty()),
        Err(TokenError::NotDecimal) => {
            assert!(!text.is_empty() && !text.bytes().all(|b| b.is_ascii_digit()))
        }
        Err(TokenError::OutOfRange) => {
            assert!(text.bytes().all(|b| b.is_ascii_digit()));
            assert!(text.parse::<i64>().map_or(true, |v| v <= 0));
        }
    }
}

fn check_account_text(text: &str, max_len: usize) {
    match AccountId::parse(text, max_len) {
        Ok(account) => {
            assert_eq!(account.as_str(), text);
            assert!(!text.is_empty() && text.len() <= max_len);
            assert!(text.bytes().all(|b| b.is_ascii_graphic()));
            assert_eq!(AccountId::parse(&account.to_string(), max_len), Ok(account));
        }
        Err(_) => assert!(
            text.is_empty() || text.len() > max_len || !text.bytes().all(|b| b.is_ascii_graphic())
        ),
    }
}

fn check_proof(headers: &HeaderMap, token: FencingToken, account: &AccountId) {
    let key = ProofKey::from_bytes(&[7; 32]);
    let signed = key.sign(account.as_str(), token);
    assert!(key.verify(account.as_str(), token, &signed));
    let upper = format!("v1.{}", signed["v1.".len()..].to_ascii_uppercase());
    assert!(
        key.verify(account.as_str(), token, &upper),
        "hex in upper case"
    );
    if let Ok(proof) = single_header(headers, &name(3))
        && key.verify(account.as_str(), token, proof)
    {
        assert!(proof.len() == signed.len() && proof.starts_with("v1."));
        assert!(proof.eq_ignore_ascii_case(&signed), "{proof:?} verified");
    }
    // A proof is good for its own token only.
    if let Some(next) = token.get().checked_add(1).and_then(FencingToken::new) {
        assert!(!key.verify(account.as_str(), next, &signed));
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&max_len, rest)) = data.split_first() else {
        return;
    };
    let max_len = usize::from(max_len);
    if let Ok(text) = std::str::from_utf8(rest) {
        check_token_text(text);
        check_account_text(text, max_len);
    }
    let headers = headers(rest);
    let count = |i| headers.get_all(name(i)).iter().count();
    let text = |i| single_header(&headers, &name(i));

    match fencing_headers(&headers, &name(0), &name(1), max_len) {
        Ok((token, account)) => {
            assert_eq!((count(0), count(1)), (1, 1), "each header exactly once");
            assert_eq!(text(0).map(FencingToken::parse), Ok(Ok(token)));
            assert_eq!(text(1), Ok(account.as_str()));
            check_proof(&headers, token, &account);
        }
        Err(BadRequest::Header { header, .. }) => {
            let token_ok = text(0).is_ok_and(|t| FencingToken::parse(t).is_ok());
            let want = if token_ok { name(1) } else { name(0) };
            assert_eq!(
                header, want,
                "the error names the first header that is wrong"
            );
        }
        Err(other) => panic!("not a header error: {other}"),
    }

    for required in [false, true] {
        match idempotency_key(&headers, &name(2), required) {
            Ok(Some(key)) => {
                assert_eq!(count(2), 1);
                assert_eq!(text(2), Ok(key.as_str()));
                assert_eq!(parse_key(&key), Ok(key.clone()));
                assert!((1..=255).contains(&key.len()));
            }
            Ok(None) => assert!(!required && count(2) == 0),
            Err(BadRequest::Header { header, .. }) => assert_eq!(header, name(2)),
            Err(other) => panic!("not a header error: {other}"),
        }
    }
});
